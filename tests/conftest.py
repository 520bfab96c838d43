"""Test-wide set-up. TRITON_INTERPRET must be set before triton is first imported, whatever the
test order, so that Triton kernels run on CPU tensors through the interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import functools  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _reuse_loaded_models():
    """Engines built in one test session share loaded weights (loading copies them into the model,
    never mutates them), so tests can build engines with different cache/scheduler settings
    without re-reading and dequantizing the file each time."""
    import engine.llm_engine as llm_engine

    original = llm_engine.load_model

    @functools.lru_cache(maxsize=4)
    def cached(model, dtype=None, device="cpu", show_progress=True):
        return original(model, dtype=dtype, device=device, show_progress=False)

    llm_engine.load_model = lambda model, dtype=None, device="cpu", show_progress=True: cached(
        model, dtype, str(device)
    )
    yield
    llm_engine.load_model = original
