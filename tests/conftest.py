"""Test-wide set-up. TRITON_INTERPRET must be set before triton is first imported, whatever the
test order, so that Triton kernels run on CPU tensors through the interpreter; ENGINE_CPU_ISA's
torch variables before torch is."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# engine before any test module imports torch: under ENGINE_CPU_ISA it sets the variables that
# cap torch and oneDNN, which they read once (engine/cpu_isa.py). It does not import torch.
import engine  # noqa: E402, F401

# Engines built in one test session share dequantized weights through a weight cache of the
# session's own (engine/model/weight_cache.py): the first engine of a model and dtype writes it,
# later ones map it, and the suite never reads or writes ~/.cache. Subprocesses (real servers and
# workers) inherit it.
if "ENGINE_WEIGHT_CACHE_DIR" not in os.environ:
    _weights = tempfile.mkdtemp(prefix="engine-test-weights-")
    os.environ["ENGINE_WEIGHT_CACHE_DIR"] = _weights
    atexit.register(shutil.rmtree, _weights, True)


def pytest_sessionfinish(session, exitstatus):
    """The reliability records the suites held (reliab_record.record_if_the_run_passes) are
    written only when the whole run passed; otherwise one line says why not."""
    from reliab_record import write_held_records

    interrupted = exitstatus == 2  # pytest.ExitCode.INTERRUPTED
    line = write_held_records(session.testsfailed, interrupted)
    if line:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line)
