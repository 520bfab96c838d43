"""``engine generate --scheduling-policy priority --priority N ...`` on a tiny model: one priority
per ``--prompt``, answers printed in the prompts' order; a count that does not match, or a
priority under fcfs, is an error naming ``--priority`` (exit 2) before the model loads."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model

from engine.cli.main import main


@pytest.fixture(scope="module")
def base() -> list[str]:
    model = str(tiny_model("llama"))
    return ["generate", "--model", model, "--dtype", "float32", "--device", "cpu", "--raw",
            "--kv-cache-memory-gb", "0.05", "--max-tokens", "2", "--prompt", "a b", "--prompt",
            "c d"]  # fmt: skip


def test_priorities_per_prompt(base, capsys):
    argv = [*base, "--scheduling-policy", "priority", "--priority", "3", "--priority", "-1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.index(">>> a b") < out.index(">>> c d")  # printed in the prompts' order
    assert out.count("[2 tokens, finish: length]") == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--scheduling-policy", "priority", "--priority", "1"], "--priority given 1 times for 2"),
        (["--priority", "0", "--priority", "2"], "--priority other than 0 needs --scheduling"),
    ],
)
def test_bad_priorities_are_an_error_naming_them(base, capsys, extra, message):
    assert main([*base, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err  # before the model loads


def test_fcfs_takes_zeros(base, capsys):
    assert main([*base, "--priority", "0", "--priority", "0"]) == 0
    assert capsys.readouterr().out.count("finish: length") == 2
