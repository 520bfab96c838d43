"""The cluster simulator and the reproduction of the Mooncake papers' scheduling results.

- ``trace``: Mooncake-format request traces and the bundled one (``DEFAULT_TRACE``);
- ``simulator``: a discrete-event simulator of a disaggregated (or colocated) cluster that runs
  the engine's own Conductor and eviction policies on simulated time (``SimConfig``,
  ``Simulator``);
- ``instances``: the state of the simulated instances it drives (their prefix caches,
  ``SimCache``; the requests, prefill and decode instances);
- ``simulate``: the body of ``python profiling/simulate.py``;
- ``reproduce``: the body of ``python profiling/reproduce.py`` (``make reproduce``), which writes
  docs/reproduction.md: its experiments are in ``experiments``, its plots in ``plots``, the
  document in ``report``.

This package imports the engine (``engine.cluster.conductor``, ``engine.kvstore.eviction``); the
engine never imports it (tests/sim/test_layering.py).
"""
