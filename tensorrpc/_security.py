"""CURVE encryption and authentication for tensorrpc sockets, and the exposure warning.

The roles (the CURVE server is a ZMQ role, independent of bind/connect), the ZAP handler
(`ZapAuthenticator`: one thread per ZMQ context, one domain and allow-list per
CURVE-server socket, fail-closed) and the key files (ZMQ certificates, z85 keys,
``NAME.key`` / ``NAME.key_secret`` mode 0600) are described in docs/security.md. pyzmq's
``ThreadAuthenticator`` is not used: its "allow any client" switch is global to the
context rather than per domain, and it runs an asyncio loop inside its thread.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import secrets
import stat
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypeAlias

import zmq
from zmq.utils import z85

from tensorrpc._exceptions import ConnectError

if TYPE_CHECKING:
    from collections.abc import Callable, Collection

__all__ = [
    "AuthStatistics",
    "CurveClientConfig",
    "CurveConfig",
    "CurveKeyPair",
    "CurveServerConfig",
    "ZAP_ENDPOINT",
    "ZapAuthenticator",
    "allow_clients",
    "apply_curve",
    "auth_statistics",
    "describe_handshake_failure",
    "disallow_clients",
    "generate_keypair",
    "check_public_key",
    "is_all_interfaces",
    "is_loopback",
    "load_keypair",
    "load_public_key",
    "load_public_keys",
    "save_keypair",
    "warn_if_exposed",
]

logger = logging.getLogger("tensorrpc.security")

#: The ZAP endpoint libzmq asks, one per context (RFC 27).
ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
_ZAP_VERSION: Final = b"1.0"
_Z85_KEY_LEN: Final = 40
_SECRET_SUFFIX: Final = ".key_secret"
_PUBLIC_SUFFIX: Final = ".key"
_STOP_TIMEOUT_S: Final = 5.0


def check_public_key(key: bytes, what: str) -> bytes:
    """``key`` if it is a z85 CURVE key (40 characters); ``what`` names it in errors.

    Raises:
        TypeError: It is not bytes.
        ValueError: It is not 40 characters of valid z85.
    """
    if not isinstance(key, bytes):
        raise TypeError(f"{what} must be z85-encoded bytes, not {type(key).__name__}")
    if len(key) != _Z85_KEY_LEN:
        raise ValueError(f"{what} must be 40 z85 characters (a CURVE key), not {len(key)} bytes")
    try:
        z85.decode(key)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{what} is not valid z85") from exc
    return key


@dataclass(frozen=True, slots=True)
class CurveKeyPair:
    """A CURVE keypair, both keys z85-encoded (40 bytes each).

    The secret key is left out of ``repr`` so that it never lands in a log or traceback.

    Raises:
        TypeError: A key is not bytes.
        ValueError: A key is malformed, or the public key does not belong to the secret key.
    """

    #: The public key: give it to the peers.
    public_key: bytes
    #: The secret key: keep it on this host, readable by this user only.
    secret_key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        check_public_key(self.public_key, "public_key")
        check_public_key(self.secret_key, "secret_key")
        if zmq.curve_public(self.secret_key) != self.public_key:
            raise ValueError("public_key does not belong to secret_key")


@dataclass(frozen=True, slots=True)
class CurveServerConfig:
    """Make a socket the CURVE server: it holds ``keypair`` and checks its clients' keys.

    The CURVE server role is a ZMQ role, independent of bind/connect: a server socket may
    bind (the usual case: the side peers dial into) or connect.

    Args:
        keypair: This socket's keypair; its public key is what clients must know.
        allowed_clients: The z85 public keys of the clients this socket accepts. ``None``
            accepts **any client that knows the server's public key**: traffic is still
            encrypted and the server still authenticated to its clients, but the server
            learns nothing about who connects, so the public key becomes a shared secret
            (anyone who obtains it can call). An empty collection accepts nobody.

    Raises:
        TypeError: A key is not bytes.
        ValueError: A key is malformed.
    """

    #: This socket's keypair.
    keypair: CurveKeyPair
    #: The accepted client public keys (z85), or None for any client.
    allowed_clients: Collection[bytes] | None

    def __post_init__(self) -> None:
        clients: object = self.allowed_clients
        if isinstance(clients, (bytes, str)):
            raise TypeError("allowed_clients is a collection of keys, not one key")
        if self.allowed_clients is not None:
            keys = frozenset(
                check_public_key(k, "allowed client key") for k in self.allowed_clients
            )
            object.__setattr__(self, "allowed_clients", keys)


@dataclass(frozen=True, slots=True)
class CurveClientConfig:
    """Make a socket a CURVE client of the server whose public key is ``server_public_key``.

    The socket may connect (the usual case) or bind; either way it only talks to a peer
    that proves it holds the secret key of ``server_public_key``.

    Args:
        keypair: This socket's keypair; the server's allow-list names its public key.
        server_public_key: The CURVE server's public key (z85).

    Raises:
        TypeError: A key is not bytes.
        ValueError: A key is malformed.
    """

    #: This socket's keypair.
    keypair: CurveKeyPair
    #: The server's public key (z85).
    server_public_key: bytes

    def __post_init__(self) -> None:
        check_public_key(self.server_public_key, "server_public_key")


#: Either side's CURVE configuration, as ``create_socket(curve=...)`` takes it.
CurveConfig: TypeAlias = CurveServerConfig | CurveClientConfig


# -- keys and key files ----------------------------------------------------------------------


def generate_keypair() -> CurveKeyPair:
    """Generate a new CURVE keypair with libzmq's ``zmq_curve_keypair``.

    Returns:
        The keypair, both keys z85-encoded.
    """
    public, secret = zmq.curve_keypair()
    return CurveKeyPair(public, secret)


_BANNER: Final = """#   ****  Generated on {now} by tensorrpc  ****
#   ZeroMQ CURVE {kind}
#   {advice}

