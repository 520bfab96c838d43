"""ZeroMQ CURVE on every socket that crosses a process boundary: the cluster's (router <->
workers, KV, block events), the pool service's and the RPC server's.

One key directory serves a whole deployment (``engine keys generate DIR``): ``server.key`` /
``server.key_secret`` (every binding socket presents it), ``client.key`` / ``client.key_secret``
(every connecting socket), and any other ``*.key`` public certificate dropped there admits one
more client (an RPC user with a key pair of its own). A binding socket runs ZAP: a peer without
CURVE never completes the handshake, and a CURVE peer whose public key is not in the directory is
refused; neither gets a single byte through.

The rule, applied by ``secure_server`` before each bind: with keys configured
(``ENGINE_CURVE_KEYS`` / ``--curve-keys``) every socket uses them, loopback or not; without keys
a socket may bind to loopback only, unless ``ENGINE_CURVE_INSECURE=1`` says the operator accepts
unauthenticated peers. Connecting sockets follow the keys (``secure_client``): with keys they
authenticate, without they do not.
"""

from __future__ import annotations

import ipaddress
import os
import threading
from typing import NamedTuple

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from engine import envs

SERVER, CLIENT = "server", "client"


class CurveKeys(NamedTuple):
    directory: str
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def generate_keys(directory: str, force: bool = False) -> CurveKeys:
    """Make the server and client key pairs in ``directory`` (created 0700; secrets 0600)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for name in (SERVER, CLIENT):
        if os.path.exists(os.path.join(directory, f"{name}.key_secret")) and not force:
            raise ValueError(
                f"{directory} already holds {name}.key_secret: remove it or pass --force "
                "(peers holding the old keys would be refused)"
            )
    for name in (SERVER, CLIENT):
        _, secret = zmq.auth.create_certificates(directory, name)
        os.chmod(secret, 0o600)
    return load_keys(directory)


def load_keys(directory: str) -> CurveKeys:
    """Both key pairs from ``directory``; ValueError naming the missing or bad file."""
    pairs = []
    for name in (SERVER, CLIENT):
        path = os.path.join(directory, f"{name}.key_secret")
        if not os.path.isfile(path):
            raise ValueError(
                f"curve keys: {path} is missing (make the directory with `engine keys generate "
                f"{directory}`)"
            )
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"curve keys: {path} is not a ZeroMQ certificate: {exc}") from None
        if not public or not secret or len(public) != 40 or len(secret) != 40:
            raise ValueError(f"curve keys: {path} must hold a Z85 public and secret key (40 chars)")
        pairs += [public, secret]
    return CurveKeys(os.path.abspath(directory), *pairs)


_cache: dict[str, CurveKeys] = {}
_auths: dict[int, tuple[ThreadAuthenticator, str]] = {}  # by libzmq context: (ZAP, key dir)
_lock = threading.Lock()


def configured_keys() -> CurveKeys | None:
    """The keys named by ENGINE_CURVE_KEYS (read once per directory), or None."""
    directory = envs.curve_keys()
    if directory is None:
        return None
    with _lock:
        if directory not in _cache:
            _cache[directory] = load_keys(directory)
        return _cache[directory]


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ endpoint stays on this host (inproc and ipc do; tcp on 127/8 or ::1)."""
    scheme, _, rest = address.partition("://")
    if scheme in ("inproc", "ipc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a host name: reachable from elsewhere


def require_auth(address: str) -> CurveKeys | None:
    """The keys to bind ``address`` with; ValueError if it is reachable from other hosts and
    there are none (unless ENGINE_CURVE_INSECURE allows it)."""
    keys = configured_keys()
    if keys is None and not is_loopback(address) and not envs.curve_insecure():
        raise ValueError(
            f"binding {address} beyond loopback needs CURVE keys: give --curve-keys DIR or "
            "ENGINE_CURVE_KEYS=DIR (make DIR with `engine keys generate DIR`), or set "
            "ENGINE_CURVE_INSECURE=1 to serve unauthenticated peers"
        )
    return keys


def secure_server(sock: zmq.Socket, address: str) -> None:
    """Before ``sock.bind(address)``: CURVE server with ZAP when keys are configured; without
    them, ValueError if the address is reachable from other hosts (``require_auth``)."""
    keys = require_auth(address)
    if keys is None:
        return
    _start_authenticator(sock.context, keys.directory)
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: CurveKeys | None = None) -> None:
    """Before ``sock.connect``: authenticate with the client key pair when keys are configured
    (or given)."""
    keys = keys or configured_keys()
    if keys is None:
        return
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public


def _start_authenticator(ctx: zmq.Context, directory: str) -> None:
    """One ZAP handler per libzmq context, admitting the public keys in ``directory``."""
    key = ctx.underlying
    with _lock:
        auth, current = _auths.get(key, (None, ""))
        if auth is None:
            auth = ThreadAuthenticator(ctx)
            auth.start()
        if current != directory:  # the admitted keys are read here, once per directory
            auth.configure_curve(domain="*", location=directory)
            _auths[key] = (auth, directory)


def stop_authenticator(ctx: zmq.Context) -> None:
    """Before ``ctx.term()``: the ZAP handler's sockets would otherwise keep term waiting."""
    with _lock:
        auth, _ = _auths.pop(ctx.underlying, (None, ""))
    if auth is not None:
        auth.stop()
