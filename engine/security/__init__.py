"""Closed doors: CURVE authentication of ZeroMQ peers (curve.py), checks of the shared-memory
names processes pass to each other (shm_names.py), and ``engine keys generate`` (keys_cli.py)."""
