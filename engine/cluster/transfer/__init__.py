"""The P/D transport: how a prefill worker's KV reaches a decode worker.

``sender.py`` (prefill side) and ``receiver.py`` (decode side) implement the KV-connector seam
(``engine/kv_connector/base.py``) over the cluster's KV messages (``cluster/messages.py``);
``state.py`` is one transfer as the receiver sees it and ``writers.py`` who may still write into
its staging area; ``staging.py`` the decode worker's staging arena and the gathers and scatters
between it and the paged cache; ``shm_proof.py`` the proof that two workers share /dev/shm;
``mooncake.py`` the Mooncake Transfer Engine path; ``seal.py`` the seal of a hand-over;
``faults.py`` fault injection for the chaos tests.
"""
