"""Streaming detokenization: one token at a time gives exactly decode(all ids)."""

from __future__ import annotations

import pytest
from spm_models import LLAMA_STYLE, SPM_TEXTS, TEXTS, train_spm, write_spm_gguf
from tiny_models import smollm2_tokenizer

from engine.core.detokenizer import IncrementalDetokenizer
from engine.model.gguf_loader import read_gguf
from engine.model.tokenizer import Tokenizer, tokenizer_from_gguf

STREAM_TEXTS = TEXTS + [
    "🤦🏼‍♂️🧑‍🤝‍🧑👩🏾‍🔬 ZWJ sequences back to back",
    "CJK 漢字仮名交じり文 then emoji 🐉🐲 then Hangul 한국어 텍스트",
    "<|im_start|>assistant\nSure! 🎉<|im_end|>trailing",
]


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory) -> Tokenizer:
    path = write_spm_gguf(train_spm(**LLAMA_STYLE), tmp_path_factory.mktemp("spm") / "t.gguf")
    return tokenizer_from_gguf(read_gguf(str(path))[0])


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add_tokens([i]) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_byte_level_stream_equals_decode(text, skip_special_tokens):
    tok = smollm2_tokenizer()
    ids = tok.encode(text)
    deltas = stream(tok, ids, skip_special_tokens)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in d for d in deltas)


def test_split_characters_are_held_back():
    tok = smollm2_tokenizer()
    ids = tok.encode("👨‍👩‍👧")
    # Byte-level BPE splits this emoji sequence into several tokens, some holding partial bytes.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add_tokens([i]) for i in ids]
    assert "" in deltas[:-1]  # something was held back
    assert "".join(deltas) == "👨‍👩‍👧" == detok.text


def test_flush_emits_an_incomplete_character():
    tok = smollm2_tokenizer()
    ids = tok.encode("ok 😀")
    head = ids[:-1]  # the emoji's last byte is missing
    detok = IncrementalDetokenizer(tok)
    assert detok.add_tokens(head) in ("ok", "ok ")  # the space may share a token with the emoji
    rest = detok.flush()
    assert rest.endswith("\ufffd")
    assert detok.text == tok.decode(head)
    assert detok.flush() == ""


def test_many_tokens_at_once():
    tok = smollm2_tokenizer()
    ids = tok.encode(STREAM_TEXTS[-2])
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add_tokens(ids[i : i + 3]) for i in range(0, len(ids), 3))
    assert text + detok.flush() == tok.decode(ids)


@pytest.mark.parametrize("text", SPM_TEXTS + ["🦀🦀 crab ünïcödé", "first second  third"])
def test_sentencepiece_stream_equals_decode(spm_tokenizer, text):
    # Byte-fallback tokens (<0xF0> ...) and the leading-space strip of the first token.
    ids = spm_tokenizer.encode(text)
    deltas = stream(spm_tokenizer, ids)
    assert "".join(deltas) == spm_tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_between_words(spm_tokenizer):
    ids = spm_tokenizer.encode("hello", add_special_tokens=False)
    ids = ids + [2] + spm_tokenizer.encode("world", add_special_tokens=False) + [2]
    for skip in (True, False):
        deltas = stream(spm_tokenizer, ids, skip)
        assert "".join(deltas) == spm_tokenizer.decode(ids, skip_special_tokens=skip)
