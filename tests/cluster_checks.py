"""What the cluster tests check from outside a cluster: a request's streamed outputs, workers with
nothing held, /metrics samples by name and labels."""

import time

from prometheus_client.parser import text_string_to_metric_families


async def collect(router, prompt, params, rid=None):
    deltas, last = [], None
    async for out in router.generate(prompt, params, request_id=rid):
        deltas.append([c.new_token_ids for c in out.outputs])
        last = out
    return last, deltas


def wait_idle(cluster, timeout=30.0):
    """Until every worker's heartbeat shows no blocks, staging or transfers held."""
    deadline = time.monotonic() + timeout
    while True:
        st = cluster.router.workers_status()
        held = {k: (v["used_blocks"], v["staging_used"], v["transfers"]) for k, v in st.items()}
        if all(v == (0, 0, 0) for v in held.values()):
            return
        assert time.monotonic() < deadline, held
        time.sleep(0.2)


def samples(text: str) -> dict[tuple, float]:
    """(metric sample name, frozenset of labels but model_name) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def key(name: str, **labels) -> tuple:
    return (name, frozenset(labels.items()))