"""


_CERT_KINDS: Final = {
    True: (
        "**Secret** Certificate",
        "DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.",
    ),
    False: (
        "Public Certificate",
        "Give this file to the peers; check its contents after exchange.",
    ),
}


def _cert_text(keypair: CurveKeyPair, *, secret: bool) -> str:
    kind, advice = _CERT_KINDS[secret]
    now = datetime.now().isoformat(timespec="seconds")
    text = _BANNER.format(now=now, kind=kind, advice=advice) + "metadata\ncurve\n"
    text += f'    public-key = "{keypair.public_key.decode("ascii")}"\n'
    if secret:
        text += f'    secret-key = "{keypair.secret_key.decode("ascii")}"\n'
    return text


def _write_file(path: Path, text: str, mode: int, *, overwrite: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have removed bits; an old file may have had more
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)


def save_keypair(
    keypair: CurveKeyPair, directory: str | os.PathLike[str], name: str, *, overwrite: bool = False
) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public, mode 0644) and ``NAME.key_secret`` (mode 0600).

    The files are ZMQ certificates (the format of ``zmq.auth.create_certificates``); the
    secret file is created with mode 0600 from the start, never readable by others.

    Args:
        keypair: The keypair to save.
        directory: An existing directory.
        name: The file name without suffix (no path separators).
        overwrite: Replace existing files instead of failing.

    Returns:
        The paths of the public and the secret certificate.

    Raises:
        ValueError: ``name`` is empty or contains a path separator.
        FileExistsError: A file exists and ``overwrite`` is false.
        OSError: The files cannot be written.
    """
    if not name or os.sep in name or (os.altsep and os.altsep in name) or name in {".", ".."}:
        raise ValueError(f"invalid key file name {name!r}")
    base = Path(directory)
    public_path = base / f"{name}{_PUBLIC_SUFFIX}"
    secret_path = base / f"{name}{_SECRET_SUFFIX}"
    if not overwrite:
        for path in (public_path, secret_path):
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, "key file exists", os.fspath(path))
    _write_file(secret_path, _cert_text(keypair, secret=True), 0o600, overwrite=overwrite)
    _write_file(public_path, _cert_text(keypair, secret=False), 0o644, overwrite=overwrite)
    return public_path, secret_path


def load_keypair(path: str | os.PathLike[str], *, check_permissions: bool = True) -> CurveKeyPair:
    """Load a keypair from a secret certificate (``NAME.key_secret``).

    Args:
        path: The secret certificate.
        check_permissions: Refuse a file that users other than its owner may read or
            write (like ssh does for private keys).

    Returns:
        The keypair.

    Raises:
        PermissionError: The file is accessible to group or others.
        ValueError: The file holds no secret key, or malformed keys.
        OSError: The file cannot be read.
    """
    if check_permissions:
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PermissionError(
                errno.EACCES,
                f"secret key file is accessible to other users (mode {stat.S_IMODE(mode):04o});"
                " run chmod 600 on it",
                os.fspath(path),
            )
    import zmq.auth  # only here: its import (glob, fnmatch) is start-up time of every client

    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{os.fspath(path)} holds no secret key (is it a public certificate?)")
    return CurveKeyPair(public, secret)


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """Load the public key from a certificate (public or secret).

    Args:
        path: A ``NAME.key`` (or ``NAME.key_secret``) file.

    Returns:
        The z85 public key.

    Raises:
        ValueError: The file holds no valid public key.
        OSError: The file cannot be read.
    """
    import zmq.auth

    public, _ = zmq.auth.load_certificate(path)
    return check_public_key(public, f"public key in {os.fspath(path)}")


