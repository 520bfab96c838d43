"""KV transfer over Mooncake's Transfer Engine (``--kv-transport mooncake``), the path real
clusters use (RDMA there; TCP here), from the optional package ``mooncake-transfer-engine``.

The decode worker registers its staging arena with its engine and announces the engine's address
and the arena's base address; a prefill worker writes each layer's KV from a registered bounce
buffer straight into that memory (``transfer_sync_write``) and then sends the usual descriptor
(with its checksum) over ZeroMQ, as over shared memory. ``metadata`` is Mooncake's metadata
service URL, or ``P2PHANDSHAKE`` (the default: peers exchange metadata directly, no service).
"""

from __future__ import annotations

import threading

import torch

DEFAULT_METADATA = "P2PHANDSHAKE"


class MooncakeEndpoint:
    def __init__(self, host: str = "127.0.0.1", metadata: str = DEFAULT_METADATA) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:  # the optional dependency
            raise ValueError(
                "--kv-transport mooncake needs the mooncake-transfer-engine package "
                f"(pip install 'engine[mooncake]'): {exc}"
            ) from None
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, metadata, "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, {metadata!r}): {rc}")
        # Its segment's name, which peers open: with peer handshakes the engine appends its RPC
        # port; a metadata service keeps the segment under the name it was given.
        p2p = metadata == DEFAULT_METADATA
        self.address = f"{host}:{self.engine.get_rpc_port()}" if p2p else host
        self._bounce: torch.Tensor | None = None
        self._lock = threading.Lock()

    def register(self, tensor: torch.Tensor) -> int:
        """Register a tensor's memory for transfers; returns its address."""
        addr = tensor.data_ptr()
        rc = self.engine.register_memory(addr, tensor.numel() * tensor.element_size())
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory: {rc}")
        return addr

    def write(self, peer: str, src: torch.Tensor, remote_addr: int, bounce_bytes: int) -> bool:
        """Copy src's bytes into the peer's registered memory at remote_addr, through a
        registered bounce buffer of bounce_bytes (grown once on first use)."""
        raw = src.reshape(-1).view(torch.uint8)
        with self._lock:
            if self._bounce is None:
                self._bounce = torch.empty(bounce_bytes, dtype=torch.uint8)
                self._bounce_addr = self.register(self._bounce)
            done, n = 0, raw.numel()
            while done < n:
                part = min(n - done, self._bounce.numel())
                self._bounce[:part].copy_(raw[done : done + part])
                rc = self.engine.transfer_sync_write(
                    peer, self._bounce_addr, remote_addr + done, part
                )
                if rc != 0:
                    return False
                done += part
        return True
