"""``engine router`` exactly as the command line runs it, plus a status file for the chaos
driver: every 0.3 s the router's view of its workers (state, queues, KV blocks and staging held,
transfers in flight, from their heartbeats) and its own requests in flight, written atomically
to the path in CHAOS_STATUS_FILE. Run: ``python tests/chaos/router_proc.py router ARGS...``."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from engine.cli import main as cli
from engine.cluster.router import router as router_module


def _dump(router, path: str) -> None:
    while True:
        status = {
            "pid": os.getpid(),
            "time": time.time(),
            "workers": router.workers_status(),
            "in_flight": len(router._requests),
            "alive": router._thread.is_alive(),
            "conductor": _conductor(router),
        }
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(status, f)
        os.replace(tmp, path)
        time.sleep(0.3)


def _conductor(router) -> dict:
    """What the Conductor would estimate now for a chaos prompt (~68 tokens, cold or with 64
    cached), per prefill instance: its queue and the fitted prefill time (read racily: a view)."""
    placement = router._phases.placement
    c = getattr(placement, "conductor", None)
    if c is None:
        return {}
    try:
        now = placement.clock()
        return {
            "placed": c.placed(),
            "fitted": c.prefill_model.fitted,
            "prefill_s": [round(c.prefill_model.predict(68, 0), 3),
                          round(c.prefill_model.predict(4, 64), 3)],
            "queues_s": {i: round(c.prefill_queue_s(i, now), 3) for i in c._prefills},
        }  # fmt: skip
    except Exception as exc:  # a view taken while the IO thread changes it
        return {"error": repr(exc)}


def main() -> int:
    path = os.environ["CHAOS_STATUS_FILE"]
    original = router_module.Router.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        threading.Thread(target=_dump, args=(self, path), daemon=True).start()

    router_module.Router.__init__ = init
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
