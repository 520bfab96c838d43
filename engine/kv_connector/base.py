"""The KV-connector seam: KV that lives outside the paged cache, loaded into it and saved from it.

The scheduler and the step loop know only this interface. The tiered pool is one implementation
(``kv_connector/pool.py``); the decode worker's receiver of a prefill worker's KV
(``cluster/transfer/receiver.py``, handed to the engine by the worker's connector factory) is
another; nothing here imports the cluster.
Smaller than vLLM's KVConnectorBase_V1 because our scheduler and model runner share a process:

- ``lookup``: how many of a request's next tokens (after those already in the device cache) the
  source holds. The scheduler then allocates blocks for them and calls ``start_load``.
- The request waits in its own state (``RequestStatus.LOADING_KV``): it holds its blocks, is not
  scheduled, and does not hold up the step loop. ``finished_loads``, called by the scheduler at the
  start of every step (on the engine thread, so the connector may write the cache there), reports
  loads that ended. A load that brought fewer tokens than promised (a miss, a bad record, a dead
  service) is not an error for the request: it recomputes the rest.
- Saving: after every step ``save`` gets the request's newly computed full blocks; a connector that
  needs KV layer by layer (layer-wise streaming) sets ``per_layer`` and gets ``save_layer`` calls
  from the model's layer hook, after layer i wrote its KV for the whole step.
- ``request_finished``: the request ended (finished, aborted, preempted while loading); the
  connector must stop touching its blocks before returning, since they are freed right after.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from engine.core.request import Request
    from engine.core.scheduler_output import ScheduledRequest


class LoadDone(NamedTuple):
    request_id: str
    num_tokens: int  # tokens now in the cache, from the start token of the load on (a prefix)
    sources: dict[str, int]  # tokens per source ("dram", "ssd", "remote", ...)
    error: str | None = None  # why fewer tokens than promised arrived, if they did


class StepBlocks(NamedTuple):
    """A request's part of a step, as ``save_layer`` sees it: the cache slots its tokens of this
    step were written to (flat-batch order) and its block table."""

    request: Request
    slots: Sequence[int]
    block_table: Sequence[int]


class KVConnector(ABC):
    per_layer: bool = False  # True: save_layer(i, step) is called after each layer

    @abstractmethod
    def lookup(self, req: Request, block_hashes: Sequence[bytes], num_device_tokens: int) -> int:
        """Tokens after the first ``num_device_tokens`` that this source can load now. At least
        one of the request's tokens must be left to compute (its logits are needed), so the
        answer is at most ``req.num_tokens - 1 - num_device_tokens``."""

    @abstractmethod
    def start_load(
        self, req: Request, block_table: Sequence[int], start_token: int, num_tokens: int
    ) -> None:
        """Begin filling the cache with tokens [start_token, start_token + num_tokens) of req, in
        the blocks of block_table (the request's whole table, already allocated). Must not block;
        completion is reported by finished_loads."""

    @abstractmethod
    def finished_loads(self) -> list[LoadDone]:
        """Loads that ended since the last call. Called on the engine thread between steps."""

    def wait(self, timeout: float) -> None:  # noqa: B027 (optional)
        """Block up to timeout seconds until a load may have ended (the engine has nothing else
        to run)."""

    def save(  # noqa: B027 (optional)
        self,
        req: Request,
        block_table: Sequence[int],
        block_hashes: Sequence[bytes],
        first_block: int,
        num_blocks: int,
    ) -> None:
        """Blocks [first_block, first_block + num_blocks) of req became full and computed this
        step. Must not block the step loop on IO."""

    def save_layer(self, layer: int, step: Sequence[StepBlocks]) -> None:  # noqa: B027
        """Layer ``layer`` wrote this step's KV (only when per_layer)."""

    def request_finished(self, req: Request) -> None:  # noqa: B027 (optional)
        """req ended; stop touching its blocks before returning."""

    def stats(self) -> dict:
        return {}

    def close(self) -> None:  # noqa: B027 (optional)
        pass


class WrapsPool(KVConnector):
    """A connector with a job of its own (the cluster's KV transfer) that hands the worker's KV
    pool work (saves, waits, stats) to ``inner``, when there is one."""

    inner: KVConnector | None = None

    def wait(self, timeout: float) -> None:
        if self.inner is not None:
            self.inner.wait(timeout)

    def save(
        self,
        req: Request,
        block_table: Sequence[int],
        block_hashes: Sequence[bytes],
        first_block: int,
        num_blocks: int,
    ) -> None:
        if self.inner is not None:
            self.inner.save(req, block_table, block_hashes, first_block, num_blocks)

    def stats(self) -> dict:
        return self.inner.stats() if self.inner is not None else {}


def step_blocks(
    order: Sequence[ScheduledRequest], slot_mapping: Sequence[int], tables: dict[str, list[int]]
) -> list[StepBlocks]:
    """Split a step's flat slot mapping into per-request parts (for per-layer savers)."""
    out, i = [], 0
    for s in order:
        rid = s.request.request_id
        out.append(StepBlocks(s.request, slot_mapping[i : i + s.num_tokens], tables[rid]))
        i += s.num_tokens
    return out
