"""Each fuzz module's start time (``START``), for the duration its reliability record gives."""

from __future__ import annotations

import time

import pytest


@pytest.fixture(scope="module", autouse=True)
def _module_clock(request):
    request.module.START = time.monotonic()
    yield