def load_public_keys(directory: str | os.PathLike[str]) -> frozenset[bytes]:
    """Load the public keys of every ``*.key`` file in ``directory`` (an allow-list).

    Args:
        directory: A directory of public certificates.

    Returns:
        The z85 public keys.

    Raises:
        ValueError: A file holds no valid public key.
        OSError: The directory or a file cannot be read.
    """
    return frozenset(
        load_public_key(path) for path in sorted(Path(directory).glob(f"*{_PUBLIC_SUFFIX}"))
    )


# -- the ZAP handler -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AuthStatistics:
    """What the ZAP handler decided for one CURVE-server socket."""

    #: Handshakes accepted.
    accepted: int
    #: Handshakes refused (unknown client key, or a mechanism other than CURVE).
    denied: int


@dataclass(slots=True)
class _Domain:
    allowed: frozenset[bytes] | None  # raw 32-byte keys; None = any client
    accepted: int = 0
    denied: int = 0
    added: frozenset[bytes] = frozenset()  # keys allowed at run time (`allow`)


class ZapAuthenticator:
    """The ZAP handler of one ZMQ context, shared by all its CURVE-server sockets.

    Obtain it with `acquire` (which starts it on first use) and give it back with
    `release` (which stops it with its last user); `apply_curve` does both. It accepts
    NULL (libzmq asks only for NULL sockets that set a ZAP domain), CURVE on a registered
    domain whose allow-list has the key (or allows any), and denies anything else.
    """

    _lock: Final = threading.Lock()
    _instances: Final[dict[int, ZapAuthenticator]] = {}

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._context = context
        self._domains: dict[str, _Domain] = {}
        self._users = 0
        self._thread: threading.Thread | None = None
        self._control: zmq.Socket[bytes] | None = None

    # -- lifetime ---------------------------------------------------------------------------

    @classmethod
    def acquire(cls, context: zmq.Context[zmq.Socket[bytes]]) -> ZapAuthenticator:
        """Return the context's handler, starting it if needed; pair with `release`.

        Raises:
            ConnectError: The context's ZAP endpoint is taken by another handler.
        """
        with cls._lock:
            auth = cls._instances.get(id(context))
            if auth is None:
                auth = cls(context)
                auth._start()
                cls._instances[id(context)] = auth
            auth._users += 1
            return auth

    def release(self) -> None:
        """Give back one `acquire`; the last one stops the handler thread."""
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            self._instances.pop(id(self._context), None)
            self._stop()

    @classmethod
    def for_context(cls, context: zmq.Context[zmq.Socket[bytes]]) -> ZapAuthenticator | None:
        """The running handler of ``context``, if any."""
        with cls._lock:
            return cls._instances.get(id(context))

    @property
    def running(self) -> bool:
        """Whether the handler thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _start(self) -> None:
        ctx = self._context
        zap = ctx.socket(zmq.REP)
        control = thread_end = None
        try:
            zap.setsockopt(zmq.LINGER, 0)
            try:
                zap.bind(ZAP_ENDPOINT)
            except zmq.ZMQError as exc:
                raise ConnectError(
                    "another ZAP handler already serves this ZMQ context (for example"
                    " pyzmq's ThreadAuthenticator); tensorrpc needs its own: give the"
                    " secured sockets a separate zmq.Context"
                ) from exc
            pipe = f"inproc://tensorrpc.zap-control.{secrets.token_hex(8)}"
            control = ctx.socket(zmq.PAIR)
            control.setsockopt(zmq.LINGER, 0)
            control.bind(pipe)
            thread_end = ctx.socket(zmq.PAIR)
            thread_end.setsockopt(zmq.LINGER, 0)
            thread_end.connect(pipe)
        except BaseException:
            for sock in (zap, control, thread_end):
                if sock is not None:
                    sock.close(linger=0)
            raise
        self._control = control
        self._thread = threading.Thread(
            target=self._run, args=(zap, thread_end), name="tensorrpc-zap", daemon=True
        )
        self._thread.start()

    def _stop(self) -> None:
        control, self._control = self._control, None
        thread, self._thread = self._thread, None
        if control is None:
            return
        with contextlib.suppress(zmq.ZMQError):
            control.send(b"STOP", zmq.NOBLOCK)
        if thread is not None:
            thread.join(_STOP_TIMEOUT_S)
            if thread.is_alive():  # pragma: no cover - the loop answers STOP at once
                logger.error("the ZAP handler thread did not stop in %s s", _STOP_TIMEOUT_S)
        control.close(linger=0)

    def _run(self, zap: zmq.Socket[bytes], control: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        poller.register(control, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if control in events:
                    return
                if zap in events:
                    try:
                        request = zap.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        continue
                    zap.send_multipart(self._safe_answer(request))
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ETERM:  # the context was terminated under us: just leave
                logger.exception("the ZAP handler failed; CURVE servers now refuse clients")
        finally:
            with contextlib.suppress(zmq.ZMQError):
                zap.unbind(ZAP_ENDPOINT)  # synchronous: the endpoint is free for a restart
            zap.close(linger=0)
            control.close(linger=0)

    # -- domains ----------------------------------------------------------------------------

    def register(self, allowed_clients: Collection[bytes] | None) -> str:
        """Register a new ZAP domain with its allow-list (z85 client public keys, None for
        any client); return the domain to set as the socket's ``ZAP_DOMAIN``."""
        domain = f"tensorrpc.{secrets.token_hex(8)}"
        self._domains[domain] = _Domain(None if allowed_clients is None else _raw(allowed_clients))
        return domain

    def allow(self, domain: str, keys: Collection[bytes]) -> None:
        """Add client keys to ``domain``'s allow-list at run time (until `disallow`).

        A domain that accepts any client is left as it is. The allow-list is swapped as a
        whole, so the handler thread sees the old list or the new one, never half of it.

        Raises:
            KeyError: ``domain`` is not registered.
            ValueError: A key is malformed.
        """
        entry = self._domains[domain]
        raw = _raw(keys)
        if entry.allowed is None:
            return
        new = raw - entry.allowed
        entry.added |= new
        entry.allowed = entry.allowed | new

    def disallow(self, domain: str, keys: Collection[bytes]) -> None:
        """Take keys that `allow` added off ``domain``'s allow-list; later handshakes
        with them are refused (established connections stay). Keys the domain was
        registered with are kept."""
        entry = self._domains.get(domain)
        if entry is None or entry.allowed is None:
            return
        gone = _raw(keys) & entry.added
        entry.added -= gone
        entry.allowed = entry.allowed - gone

    def unregister(self, domain: str) -> None:
        """Forget ``domain``; later handshakes for it are denied."""
        self._domains.pop(domain, None)

    def statistics(self, domain: str) -> AuthStatistics:
        """The accepted and denied handshakes of ``domain`` so far.

        Raises:
            KeyError: ``domain`` is not registered.
        """
        entry = self._domains[domain]
        return AuthStatistics(entry.accepted, entry.denied)

    def _safe_answer(self, request: list[bytes]) -> list[bytes]:
        # A REP socket must answer every request, and the thread must survive: any bug
        # here refuses the handshake (ZAP status 500) instead of killing authentication.
        try:
            return self._answer(request)
        except Exception:
            logger.exception("the ZAP handler failed on a request; refusing the handshake")
            return _zap_reply(request[1] if len(request) > 1 else b"", b"500", b"internal error")

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6 or request[0] != _ZAP_VERSION:
            logger.warning("malformed ZAP request refused (%d frames)", len(request))
            request_id = request[1] if len(request) > 1 else b""
            return _zap_reply(request_id, b"400", b"malformed request")
        _, request_id, raw_domain, address, _, mechanism, *credentials = request
        domain = raw_domain.decode("utf-8", "replace")
        peer = address.decode("utf-8", "replace")
        if mechanism == b"NULL":
            return _zap_reply(request_id, b"200", b"OK", b"anonymous")
        entry = self._domains.get(domain)
        if entry is None or mechanism != b"CURVE" or len(credentials) != 1:
            reason = "unknown domain" if entry is None else "only CURVE is accepted"
            kind = mechanism.decode("ascii", "replace")
            logger.warning("%s handshake from %s refused: %s", kind, peer, reason)
            if entry is not None:
                entry.denied += 1
            return _zap_reply(request_id, b"400", reason.encode())
        key = credentials[0]
        if entry.allowed is not None and key not in entry.allowed:
            entry.denied += 1
            client = z85.encode(key).decode("ascii")
            logger.info("CURVE client %s from %s refused: key not on the allow-list", client, peer)
            return _zap_reply(request_id, b"400", b"unknown key")
        entry.accepted += 1
        return _zap_reply(request_id, b"200", b"OK", z85.encode(key))


