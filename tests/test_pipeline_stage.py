"""A pipeline stage (engine/pipeline_stage.py, issue 22's chunked pipeline): ``--stage I/N``
parsed and checked, and which contiguous range of a model's layers each stage holds. What a model
built for a stage holds and reads: tests/model/test_stages.py."""

from __future__ import annotations

import pytest

from engine.pipeline_stage import WHOLE_MODEL, PipelineStage


def stages(n: int) -> list[PipelineStage]:
    return [PipelineStage(i, n) for i in range(n)]


def test_parse_and_properties():
    s = PipelineStage.parse(" 1/3 ")
    assert s == PipelineStage(1, 3) and str(s) == "1/3"
    assert not s.is_first and not s.is_last and not s.is_whole
    assert PipelineStage.parse("0/1") == WHOLE_MODEL and WHOLE_MODEL.is_whole
    assert WHOLE_MODEL.is_first and WHOLE_MODEL.is_last
    assert PipelineStage(0, 2).is_first and PipelineStage(1, 2).is_last


@pytest.mark.parametrize(
    "text, message",
    [
        ("2/2", r"stage index must be in \[0, 1\] for 2 stages \(stages count from 0\), got 2"),
        ("-1/2", r"stage index must be in \[0, 1\].*got -1"),
        ("0/0", "stage count must be at least 1, got 0"),
        ("1", "a stage is written I/N"),
        ("a/b", "a stage is written I/N"),
        ("1/2/3", "a stage is written I/N"),
        ("", "a stage is written I/N"),
    ],
)
def test_bad_specs_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        PipelineStage.parse(text)


def test_bad_fields_and_too_many_stages():
    with pytest.raises(ValueError, match="stage index must be an int, got '1'"):
        PipelineStage("1", 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stage count must be an int, got True"):
        PipelineStage(0, True)
    with pytest.raises(ValueError, match="stage 0/3: a model of 2 layers splits into at most 2"):
        PipelineStage(0, 3).layer_range(2)


@pytest.mark.parametrize("layers", range(1, 13))
def test_layer_ranges_are_contiguous_and_even_the_earlier_stages_take_the_rest(layers):
    for n in range(1, layers + 1):
        ranges = [s.layer_range(layers) for s in stages(n)]
        assert [i for r in ranges for i in r] == list(range(layers))
        sizes = [len(r) for r in ranges]
        assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
    assert [len(s.layer_range(30)) for s in stages(4)] == [8, 8, 7, 7]
