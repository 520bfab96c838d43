"""Hosts apart on one machine, for the cluster's tests and benchmarks (see lab.py)."""

from engine.netlab.lab import NetLab, enter, sweep_stale, unavailable

__all__ = ["NetLab", "enter", "sweep_stale", "unavailable"]