def _raw(keys: Collection[bytes]) -> frozenset[bytes]:
    """z85 client keys, checked, as the raw 32-byte keys ZAP requests carry."""
    return frozenset(z85.decode(check_public_key(k, "client key")) for k in keys)


def _zap_reply(request_id: bytes, status: bytes, text: bytes, user: bytes = b"") -> list[bytes]:
    """A ZAP reply: version, request id, status code and text, user id, no metadata."""
    return [_ZAP_VERSION, request_id, status, text, user, b""]


def _server_domain(sock: zmq.Socket[bytes]) -> tuple[ZapAuthenticator, str]:
    domain = sock.getsockopt_string(zmq.ZAP_DOMAIN)
    auth = ZapAuthenticator.for_context(sock.context)
    if auth is None or not domain or domain not in auth._domains:
        raise ValueError("the socket is not a tensorrpc CURVE server")
    return auth, domain


def allow_clients(sock: zmq.Socket[bytes], keys: Collection[bytes]) -> None:
    """Let more client keys (z85) through a CURVE-server socket's allow-list, at run time.

    Raises:
        ValueError: The socket is not a tensorrpc CURVE server, or a key is malformed.
    """
    auth, domain = _server_domain(sock)
    auth.allow(domain, keys)


def disallow_clients(sock: zmq.Socket[bytes], keys: Collection[bytes]) -> None:
    """Take keys that `allow_clients` added off a CURVE-server socket's allow-list.

    Raises:
        ValueError: The socket is not a tensorrpc CURVE server, or a key is malformed.
    """
    auth, domain = _server_domain(sock)
    auth.disallow(domain, keys)


