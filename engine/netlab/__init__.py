"""Hosts apart on one machine, for the cluster's tests and benchmarks (see lab.py)."""

from engine.netlab.lab import NetLab, sweep_stale, unavailable

__all__ = ["NetLab", "sweep_stale", "unavailable"]
