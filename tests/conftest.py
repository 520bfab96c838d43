"""Test-wide set-up. TRITON_INTERPRET must be set before triton is first imported, whatever the
test order, so that Triton kernels run on CPU tensors through the interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# Engines built in one test session share dequantized weights through a weight cache of the
# session's own (engine/weight_cache.py): the first engine of a model and dtype writes it, later
# ones map it, and the suite never reads or writes ~/.cache. Subprocesses (real servers and
# workers) inherit it.
if "ENGINE_WEIGHT_CACHE_DIR" not in os.environ:
    _weights = tempfile.mkdtemp(prefix="engine-test-weights-")
    os.environ["ENGINE_WEIGHT_CACHE_DIR"] = _weights
    atexit.register(shutil.rmtree, _weights, True)
