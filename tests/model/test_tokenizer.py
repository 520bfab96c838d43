"""Tokenizers built from GGUF metadata and HF directories, vs transformers and sentencepiece."""

from __future__ import annotations

import os

import jinja2
import pytest
import sentencepiece as spm
from spm_models import LLAMA_STYLE, SPM_CORPUS, SPM_TEXTS, TEXTS, train_spm, write_spm_gguf
from tiny_models import smollm2_tokenizer, tiny_model

from engine.model.gguf_loader import read_gguf
from engine.model.hf_loader import load_hf_tokenizer, sentencepiece_model_file
from engine.model.loader import resolve_model_path
from engine.model.tokenizer import Tokenizer, tokenizer_from_gguf

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, 用中文."},
    ],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    path = resolve_model_path("default")
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_encode_decode_match_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"]
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    if "<|" not in text:
        assert ours.decode(ids) == text


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_other_byte_level_splits_match_transformers(pre):
    # SmolLM2's vocabulary with another tokenizer.ggml.pre: only the split regex changes.
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    meta, _ = read_gguf(resolve_model_path("default"))
    ours = tokenizer_from_gguf({**meta, "tokenizer.ggml.pre": pre})
    fields = {k: meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "merges", "token_type")}
    hf, _ = convert_gguf_tokenizer(
        "llama", {"tokenizer_type": "gpt2", "pre_tokenizer_type": pre, **fields}
    )
    extra = ["Let's see: I'M sure we'd've DONE IT 1234567", "\n\n  \t x  \r\n\r\n y", "a1b22c333"]
    for text in TEXTS + extra:
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text).ids, text


def test_smollm2_numerals_split_one_by_one(ours):
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) splits every \p{N}
    # character off; transformers' GGUF path ignores tokenizer.ggml.pre "smollm" and keeps runs
    # like "٣٤" or " ½" together, so it differs here.
    ids = ours.encode("x ½ ٣٤ ①")
    pieces = ours.convert_ids_to_tokens(ids)
    assert ours.decode(ids) == "x ½ ٣٤ ①"
    assert "Ġ" in pieces  # the space before "½" is its own piece, not merged with the numeral
    assert len([p for p in pieces if p == "Ġ"]) == 3


def test_smollm2_special_tokens(ours):
    assert ours.bos_token_id == 1
    # eos (2, <|im_end|>) first, then <|endoftext|>, which llama.cpp also treats as an end.
    assert ours.eos_token_ids == (2, 0)
    assert ours.eos_token_id == 2
    assert ours.vocab_size == 49152
    assert set(range(17)) == set(ours.all_special_ids)
    assert ours.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert ours.encode("hi")[0] != 1  # SmolLM2 says add_bos_token False
    ids = ours.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids) == "hi"


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(ours, hf, conversation, add_generation_prompt):
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    ids = ours.apply_chat_template(conversation, tokenize=True)
    assert ids == ours.encode(ours.apply_chat_template(conversation), add_special_tokens=False)


def test_chat_template_sandbox_and_globals():
    tok = Tokenizer(smollm2_tokenizer().backend, special_tokens={"bos_token": "<s>"})
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '<s>"é"'
    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        tok.apply_chat_template([])
    tok.chat_template = "{{ messages.append(1) }}"  # templates cannot mutate their input
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([])
    tok.chat_template = "{% generation %}kept{% endgeneration %}{{ extra }}"
    assert tok.apply_chat_template([], extra="!") == "kept!"
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([])


def test_hf_directory_tokenizer_matches_transformers():
    from transformers import AutoTokenizer

    # (Not the qwen2 model: transformers 5 picks Qwen2Tokenizer for it by model_type and swaps
    # in Qwen2's own pre-tokenizer, ignoring tokenizer.json.)
    directory = tiny_model("llama")
    ours = load_hf_tokenizer(str(directory), {}, {"eos_token_id": [2, 0], "bos_token_id": 1})
    hf = AutoTokenizer.from_pretrained(directory)
    for text in TEXTS:
        assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.apply_chat_template(CONVERSATIONS[1]) == hf.apply_chat_template(
        CONVERSATIONS[1], add_generation_prompt=True, tokenize=False
    )
    assert ours.eos_token_ids == (2, 0) and ours.bos_token_id == 1


# --- SentencePiece ("llama" GGUF vocabularies and tokenizer.model) ---------------------------


@pytest.fixture(scope="module")
def spm_llama(tmp_path_factory):
    proto = train_spm(**LLAMA_STYLE)
    path = write_spm_gguf(proto, tmp_path_factory.mktemp("spm") / "spm.gguf")
    return spm.SentencePieceProcessor(model_proto=proto), path


def test_sentencepiece_gguf_matches_sentencepiece(spm_llama):
    sp, path = spm_llama
    ours = tokenizer_from_gguf(read_gguf(str(path))[0])
    for text in SPM_TEXTS + SPM_CORPUS.splitlines():
        ids = ours.encode(text)
        assert ids == [1] + sp.encode(text), text  # llama vocabularies add BOS by default
        assert ours.decode(ids) == sp.decode(ids[1:])
        assert "▁" in text or ours.decode(ids) == text  # a literal "▁" decodes as a space
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x"
    # user-defined pieces are matched whole, like special tokens, but decoded as text
    assert ours.encode("<tool>", add_special_tokens=False) == [3]
    ids = ours.encode("a</s>b", add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == "a</s> b"  # llama.cpp: "▁" after specials


def test_sentencepiece_gguf_matches_transformers(spm_llama):
    from transformers import AutoTokenizer

    _, path = spm_llama
    ours = tokenizer_from_gguf(read_gguf(str(path))[0])
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in SPM_TEXTS:
        if text.startswith(" "):
            # transformers' Metaspace does not add the dummy "▁" before a leading space, so it
            # drops one space ("  x" -> "▁▁x" -> " x"); sentencepiece and llama.cpp keep it.
            continue
        assert ours.encode(text) == hf(text)["input_ids"], text


@pytest.mark.parametrize(
    "model_type,options",
    [("bpe", LLAMA_STYLE), ("unigram", LLAMA_STYLE), ("unigram", {}), ("bpe", {})],
    ids=["bpe-identity", "unigram-identity", "unigram-nfkc", "bpe-nfkc"],
)
def test_tokenizer_model_file_matches_sentencepiece(tmp_path, model_type, options):
    proto = train_spm(model_type, **options)
    (tmp_path / "tokenizer.model").write_bytes(proto)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    backend = sentencepiece_model_file(str(tmp_path / "tokenizer.model"))
    texts = SPM_TEXTS + SPM_CORPUS.splitlines()[:80]
    if options:  # llama-style: no text normalisation, so decoding gives the text back
        for text in texts:
            ids = backend.encode(text, add_special_tokens=False).ids
            assert ids == sp.encode(text), text
            assert backend.decode(ids) == sp.decode(ids)
    else:  # NFKC and whitespace clean-up: compare on text without runs of spaces at the ends
        for text in texts:
            text = " ".join(text.split())
            assert backend.encode(text, add_special_tokens=False).ids == sp.encode(text), text
