"""Host staging buffers kept from one KV load for the next (engine/kv_connector/staging.py)."""

from __future__ import annotations

import torch

from engine.kv_connector.device_copy import HostCopier
from engine.kv_connector.staging import StagingCache


class Waited:
    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> None:
        self.waited = True


def test_a_buffer_given_back_serves_the_next_take_that_fits():
    cache = StagingCache(HostCopier("cpu"))
    a = cache.take((4, 3, 16), torch.bfloat16)
    assert a.shape == (4, 3, 16) and a.dtype == torch.bfloat16
    ptr = a.data_ptr()
    ready = Waited()
    cache.give(a[:2], ready)  # a view of it (the loaded part) gives the whole buffer back
    b = cache.take((2, 3, 16), torch.int8)  # smaller, another dtype: a view of the same bytes
    assert b.data_ptr() == ptr and b.shape == (2, 3, 16) and b.dtype == torch.int8
    assert ready.waited  # not reused before the last copy from it was done
    c = cache.take((4, 3, 16), torch.bfloat16)  # none free: a new one
    assert c.data_ptr() != ptr
    assert (cache.reused, cache.allocated) == (1, 2)


def test_the_smallest_buffer_that_fits_is_taken_and_the_kept_bytes_are_bounded():
    cache = StagingCache(HostCopier("cpu"), keep_bytes=3000)
    big, small = cache.take((2000,), torch.uint8), cache.take((1000,), torch.uint8)
    cache.give(big)
    cache.give(small)
    assert cache.kept_bytes() == 3000
    assert cache.take((800,), torch.uint8).data_ptr() == small.data_ptr()
    cache.give(small)
    cache.give(small)  # given twice: kept once
    assert cache.kept_bytes() == 3000
    cache.give(cache.take((1500,), torch.uint8))  # the big one again
    cache.give(torch.empty(2500, dtype=torch.uint8))  # over the bound: the oldest go
    assert cache.kept_bytes() <= 3000
    cache.give(None)  # a load that never got a buffer
