"""``engine.client``, the documented home of the RPC clients (``RPCClient``, ``AsyncRPCClient``).

The code lives in ``engine/server/rpc_client.py``, beside the server it talks to."""

from engine.server.rpc_client import (  # noqa: F401
    DEFAULT_ADDRESS,
    AsyncRPCClient,
    Completion,
    GenerateResult,
    RPCClient,
    RPCError,
    RPCTimeoutError,
    StreamDelta,
    TokenLogprob,
    Usage,
    pack,
    params_dict,
    unpack,
)
