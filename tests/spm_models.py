"""SentencePiece fixtures shared by the tokenizer and detokenizer tests: texts, a model trained on
the engine's own tokenizer source, and a GGUF that holds only its tokenizer."""

from __future__ import annotations

import io
from pathlib import Path

import gguf
import sentencepiece as spm

REPO = Path(__file__).resolve().parents[1]

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Numbers 12345 and 3.14159, dates 2024-05-01, money $1,000,000.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "こんにちは世界。カタカナとひらがなと漢字が混ざった文章です。",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "Привет, мир! Как дела? Ёлки-палки.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\t\ttabs, newlines\n\n\nand \r\n windows endings",
    "emoji 👍🏽 family 👨‍👩‍👧‍👦 flag 🏳️‍🌈 heart ❤️ jp 🇯🇵 face 🤦‍♂️",
    "mixed: English 中文 日本語 العربية русский 😀 code `x += 1`",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "",
    " ",
    "a" * 300,
]


SPM_CORPUS = (REPO / "engine" / "model" / "tokenizer.py").read_text() + (
    "日本語のテキストも少し。中文也有一点。Привет, мир! Ελληνικά. 12345 67890\n" * 5
)
SPM_TEXTS = [
    "Hello world",
    "def tokenizer_from_gguf(meta):\n    return x",
    "日本語 emoji 👍🏽 ü",
    "  two leading spaces",
    "trailing  ",
    "numbers 12345",
    "Привет мир",
    "a\tb\n\nc",
    "unseen: ŝ ƒ 🦀 Ω",
    "",
]


def train_spm(model_type: str = "bpe", **options) -> bytes:
    """A small SentencePiece model trained on this repository's tokenizer source."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS.splitlines()),
        model_writer=model,
        vocab_size=800,
        model_type=model_type,
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        user_defined_symbols=["<tool>"],
        minloglevel=2,
        num_threads=1,
        **options,
    )
    return model.getvalue()


LLAMA_STYLE = dict(normalization_rule_name="identity", remove_extra_whitespaces=False)


def write_spm_gguf(proto: bytes, path: Path) -> Path:
    """A GGUF holding only the tokenizer of a SentencePiece model, as llama.cpp writes it."""
    sp = spm.SentencePieceProcessor(model_proto=proto)
    n = sp.get_piece_size()

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if sp.id_to_piece(i) == "<tool>" else 1

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", [sp.id_to_piece(i) for i in range(n)])
    writer.add_array("tokenizer.ggml.scores", [sp.get_score(i) for i in range(n)])
    writer.add_array("tokenizer.ggml.token_type", [kind(i) for i in range(n)])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    writer.add_string("tokenizer.chat_template", "{{ bos_token }}{{ messages[0]['content'] }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
