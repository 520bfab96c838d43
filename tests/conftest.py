"""Test-wide set-up. TRITON_INTERPRET must be set before triton is first imported, whatever the
test order, so that Triton kernels run on CPU tensors through the interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