def auth_statistics(sock: zmq.Socket[bytes]) -> AuthStatistics:
    """The handshakes a CURVE-server socket (``AsyncSocket.socket``) accepted and denied.

    Raises:
        ValueError: The socket is not a tensorrpc CURVE server.
    """
    auth, domain = _server_domain(sock)
    return auth.statistics(domain)


# -- handshake failures (socket monitor events) ---------------------------------------------

#: The socket-monitor events that report a failed ZMTP handshake (libzmq >= 4.3).
HANDSHAKE_FAILURE_EVENTS: Final = (
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    | int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    | int(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
)
_ZAP_STATUS: Final = {
    300: "temporary error",
    400: "the CURVE server refused this client key: it is not on the allow-list",
    500: "the ZAP handler failed",
}
_PROTOCOL_ERRORS: Final = {
    int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH): (
        "security mechanism mismatch: one side uses CURVE, the other plaintext"
    ),
    int(zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC): (
        "CURVE cryptographic error: the client does not hold the server's key pair "
        "(a wrong server public key), or the traffic was tampered with"
    ),
    int(zmq.PROTOCOL_ERROR_ZMTP_KEY_EXCHANGE): "CURVE key exchange failed",
}


def describe_handshake_failure(event: int, value: int, endpoint: str) -> str:
    """Say in words why a handshake on ``endpoint`` failed, from a socket-monitor event:
    ``EVENT_HANDSHAKE_FAILED_AUTH`` (``value`` is the ZAP status code), ``..._PROTOCOL``
    (a ``PROTOCOL_ERROR_*`` code) or ``..._NO_DETAIL`` (an errno)."""
    where = f"handshake on {endpoint}"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        status = _ZAP_STATUS.get(value, "refused")
        return f"{where}: authentication failed (ZAP status {value}: {status})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        try:
            name = zmq.Event(value).name or hex(value)
        except ValueError:
            name = hex(value)
        reason = _PROTOCOL_ERRORS.get(value, f"protocol error {name}")
        return f"{where}: failed ({reason}; libzmq {name})"
    reason = os.strerror(value) if 0 < value < 4096 else str(value)
    return (
        f"{where}: failed without detail (errno {value}: {reason}); with CURVE this is "
        "usually a wrong server public key: the server dropped the connection"
    )


# -- applying a configuration ----------------------------------------------------------------


