"""The engine's tokenizer: a ``tokenizers.Tokenizer`` plus what the model file says around it
(BOS and end-of-generation ids, whether BOS is added, the chat template).

Builders make the ``tokenizers`` backend from bare vocabularies, as a GGUF file or a
SentencePiece ``tokenizer.model`` stores them: byte-level BPE (GPT-2 style, with the split regex
that ``tokenizer.ggml.pre`` names, as llama.cpp splits) and SentencePiece (tokens, scores and
token types, with byte fallback; BPE, or Unigram for a unigram tokenizer.model). Hugging Face
directories usually bring a ``tokenizer.json`` and need neither (see hf_loader.py)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

# Token types, the same numbers in GGUF (tokenizer.ggml.token_type) and SentencePiece protos.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how text is split before BPE, as llama.cpp's llama-vocab.cpp does it.
# "gpt2" is the GPT-2 regex (ByteLevel's own); "digits" splits off every digit first (StarCoder).
_PRE_TOKENIZERS = {
    **dict.fromkeys(("gpt2", "gpt-2", "phi-2", "default", "mpt", "olmo", "jais"), "gpt2"),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        "digits",
    ),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "kormo"), "qwen2"),
}
# llama.cpp sets ignore_merges (a word found whole in the vocabulary is one token) and adds BOS
# for these.
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "falcon3")
# Tokens with these spellings end generation in llama.cpp whatever eos the file names
# (llama-vocab.cpp, special_eog_ids): a chat model ends its turn with them.
_END_OF_GENERATION = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<end_of_utterance>",
)


class Tokenizer:
    """Text <-> token ids for one model. ``eos_token_ids[0]`` is the model's eos; the rest are
    other tokens that also end generation (a chat model's end-of-turn token, say)."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        # bos_token, eos_token, unk_token, pad_token spelled out, for chat templates.
        self.special_tokens = dict(special_tokens or {})
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: list[int] = sorted(i for i, tok in added.items() if tok.special)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens`` adds BOS/EOS where the model asks for them;
        special tokens written in the text (``<|im_start|>``) are always recognised."""
        # The batch call releases the GIL while it works (encode does not), so a long text
        # tokenized on a worker thread does not stall the servers' event loop.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) < 256:  # short: the batch call's overhead is not worth it
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render the model's Jinja chat template, as transformers does. Extra keyword arguments
        (tools, enable_thinking ...) are passed to the template."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        context = {**self.special_tokens, **kwargs}
        text = _compile_template(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **context
        )
        # The template writes BOS itself where the model wants it.
        return self.encode(text, add_special_tokens=False) if tokenize else text


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker) renders its
    body unchanged, so templates that use it work here."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def template_variables(source: str | None) -> set[str]:
    """The variables a chat template reads from its context (``tools`` if it renders tools);
    empty for no template or one that does not parse."""
    if not source:
        return set()
    try:
        env = _compile_template(source).environment
        return set(jinja2.meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateError:
        return set()


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF file's ``tokenizer.*`` metadata describes (``meta``: key -> value)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind == "gpt2":
        backend = byte_level_bpe(tokens, meta["tokenizer.ggml.merges"], pre)
        default_add_bos = pre in _LLAMA3_PRE  # llama.cpp adds BOS for Llama 3 vocabularies
    elif kind == "llama":
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        backend = sentencepiece(
            tokens,
            meta["tokenizer.ggml.scores"],
            types,
            unk_token=tokens[unk] if unk is not None else None,
            add_space_prefix=meta.get("tokenizer.ggml.add_space_prefix", True),
        )
        default_add_bos = True
    else:
        raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (gpt2, llama)")
    add_special_tokens_by_type(backend, tokens, types)

    def spelled(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    add_bos = meta.get("tokenizer.ggml.add_bos_token", default_add_bos)
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    set_post_processor(
        backend, spelled("bos") if add_bos else None, spelled("eos") if add_eos else None
    )
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos += [i for i, t in enumerate(tokens) if t in _END_OF_GENERATION]
    specials = {
        "bos_token": spelled("bos"),
        "eos_token": spelled("eos"),
        "unk_token": spelled("unknown"),
        "pad_token": spelled("padding"),
    }
    return Tokenizer(
        backend,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[i for i in eos if i is not None],
        chat_template=meta.get("tokenizer.chat_template"),
        special_tokens={k: v for k, v in specials.items() if v is not None},
    )


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], pre: str) -> Backend:
    """GPT-2 style byte-level BPE. ``tokens`` are spelled in GPT-2's byte alphabet; ``merges``
    are "left right" strings; ``pre`` is llama.cpp's pre-tokenizer name."""
    split = _PRE_TOKENIZERS.get(pre)
    if split is None:
        # llama.cpp also falls back to a default split for names it does not know.
        warnings.warn(
            f"unknown tokenizer.ggml.pre {pre!r}; splitting text as GPT-2 does", stacklevel=2
        )
        split = "gpt2"
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}  # first id wins
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRE)
    )
    if split in ("gpt2", "digits"):
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        steps = [pre_tokenizers.Digits(individual_digits=True)] if split == "digits" else []
    else:
        regex = _LLAMA3_SPLIT if split == "llama3" else _QWEN2_SPLIT
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        steps = [pre_tokenizers.Split(Regex(regex), behavior="isolated")]
    backend.pre_tokenizer = pre_tokenizers.Sequence([*steps, byte_level])
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece(
    tokens: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    *,
    unk_token: str | None,
    add_space_prefix: bool = True,
    unigram: bool = False,
    pre_normalizers: Sequence[normalizers.Normalizer] = (),
) -> Backend:
    """A SentencePiece vocabulary with byte fallback. BPE (the default, and what llama.cpp does
    for every "llama" GGUF vocabulary) merges, at each step, the adjacent pair whose joined piece
    scores highest; BPE merges ranked by that score do the same. ``unigram`` picks the
    highest-scoring segmentation instead (tokenizers' Unigram)."""
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}
    if unigram:
        model = models.Unigram(
            list(zip(tokens, (float(s) for s in scores))),
            unk_id=vocab.get(unk_token) if unk_token is not None else None,
            byte_fallback=True,
        )
    else:
        normal = {tok: score for tok, score, kind in zip(tokens, scores, types) if kind == NORMAL}
        ranked = []
        for piece, score in normal.items():
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in normal and right in normal:
                    ranked.append((-score, vocab[left], vocab[right], left, right))
        ranked.sort()
        model = models.BPE(
            vocab=vocab,
            merges=[(left, right) for *_, left, right in ranked],
            unk_token=unk_token,
            fuse_unk=True,
            byte_fallback=True,
        )
    backend = Backend(model)
    # Spaces become "▁", and every stretch of text between special tokens gets a leading "▁", as
    # in llama.cpp and Llama 2's tokenizer.json (Metaspace would skip it when the text starts with
    # a space, and sentencepiece itself does not).
    steps = [*pre_normalizers, normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        steps.insert(len(pre_normalizers), normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    decoding = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decoding.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(decoding)
    return backend


def add_special_tokens_by_type(backend: Backend, tokens: Sequence[str], types: Sequence[int]):
    """Control and unknown tokens become special added tokens (matched whole in text, skipped when
    decoding with skip_special_tokens); user-defined tokens are matched whole but not special."""
    special = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, types)
        if kind in (CONTROL, UNKNOWN)
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(
        [
            AddedToken(tok, special=False, normalized=False)
            for tok, kind in zip(tokens, types)
            if kind == USER_DEFINED
        ]
    )


def set_post_processor(backend: Backend, bos: str | None, eos: str | None) -> None:
    """Add ``bos`` before and ``eos`` after every encoded text (None: add nothing there)."""
    head = [bos] if bos is not None else []
    tail = [eos] if eos is not None else []
    if not head and not tail:
        backend.post_processor = None
        return
    backend.post_processor = processors.TemplateProcessing(
        single=[*head, "$A", *tail],
        pair=[*head, "$A", *tail, *head, "$B:1", *tail],
        special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(head + tail)],
    )
