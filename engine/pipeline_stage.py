"""A pipeline stage: which contiguous range of a model's layers one prefill node of a chunked
pipeline (issue 22, Mooncake's CPP) holds. The first stage also holds the embedding, the last the
final norm and the LM head (and the embedding too when the LM head is tied to it).

The layers split as evenly as possible; where they do not divide, the earlier stages take one
layer more each (30 layers in 4 stages: 8, 8, 7, 7). The last stage's LM head costs it extra
work per chunk only for the rows that sample, so nothing is moved away from it.

    PipelineStage.parse("1/3")                # the CLI's --stage I/N, I from 0
    PipelineStage(1, 3).layer_range(30)       # range(10, 20)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineStage:
    index: int  # 0 .. count - 1
    count: int  # stages in the pipeline; 1: the whole model

    def __post_init__(self) -> None:
        for name in ("index", "count"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"stage {name} must be an int, got {value!r}")
        if self.count < 1:
            raise ValueError(f"stage count must be at least 1, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(
                f"stage index must be in [0, {self.count - 1}] for {self.count} stages "
                f"(stages count from 0), got {self.index}"
            )

    @classmethod
    def parse(cls, text: str) -> PipelineStage:
        """``"I/N"``: stage I (from 0) of N, as ``--stage`` spells it."""
        index, sep, count = text.strip().partition("/")
        try:
            if not sep:
                raise ValueError
            i, n = int(index), int(count)
        except ValueError:
            raise ValueError(
                f"a stage is written I/N (stage I of N, I from 0, e.g. 0/2), got {text!r}"
            ) from None
        return cls(i, n)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def is_whole(self) -> bool:
        """The only stage: the whole model."""
        return self.count == 1

    def layer_range(self, num_layers: int) -> range:
        """The global indices of this stage's layers in a model of ``num_layers``."""
        if num_layers < self.count:
            raise ValueError(
                f"stage {self}: a model of {num_layers} layers splits into at most "
                f"{num_layers} stages, not {self.count}"
            )
        base, extra = divmod(num_layers, self.count)
        start = self.index * base + min(self.index, extra)
        return range(start, start + base + (self.index < extra))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


WHOLE_MODEL = PipelineStage(0, 1)