def apply_curve(
    sock: zmq.Socket[bytes], config: CurveConfig, context: zmq.Context[zmq.Socket[bytes]]
) -> Callable[[], None] | None:
    """Set the CURVE options of ``sock``; call before it binds or connects.

    For a server this registers a ZAP domain with the context's `ZapAuthenticator`
    (starting it if needed) and returns the function that unregisters it; call that once
    the socket is closed (a client: None). If a server's handler is ever missing, libzmq
    refuses its clients (``ZAP_ENFORCE_DOMAIN``) rather than accepting everyone.

    Raises:
        TypeError: ``config`` is not a CURVE configuration.
        ConnectError: The context's ZAP endpoint is taken by another handler.
        zmq.ZMQError: libzmq refused an option (e.g. built without CURVE).
    """
    if isinstance(config, CurveClientConfig):
        sock.setsockopt(zmq.CURVE_SERVERKEY, config.server_public_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, config.keypair.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, config.keypair.secret_key)
        return None
    if not isinstance(config, CurveServerConfig):
        raise TypeError(f"curve must be a CurveServerConfig or CurveClientConfig, not {config!r}")
    auth = ZapAuthenticator.acquire(context)
    try:
        domain = auth.register(config.allowed_clients)
        try:
            sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode("ascii"))
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, config.keypair.public_key)
            sock.setsockopt(zmq.CURVE_SECRETKEY, config.keypair.secret_key)
        except BaseException:
            auth.unregister(domain)
            raise
    except BaseException:
        auth.release()
        raise

    def cleanup() -> None:
        auth.unregister(domain)
        auth.release()

    return cleanup


# -- exposure warning ------------------------------------------------------------------------


def _bound_host(endpoint: str) -> str | None:
    """The host part a TCP (or WebSocket) ``endpoint`` binds, None for other transports."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme.lower() not in {"tcp", "ws", "wss"}:
        return None
    host = rest.split("/", 1)[0]
    host = host.rpartition(";")[2]  # a "source;destination" form names the bound side last
    host = host.rsplit(":", 1)[0] if ":" in host else host
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def is_loopback(endpoint: str) -> bool:
    """Whether ``endpoint`` is reachable from this host only.

    True for ``ipc://``, ``inproc://`` and TCP on a loopback address (``127.0.0.0/8``,
    ``::1``, ``localhost``, the ``lo`` interface); false for every other TCP host (an
    address, a host name, an interface name, every interface).
    """
    host = _bound_host(endpoint)
    if host is None:
        return endpoint.partition("://")[0].lower() in {"ipc", "inproc"}
    return host.lower() in {"localhost", "lo"} or _ip(host, "is_loopback")


def is_all_interfaces(endpoint: str) -> bool:
    """Whether binding ``endpoint`` listens on every network interface.

    True for ``tcp://*:PORT``, ``tcp://0.0.0.0:PORT``, ``tcp://[::]:PORT`` and other
    spellings of the unspecified address; false for a specific address, an interface
    name, and non-TCP transports.
    """
    host = _bound_host(endpoint)
    return host is not None and (host in {"*", ""} or _ip(host, "is_unspecified"))


def _ip(host: str, test: str) -> bool:
    """``ip_address(host).<test>`` (a scope ``%eth0`` aside); False for a name."""
    try:
        return bool(getattr(ipaddress.ip_address(host.split("%", 1)[0]), test))
    except ValueError:
        return False


def warn_if_exposed(endpoint: str, sock: zmq.Socket[bytes]) -> bool:
    """Log one warning (and say so) if ``sock`` is about to bind a non-loopback interface
    without CURVE (its ``MECHANISM`` option)."""
    if _bound_host(endpoint) is None or is_loopback(endpoint):
        return False
    if sock.getsockopt(zmq.MECHANISM) == zmq.CURVE:
        return False
    if not is_all_interfaces(endpoint):
        logger.warning(
            "binding %s without CURVE: anyone who can reach this address can connect, send"
            " calls and read replies, all in plaintext (and, at a binding client, join as"
            " an engine under any free id). Enable CURVE for sockets other hosts reach"
            " (see docs/security.md).",
            endpoint,
        )
        return True
    logger.warning(
        "binding %s without CURVE: this socket listens on every network interface, and"
        " anyone who can reach the port can connect, send calls and read replies, all in"
        " plaintext (the exposure of CVE-2025-30202). Bind to 127.0.0.1 or ipc://, or"
        " enable CURVE (see docs/security.md).",
        endpoint,
    )
    return True
