"""The step loop's calls into the KV connector (engine/kv_connector/base.py): each layer's KV
handed over from the model's layer hook, and the blocks a step filled."""

from __future__ import annotations

from engine.core.scheduler_output import SchedulerOutput
from engine.kv_connector.base import KVConnector, step_blocks
from engine.kvcache.kv_cache_manager import KVCacheManager
from engine.model.llama import LayerHook


def layer_hook(
    connector: KVConnector | None, user: LayerHook | None, inputs, kv: KVCacheManager
) -> LayerHook | None:
    """The model's per-layer callback for one step (``inputs`` from ``ModelRunner.prepare``):
    ``user``'s and, when the connector wants KV layer by layer, its ``save_layer`` over this
    step's slots."""
    if connector is None or not connector.per_layer:
        return user
    step = step_blocks(inputs.order, inputs.slots.tolist(), kv.block_tables)

    def hook(i: int) -> None:
        connector.save_layer(i, step)
        if user is not None:
            user(i)

    return hook


def save_new_blocks(connector: KVConnector, kv: KVCacheManager, sched: SchedulerOutput) -> None:
    """Hand the connector every block that became full and computed in this step."""
    for s in sched.scheduled:
        req = s.request
        if req.is_finished:
            continue  # freed already; a finished request's last block is never full anyway
        save_committed_blocks(connector, kv, req, req.num_computed_tokens - s.num_real_tokens)


def save_committed_blocks(
    connector: KVConnector, kv: KVCacheManager, req, computed_before: int
) -> None:
    """Hand the connector the blocks of ``req`` that became full and computed as its computed
    count rose from ``computed_before`` (a step's tokens, or the drafts a step kept)."""
    bs = kv.block_size
    before, after = computed_before // bs, req.num_computed_tokens // bs
    if after > before:
        table = kv.block_tables[req.request_id]
        connector.save(req, table, kv.block_hashes(req), before, after - before)
