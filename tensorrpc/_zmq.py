"""The only module that touches sockets: safe socket defaults and async send/recv on anyio.

pyzmq's own ``zmq.asyncio`` does not run on trio, so `AsyncSocket` wraps a plain
(synchronous) pyzmq socket and waits through anyio on the socket's ``ZMQ_FD``. That file
descriptor is *edge-triggered* and shared by reads and writes: it becomes readable when
the socket's internal mailbox has commands, and any ``send``, ``recv`` or ``EVENTS`` read
may consume that edge. The rules this module follows:

1. A send is tried first with ``NOBLOCK``. A receive in a run (the last two receives got
   a message), or one woken by an ``EVENTS`` read that showed a message, is tried at
   once; any other first reads ``EVENTS`` (two system calls; a failed receive costs the
   same and raises, twice the cost in all), so a lone message, as a sequential call's,
   costs no failed receive. Only when that fails do we wait.
2. Before waiting on the FD we read ``EVENTS``; we never wait while it already shows the
   condition we want (the classic lost wake-up).
3. On asyncio the FD is registered once per socket with ``loop.add_reader`` and stays
   registered until close (no ``epoll_ctl`` per wait); its callback reads ``EVENTS``
   (which drains the mailbox, so a level-triggered registration cannot spin) and wakes
   the waiting tasks (plain futures) whose condition it shows. On other backends (trio)
   only one task at a time waits on the FD through ``anyio.wait_readable``; other tasks
   that need to wait park on an `anyio.Event` that the FD waiter sets whenever it
   wakes up.
4. After every successful operation, if a task is parked on the FD, we read ``EVENTS`` and
   wake that task if its condition became true (our operation may have eaten the edge).
5. Multipart messages are atomic in ZMQ, so a ``NOBLOCK`` send or receive either moves the
   whole message or nothing: a cancelled `AsyncSocket.send` sent all or nothing and
   a cancelled `AsyncSocket.recv` lost nothing (all awaits happen before the
   operation, or are shielded after it).
6. Sockets are used from the event-loop thread only.

All zmq errors are translated to tensorrpc errors in `translate_zmq_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import math
import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Self, cast

import anyio
import anyio.lowlevel
import zmq
from zmq.utils.monitor import parse_monitor_message

from tensorrpc import _release
from tensorrpc._bulk import Voucher
from tensorrpc._exceptions import (
    ClosedError,
    ConnectError,
    PeerUnreachableError,
    TensorRPCError,
    TransportError,
)
from tensorrpc._security import (
    HANDSHAKE_FAILURE_EVENTS,
    apply_curve,
    describe_handshake_failure,
    warn_if_exposed,
)
from tensorrpc.transports._peer import KernelPeer, parse_peer_address

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator, Sequence
    from types import TracebackType

    from typing_extensions import Buffer

    from tensorrpc._security import CurveConfig

__all__ = [
    "DEFAULT_OPTIONS",
    "AsyncSocket",
    "PendingSends",
    "SocketOptions",
    "Waiters",
    "connection_voucher",
    "shut_connection",
    "source_fd",
    "create_socket",
    "loop_clock",
    "map_zmq_errors",
    "message_peer_address",
    "peer_credentials",
    "translate_zmq_error",
]

# Plain ints: pyzmq's constants are IntFlag members, whose operators cost microseconds.
_NOBLOCK: Final = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK: Final = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_EVENTS: Final = int(zmq.EVENTS)
_POLLIN: Final = int(zmq.POLLIN)
_POLLOUT: Final = int(zmq.POLLOUT)
# The compiled socket's methods, called without pyzmq's Python-level wrappers (which
# re-check every frame's type and combine flags as IntFlags on every call).
_BASE_SEND: Final = cast(
    "Callable[[zmq.Socket[bytes], object, int, bool], object]", zmq.backend.Socket.send
)
_BASE_RECV: Final = cast(
    "Callable[[zmq.Socket[bytes], int, bool], zmq.Frame]", zmq.backend.Socket.recv
)
_get_running_loop: Final = asyncio._get_running_loop
# After this many operations in a row that did not have to wait, or this much time since
# the socket last let the event loop run (the caller handling what it received, e.g.
# decoding a large message, counts), yield once so that a busy socket, or a peer that
# floods it with costly messages, cannot starve the other tasks.
_FAIRNESS_STREAK: Final = 32
_FAIRNESS_S: Final = 0.002
_monotonic = time.monotonic
_INF: Final = math.inf
_security_logger = logging.getLogger("tensorrpc.security")
# Handshake failures an AsyncSocket remembers (the most recent), and distinct reasons it
# counts (a peer retrying every 100 ms repeats the same one).
_MAX_FAILURES: Final = 16
_MAX_REASONS: Final = 64
# When a ROUTER with ROUTER_MANDATORY reports POLLOUT (some peer has room) but the send to
# *our* peer would block, the FD will not tell us when that peer drains; we re-try after
# waiting on the FD at most this long (doubling up to the maximum).
_PEER_FULL_BACKOFF_S: Final = 0.001
_PEER_FULL_BACKOFF_MAX_S: Final = 0.05

_CLOSED_ERRNOS: Final = frozenset({errno.ENOTSOCK, zmq.ETERM})
_ENDPOINT_ERRNOS: Final = frozenset(
    {
        errno.EADDRINUSE,
        errno.EADDRNOTAVAIL,
        errno.EINVAL,
        errno.ENOENT,
        errno.ENAMETOOLONG,
        errno.EACCES,
        errno.ENODEV,
        errno.ECONNREFUSED,
        zmq.EPROTONOSUPPORT,
        zmq.ENOCOMPATPROTO,
    }
)


@dataclass(frozen=True, slots=True)
class SocketOptions:
    """Socket options applied by `create_socket`; the defaults are the safe ones."""

    #: Outgoing queue bound, in messages, per peer (0 would mean unlimited: avoid).
    sndhwm: int = 10_000
    #: Incoming queue bound, in messages, per peer.
    rcvhwm: int = 10_000
    #: Largest inbound frame ZMQ accepts; a peer sending more is disconnected.
    #: ``-1`` disables the limit and must be asked for explicitly.
    maxmsgsize: int = 1 << 32
    #: How long ZMQ keeps trying to deliver queued messages (a last BYE or reply) after
    #: ``close``, in milliseconds; closing itself never waits.
    linger_ms: int = 100
    #: Enable TCP keepalive on ``tcp://`` connections (no effect on ipc/inproc).
    tcp_keepalive: bool = True
    #: Seconds of idleness before the first keepalive probe.
    tcp_keepalive_idle_s: int = 30
    #: Seconds between keepalive probes.
    tcp_keepalive_intvl_s: int = 10
    #: Unanswered probes before the connection is dropped.
    tcp_keepalive_cnt: int = 3
    #: ROUTER only: sending to an unknown routing id raises
    #: [`PeerUnreachableError`][tensorrpc.PeerUnreachableError] instead of dropping the message
    #: silently.
    router_mandatory: bool = True
    #: ROUTER only: a new connection with a live routing id takes it over (an engine
    #: restarted under the same id before the old connection was noticed dead).
    router_handover: bool = True
    #: Buffers smaller than this many bytes are copied even when sending with
    #: ``copy=False`` (zero-copy has a fixed cost that only pays off for large frames).
    copy_threshold: int = 64 * 1024

    def capped(self, limit: int) -> SocketOptions:
        """These options with ``maxmsgsize`` lowered to ``limit`` where it is larger.

        Args:
            limit: The largest frame worth receiving (e.g. ``_codec.frame_limit``):
                ``-1`` (no limit) becomes ``limit`` too, since a larger frame would
                only be buffered to be refused.

        Returns:
            ``self`` when nothing changes, else a copy.
        """
        if limit <= 0 or 0 < self.maxmsgsize <= limit:
            return self
        return dataclasses.replace(self, maxmsgsize=limit)

    def __post_init__(self) -> None:
        if self.maxmsgsize == 0 or self.maxmsgsize < -1:
            raise ValueError("maxmsgsize must be positive, or -1 for no limit")
        for name in ("sndhwm", "rcvhwm", "linger_ms", "copy_threshold"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")


#: The default [`SocketOptions`][tensorrpc.SocketOptions].
DEFAULT_OPTIONS: Final = SocketOptions()
#: I/O threads of the process-wide context when tensorrpc makes it, and the affinity
#: masks of control and bulk sockets (`create_socket`'s ``bulk``).
_IO_THREADS: Final = 2
_CONTROL_THREAD: Final = 1
_BULK_THREAD: Final = 2


def loop_clock() -> Callable[[], float]:
    """The running event loop's clock: ``anyio.current_time`` as a plain function.

    The one clock of both shells: what they feed the machines as ``now``, the deadlines
    of calls and the cancel scopes that bound them (no conversion between clocks).
    """
    loop = _get_running_loop()
    if loop is not None:
        return loop.time
    import trio

    return trio.current_time


class Waiters:
    """The running event loop's one-shot wake-ups: an asyncio Future or a trio Event per
    wait, and its plain checkpoint. Made inside the loop.

    A bare future costs far less than ``anyio.Event`` on the hot path (which looks the
    backend up on every call); both are awaited inside anyio cancel scopes, which cancel
    them like any other await.
    """

    __slots__ = ("checkpoint", "new", "soon", "wait", "wake", "woken")

    def __init__(self) -> None:
        self.new: Callable[[], Any]
        self.wake: Callable[[Any], None]
        self.wait: Callable[[Any], Awaitable[Any]]
        self.woken: Callable[[Any], bool]
        #: Run a plain function once the running task next yields to the event loop.
        self.soon: Callable[[Callable[[], None]], object]
        #: ``anyio.lowlevel.checkpoint`` without the backend look-up.
        self.checkpoint: Callable[[], Awaitable[None]]
        loop = _get_running_loop()
        if loop is not None:
            self.new = loop.create_future
            self.wake = _wake_future
            self.wait = _identity
            self.woken = _future_woken
            self.soon = loop.call_soon
            self.checkpoint = functools.partial(asyncio.sleep, 0)  # anyio's, on asyncio
        else:
            import trio

            self.new = trio.Event
            self.wake = _set_event
            self.wait = _event_wait
            self.woken = _event_woken
            self.soon = trio.lowlevel.current_trio_token().run_sync_soon
            self.checkpoint = trio.lowlevel.checkpoint


def _wake_future(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _future_woken(fut: asyncio.Future[None]) -> bool:
    return fut.done() and not fut.cancelled()


def _identity(fut: Awaitable[Any]) -> Awaitable[Any]:
    return fut


def _set_event(event: Any) -> None:
    event.set()


def _event_wait(event: Any) -> Awaitable[Any]:
    return cast("Awaitable[Any]", event.wait())


def _event_woken(event: Any) -> bool:
    return bool(event.is_set())


def translate_zmq_error(exc: zmq.ZMQError, what: str = "", *, peer: bytes = b"") -> TensorRPCError:
    """Turn a pyzmq error into the tensorrpc error that describes it.

    Args:
        exc: The pyzmq error.
        what: What was being done, for the message ("bind tcp://...").
        peer: The routing id the failed send was addressed to, when known.

    Returns:
        [`PeerUnreachableError`][tensorrpc.PeerUnreachableError] for ``EHOSTUNREACH``;
        [`ClosedError`][tensorrpc.ClosedError] when the socket or context was closed;
        [`ConnectError`][tensorrpc.ConnectError] for bad or unavailable endpoints;
        [`TransportError`][tensorrpc.TransportError] for anything else.
    """
    code = exc.errno
    prefix = f"{what}: " if what else ""
    if code == errno.EHOSTUNREACH:
        return PeerUnreachableError(
            f"{prefix}peer {peer!r} is not connected (it left or never said hello)", peer=peer
        )
    if code in _CLOSED_ERRNOS:
        return ClosedError(f"{prefix}the socket is closed ({exc.strerror})")
    if code in _ENDPOINT_ERRNOS:
        return ConnectError(f"{prefix}{exc.strerror}")
    return TransportError(f"{prefix}{exc.strerror} (zmq errno {code})")


@contextlib.contextmanager
def map_zmq_errors(what: str = "", *, peer: bytes = b"") -> Iterator[None]:
    """Translate pyzmq errors raised in the block (see `translate_zmq_error`).

    Args:
        what: What the block does, for error messages.
        peer: The routing id involved, when any.

    Raises:
        TensorRPCError: The translated error, chained to the pyzmq one.
    """
    try:
        yield
    except zmq.ZMQError as exc:
        raise translate_zmq_error(exc, what, peer=peer) from exc


def create_socket(
    socket_type: int,
    *,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    options: SocketOptions = DEFAULT_OPTIONS,
    routing_id: bytes | None = None,
    curve: CurveConfig | None = None,
    watch_connections: bool = False,
    bulk: bool = False,
) -> AsyncSocket:
    """Create a socket with safe defaults and wrap it in an `AsyncSocket`.

    Args:
        socket_type: ``zmq.ROUTER``, ``zmq.DEALER``, ...
        context: The ZMQ context; the process-wide ``zmq.Context.instance()`` by default.
        options: Socket options.
        routing_id: This socket's routing id (1-255 bytes, no leading zero byte).
        curve: CURVE for every ``tcp://``/``ipc://`` connection: a `CurveServerConfig`
            (a per-socket ZAP domain until the socket closes) or a `CurveClientConfig`;
            None: plaintext.
        watch_connections: Also watch connections come and go
            (`AsyncSocket.disconnected`, `AsyncSocket.connection_events`).
        bulk: A bulk connection's socket: on the context's second I/O thread, so a
            large message's bytes never hold up a small one's.

    Raises:
        ValueError: ``routing_id`` or a CURVE key is malformed.
        ConnectError: ``curve`` is a server config and another ZAP handler (not
            tensorrpc's) serves the context.
        TransportError: ZMQ refused to create or configure the socket.
    """
    if routing_id is not None:
        _check_routing_id(routing_id)
    ctx = context if context is not None else zmq.Context.instance(io_threads=_IO_THREADS)
    with map_zmq_errors("create socket"):
        sock = ctx.socket(socket_type)
    on_close: Callable[[], None] | None = None
    try:
        with map_zmq_errors("configure socket"):
            _configure(sock, socket_type, options, routing_id)
            if ctx.get(zmq.IO_THREADS) >= _IO_THREADS:
                sock.setsockopt(zmq.AFFINITY, _BULK_THREAD if bulk else _CONTROL_THREAD)
            if curve is not None:
                on_close = apply_curve(sock, curve, ctx)
        monitor = _handshake_monitor(sock, watch_connections=watch_connections)
    except BaseException:
        sock.close(linger=0)
        if on_close is not None:
            on_close()
        raise
    return AsyncSocket(sock, on_close=on_close, monitor=monitor, keep_connections=watch_connections)


def _configure(
    sock: zmq.Socket[bytes], socket_type: int, options: SocketOptions, routing_id: bytes | None
) -> None:
    """Apply ``options`` (and the routing id) to a new socket."""
    sock.setsockopt(zmq.LINGER, options.linger_ms)
    sock.setsockopt(zmq.SNDHWM, options.sndhwm)
    sock.setsockopt(zmq.RCVHWM, options.rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, options.maxmsgsize)
    if options.tcp_keepalive:
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, options.tcp_keepalive_idle_s)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, options.tcp_keepalive_intvl_s)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, options.tcp_keepalive_cnt)
    if socket_type == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, int(options.router_mandatory))
        sock.setsockopt(zmq.ROUTER_HANDOVER, int(options.router_handover))
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.copy_threshold = options.copy_threshold


#: The monitor events `AsyncSocket.connection_events` reports (value: the descriptor).
_CONNECTION_UP: Final = frozenset({int(zmq.EVENT_ACCEPTED), int(zmq.EVENT_CONNECTED)})
_CONNECTION_EVENTS: Final = int(zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)


def _handshake_monitor(
    sock: zmq.Socket[bytes], *, watch_connections: bool = False
) -> zmq.Socket[bytes] | None:
    """The socket's monitor for failed handshakes (and, if asked, connections coming and
    going); None for a libzmq without monitor events."""
    events = HANDSHAKE_FAILURE_EVENTS
    if watch_connections:
        events |= _CONNECTION_EVENTS
    try:
        monitor = sock.get_monitor_socket(events)
    except zmq.ZMQError:
        return None
    with contextlib.suppress(zmq.ZMQError):
        monitor.setsockopt(zmq.LINGER, 0)
    return monitor


def _check_routing_id(routing_id: bytes) -> None:
    if not isinstance(routing_id, bytes):
        raise TypeError(f"routing ids are bytes, not {type(routing_id).__name__}")
    if not 1 <= len(routing_id) <= 255:
        raise ValueError(f"a routing id is 1 to 255 bytes long, not {len(routing_id)}")
    if routing_id[0] == 0:
        raise ValueError("a routing id must not start with a zero byte (reserved by ZMQ)")


class _FdWaiter:
    """Waiting on a socket's edge-triggered ``ZMQ_FD`` (rules 2-4 of the module docstring).

    On asyncio the FD is registered with the loop once and every waiting task holds a
    future; elsewhere one task waits on the FD and the others park on an event.

    Args:
        fd: The socket's ``ZMQ_FD``.
        get: The socket's option getter (reads ``EVENTS``).
    """

    __slots__ = (
        "_changed",
        "_fd",
        "_get",
        "_loop",
        "_waiters",
        "amask",
        "closed",
        "fd_mask",
        "fd_scope",
    )

    def __init__(self, fd: int, get: Callable[[int], int]) -> None:
        self._fd = fd
        self._get = get
        self.closed = False
        #: trio: the scope of the task waiting on the FD, and the conditions it waits for.
        self.fd_scope: anyio.CancelScope | None = None
        self.fd_mask = 0
        self._changed: anyio.Event | None = None  # created lazily, inside the event loop
        # asyncio: the loop our FD is registered with, the waiting tasks' (mask, future)
        # pairs and the union of their masks.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self.amask = 0

    def poke(self, events: int) -> None:
        """Wake the tasks waiting for something ``events`` shows.

        Any operation (and any EVENTS read) may consume the FD's edge: a task waiting for
        something ``events`` shows must re-check.
        """
        if events & self.amask:
            self._wake_waiters(events)
        scope = self.fd_scope
        if scope is not None and events & self.fd_mask:
            scope.cancel()

    def _wake_waiters(self, events: int) -> None:
        """asyncio: wake every waiting task whose condition ``events`` shows."""
        keep: list[tuple[int, asyncio.Future[None]]] = []
        amask = 0
        for entry in self._waiters:
            mask, fut = entry
            if mask & events:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append(entry)
                amask |= mask
        self._waiters = keep
        self.amask = amask

    def _on_readable(self) -> None:
        """asyncio reader callback: the socket's mailbox has commands."""
        if self.closed:
            return
        try:
            events = self._get(_EVENTS)  # processes the commands: the FD is drained
        except zmq.ZMQError:
            events = -1  # let every waiter retry and meet the error itself
        if events & self.amask:
            self._wake_waiters(events)

    def _register(self, loop: asyncio.AbstractEventLoop) -> None:
        old = self._loop
        if old is not None and not old.is_closed():
            with contextlib.suppress(Exception):
                old.remove_reader(self._fd)
        self._loop = None
        loop.add_reader(self._fd, self._on_readable)
        self._loop = loop

    async def _wait_asyncio(
        self, loop: asyncio.AbstractEventLoop, mask: int, patience: float | None
    ) -> bool:
        if self._loop is not loop:
            self._register(loop)
        fut: asyncio.Future[None] = loop.create_future()
        entry = (mask, fut)
        self._waiters.append(entry)
        self.amask |= mask
        try:
            if patience is None:
                await fut
            else:
                with anyio.move_on_after(patience):
                    await fut
        finally:
            if not fut.done() or fut.cancelled():
                # Not woken (cancelled, or out of patience): leave the list.
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                amask = 0
                for m, _ in self._waiters:
                    amask |= m
                self.amask = amask
                fut.cancel()
        # Woken only by an EVENTS read that showed ``mask`` (or by close, which the
        # caller checks first).
        return fut.done() and not fut.cancelled()

    async def wait(self, mask: int, events: int, patience: float | None = None) -> bool:
        """Wait until ``EVENTS & mask`` may be true; the caller then retries its operation.

        Args:
            mask: ``POLLIN`` or ``POLLOUT``.
            events: ``EVENTS`` as read after the operation failed with ``Again``.
            patience: Give up waiting after this many seconds (None: no limit).

        Returns:
            True when an EVENTS read that showed ``mask`` ended the wait (the operation
            will most likely succeed: it may be tried before reading EVENTS again), False
            when only the FD (or another task) said something changed.

        Raises:
            ClosedError: The socket is closed (also while waiting).
        """
        self.poke(events)  # reading ``events`` may have eaten the FD waiter's edge
        if patience is None and events & mask:
            await anyio.lowlevel.checkpoint()
            return False
        if self.closed:
            raise ClosedError("the socket was closed")
        loop = _get_running_loop()
        shown = False
        if loop is not None:
            shown = await self._wait_asyncio(loop, mask, patience)
        elif self.fd_scope is None:
            await self._wait_fd(mask, patience)
        else:
            await self._wait_parked(mask, patience)
        if self.closed:
            raise ClosedError("the socket was closed while waiting")
        return shown

    async def _wait_fd(self, mask: int, patience: float | None) -> None:
        """Not asyncio: this task waits on the FD for everyone."""
        with anyio.CancelScope() as scope:
            if patience is not None:
                scope.deadline = anyio.current_time() + patience
            self.fd_scope = scope
            self.fd_mask = mask
            try:
                await anyio.wait_readable(self._fd)
            except Exception as exc:
                if self.closed:
                    raise ClosedError("the socket was closed while waiting") from exc
                raise
            finally:
                self.fd_scope = None
                self.fd_mask = 0
                self._wake_parked()

    async def _wait_parked(self, mask: int, patience: float | None) -> None:
        """Not asyncio: another task waits on the FD; park until it wakes up."""
        self.fd_mask |= mask
        changed = self._changed
        if changed is None:
            changed = self._changed = anyio.Event()
        if patience is None:
            await changed.wait()
        else:
            with anyio.move_on_after(patience):
                await changed.wait()

    def _wake_parked(self) -> None:
        changed = self._changed
        if changed is not None:
            self._changed = None
            changed.set()

    def close(self) -> None:
        """The socket is closing: wake every waiter (each then raises ClosedError)."""
        self.closed = True
        if self.fd_scope is not None:
            anyio.notify_closing(self._fd)
        self._wake_parked()
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            # Waiters see ``closed`` when they resume and raise ClosedError.
            with contextlib.suppress(Exception):
                loop.remove_reader(self._fd)
            with contextlib.suppress(RuntimeError):
                self._wake_waiters(-1)


class _HandshakeLog:
    """The failed handshakes a socket's monitor reports (see `AsyncSocket.handshake_failures`).

    Args:
        sock: The socket (its CURVE role names it in the log).
        monitor: Its monitor socket.
    """

    __slots__ = (
        "_counts",
        "_failures",
        "_monitor",
        "_sock",
        "_waiting",
        "connections",
        "disconnects",
    )

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        monitor: zmq.Socket[bytes] | None,
        *,
        keep_connections: bool = False,
    ) -> None:
        self._sock = sock
        self._monitor = monitor
        self._failures: deque[str] = deque(maxlen=_MAX_FAILURES)
        self._counts: dict[str, int] = {}
        #: Established connections that ended (with ``watch_connections`` only).
        self.disconnects = 0
        #: ``(up, fd)`` per connection event not taken yet (``keep_connections``: the
        #: taker reads them all each time it is woken, so the monitor's queue bounds it).
        self.connections: deque[tuple[bool, int]] | None = deque() if keep_connections else None
        self._waiting = False

    def read(self) -> tuple[str, ...]:
        """Read the queued monitor events, log the new reasons, return the recent ones."""
        monitor = self._monitor
        if monitor is None:
            return tuple(self._failures)
        while True:
            try:
                message = monitor.recv_multipart(_NOBLOCK)
            except zmq.ZMQError:  # Again: nothing more queued
                break
            try:
                event = parse_monitor_message(message)
            except Exception:  # a malformed event must not break the caller
                continue
            kind = int(event["event"])
            if kind & _CONNECTION_EVENTS:
                if kind == zmq.EVENT_DISCONNECTED:
                    self.disconnects += 1
                if self.connections is not None:
                    self.connections.append((kind in _CONNECTION_UP, int(event["value"])))
                continue
            endpoint = bytes(event["endpoint"]).decode("utf-8", "replace")
            self._record(
                describe_handshake_failure(int(event["event"]), int(event["value"]), endpoint)
            )
        return tuple(self._failures)

    def _record(self, text: str) -> None:
        self._failures.append(text)
        counts = self._counts
        count = counts.get(text, 0) + 1
        if len(counts) < _MAX_REASONS or text in counts:
            counts[text] = count
        if count % 100 == 1:
            _security_logger.warning(
                "%s [seen by this %s]%s",
                text,
                self._role(),
                f" ({count} times so far)" if count > 1 else "",
            )

    def _role(self) -> str:
        sock = self._sock
        try:
            if sock.getsockopt(zmq.MECHANISM) != zmq.CURVE:
                return "plaintext socket"
            return "CURVE server" if sock.getsockopt(zmq.CURVE_SERVER) else "CURVE client"
        except zmq.ZMQError:
            return "socket"

    async def disconnected(self) -> None:
        """Wait until an established connection ends (see `AsyncSocket.disconnected`)."""
        seen = self.disconnects
        while True:
            self.read()  # drains the monitor: its edge-triggered FD may then signal anew
            monitor = self._monitor
            if monitor is None:
                raise ClosedError("the socket was closed while waiting")
            if self.disconnects > seen:
                return
            self._waiting = True
            try:
                await anyio.wait_readable(monitor.FD)
            except Exception:  # closed while waiting: the next turn raises ClosedError
                continue
            finally:
                self._waiting = False

    def close(self) -> None:
        """Stop monitoring (before the socket closes)."""
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            if self._waiting:
                anyio.notify_closing(monitor.FD)
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            monitor.close(linger=0)


class AsyncSocket:
    """A pyzmq socket driven from anyio (asyncio or trio), one per event-loop thread.

    Any number of tasks may call `send` and `recv` concurrently; the socket
    itself must only be used from the thread running the event loop.

    Zero-copy: with ``copy=False`` (the default) buffers of at least ``copy_threshold``
    bytes are handed to ZMQ without copying; ZMQ keeps a reference to them until it has
    sent them, but **their contents must not change** until then. Send with
    ``track=True`` and keep the owners of the memory (see `PendingSends`) until
    ``tracker.done``.

    Args:
        sock: A configured pyzmq socket (see `create_socket`); this object owns it.
        on_close: Called once, after the socket is closed (e.g. to release its ZAP domain).
    """

    __slots__ = (
        "_bound_files",
        "_closed",
        "_fd",
        "_get",
        "_handshakes",
        "_on_close",
        "_run",
        "_since",
        "_sock",
        "_streak",
        "_threshold",
        "_waiter",
    )

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        *,
        on_close: Callable[[], None] | None = None,
        monitor: zmq.Socket[bytes] | None = None,
        keep_connections: bool = False,
    ) -> None:
        self._sock = sock
        self._on_close = on_close
        self._handshakes = _HandshakeLog(sock, monitor, keep_connections=keep_connections)
        self._fd: int = sock.FD
        self._get = cast("Callable[[int], int]", sock.get)
        self._threshold: int = sock.copy_threshold
        self._closed = False
        self._waiter = _FdWaiter(self._fd, self._get)
        self._streak = 0
        # Receives in a row that got a message (rule 1).
        self._run = 0
        # When this socket's user resumed after it last waited or yielded: ``inf`` until
        # its next operation (the budget restarts when the wait or yield *ends*).
        self._since = math.inf
        # ipc:// files we bound, with (st_dev, st_ino) to only ever remove our own file.
        self._bound_files: dict[str, tuple[int, int]] = {}

    # -- properties -------------------------------------------------------------------------

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The underlying pyzmq socket (for options; do not send or receive on it)."""
        return self._sock

    @property
    def closed(self) -> bool:
        """Whether `aclose` (or `close`) was called."""
        return self._closed

    @property
    def socket_type(self) -> int:
        """``zmq.ROUTER``, ``zmq.DEALER``, ..."""
        return int(self._sock.get(zmq.TYPE))

    # -- endpoints --------------------------------------------------------------------------

    def bind(self, endpoint: str) -> str:
        """Bind to ``endpoint`` and return the real endpoint.

        ``tcp://127.0.0.1:0`` binds an ephemeral port and returns ``tcp://127.0.0.1:PORT``.
        For ``ipc://PATH`` the socket file is removed again on close. Binding every
        interface (``tcp://*:PORT``, ``tcp://0.0.0.0:PORT``, ``tcp://[::]:PORT``) without
        CURVE logs a warning on the ``tensorrpc.security`` logger.

        Args:
            endpoint: ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME``.

        Returns:
            The endpoint peers should connect to (read back from ``LAST_ENDPOINT``).

        Raises:
            ClosedError: The socket is closed.
            ConnectError: The endpoint is malformed, in use or not available.
        """
        self._check_open()
        with map_zmq_errors(f"bind {endpoint}"):
            warn_if_exposed(endpoint, self._sock)
            self._sock.bind(endpoint)
            real = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if real.startswith("ipc://") and not real.startswith("ipc://@"):
            path = real[len("ipc://") :]
            with contextlib.suppress(OSError):
                st = os.stat(path)
                self._bound_files[path] = (st.st_dev, st.st_ino)
        return real

    def connect(self, endpoint: str, *, peer_id: bytes | None = None) -> None:
        """Connect to ``endpoint`` (ZMQ connects in the background and reconnects).

        Args:
            endpoint: ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME``.
            peer_id: ROUTER only: the routing id under which the peer at this endpoint
                will be addressed (``CONNECT_ROUTING_ID``).

        Raises:
            ClosedError: The socket is closed.
            ConnectError: The endpoint is malformed.
            ValueError: ``peer_id`` is malformed.
        """
        self._check_open()
        with map_zmq_errors(f"connect {endpoint}"):
            if peer_id is not None:
                _check_routing_id(peer_id)
                self._sock.setsockopt(zmq.CONNECT_ROUTING_ID, peer_id)
            self._sock.connect(endpoint)

    def disconnect(self, endpoint: str) -> None:
        """Undo `connect` for ``endpoint``.

        Raises:
            ClosedError: The socket is closed.
            ConnectError: The socket is not connected to ``endpoint``.
        """
        self._check_open()
        with map_zmq_errors(f"disconnect {endpoint}"):
            self._sock.disconnect(endpoint)

    # -- sending ----------------------------------------------------------------------------

    def _prepare(
        self, frames: Sequence[Buffer | zmq.Frame], track: bool, copy: bool
    ) -> tuple[Sequence[Buffer | zmq.Frame], zmq.MessageTracker | None]:
        if not track:
            return frames, None
        if copy:
            return frames, zmq.MessageTracker()
        parts: list[Buffer | zmq.Frame] = []
        tracked: list[zmq.Frame] = []
        threshold = self._threshold
        for frame in frames:
            if isinstance(frame, zmq.Frame):
                parts.append(frame)
                if frame.tracker is not None:
                    tracked.append(frame)
            elif memoryview(frame).nbytes < threshold:
                parts.append(frame)  # copied by pyzmq: nothing to track
            else:
                tracked_frame = zmq.Frame(frame, track=True, copy=False)
                parts.append(tracked_frame)
                tracked.append(tracked_frame)
        return parts, zmq.MessageTracker(*tracked)

    def _send_once(self, parts: Sequence[Buffer | zmq.Frame], copy: bool) -> bool:
        sock = self._sock
        threshold = self._threshold
        try:
            # NOBLOCK multipart sends are atomic: once the first frame is queued, the others
            # are too (ZMQ checks the high-water mark on the first frame only). Small bytes
            # (routing id, header, a small payload) go by pyzmq's copying path, which pyzmq
            # would take for them anyway, after a memoryview and two lookups more.
            last = len(parts) - 1
            for i in range(last):
                part = parts[i]
                small = type(part) is bytes and len(part) < threshold
                _BASE_SEND(sock, part, _SNDMORE_NOBLOCK, copy or small)
            part = parts[last]
            small = type(part) is bytes and len(part) < threshold
            _BASE_SEND(sock, part, _NOBLOCK, copy or small)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            peer = b""
            if exc.errno == errno.EHOSTUNREACH and parts:
                first = parts[0]
                peer = first.bytes if isinstance(first, zmq.Frame) else bytes(first)
            raise translate_zmq_error(exc, "send", peer=peer) from exc
        return True

    def send_nowait(
        self, frames: Sequence[Buffer | zmq.Frame], *, track: bool = False, copy: bool = False
    ) -> zmq.MessageTracker | None:
        """Send one multipart message if that can be done without waiting.

        Args:
            frames: The message's frames (on a ROUTER the first is the peer's routing id).
            track: Return a tracker that is done once ZMQ no longer needs the buffers.
            copy: Copy every frame instead of referencing large buffers.

        Returns:
            The tracker when ``track`` is true, else None.

        Raises:
            anyio.WouldBlock: The message cannot be queued now (high-water mark).
            ClosedError: The socket is closed.
            PeerUnreachableError: ROUTER: no peer with that routing id is connected.
            TransportError: Any other ZMQ failure.
        """
        if self._closed:  # `_check_open` and `_prepare`, inline: the small reply's path
            raise ClosedError("the socket is closed")
        if track:
            parts, tracker = self._prepare(frames, track, copy)
        else:
            parts, tracker = frames, None
        sent = self._send_once(parts, copy)
        self._after_op()
        if not sent:
            raise anyio.WouldBlock
        return tracker

    async def send(
        self, frames: Sequence[Buffer | zmq.Frame], *, track: bool = False, copy: bool = False
    ) -> zmq.MessageTracker | None:
        """`send_nowait`, waiting while the high-water mark is reached (`ClosedError` also
        while waiting). Cancellation-safe: the whole message was sent or none of it."""
        self._check_open()
        parts, tracker = self._prepare(frames, track, copy)
        backoff = _PEER_FULL_BACKOFF_S
        retried = False
        while not self._send_once(parts, copy):
            events = self._get(_EVENTS)
            if events & _POLLOUT and retried:
                # POLLOUT, yet the send failed twice: a ROUTER whose *other* peers have room.
                # The FD will not announce when ours drains, so wait for it only a while.
                await self._wait(_POLLOUT, events, patience=backoff)
                backoff = min(backoff * 2, _PEER_FULL_BACKOFF_MAX_S)
            else:
                # With POLLOUT the failure may just have been stale state (reading EVENTS
                # processed the peer's pending "room again" commands): retry at once.
                retried = bool(events & _POLLOUT)
                await self._wait(_POLLOUT, events)
        self._after_op()
        if self._streak >= _FAIRNESS_STREAK:
            self._streak = 0
            self._since = math.inf
            await anyio.lowlevel.cancel_shielded_checkpoint()
        return tracker

    # -- receiving --------------------------------------------------------------------------

    def recv_nowait(self) -> list[zmq.Frame]:
        """Receive one multipart message if one is waiting.

        Returns:
            The message's frames, not copied (on a ROUTER the first is the routing id).

        Raises:
            anyio.WouldBlock: No message is waiting.
            ClosedError: The socket is closed.
            TransportError: Any other ZMQ failure.
        """
        self._check_open()
        waiter = self._waiter
        try:
            if self._run >= 2:  # rule 1: in a run of messages, try the next one at once
                try:
                    return self._took(self._recv_frames())
                except zmq.Again:
                    self._run = 0
                # The failed receive read the commands: only a waiter needs EVENTS.
                events = self._get(_EVENTS) if waiter.fd_mask or waiter.amask else 0
            else:
                events = self._get(_EVENTS)
                if events & _POLLIN:
                    return self._took(self._recv_frames())
                self._run = 0
        except zmq.Again:
            self._after_op()
            raise anyio.WouldBlock from None
        except zmq.ZMQError as exc:
            raise translate_zmq_error(exc, "recv") from exc
        self._streak += 1
        # Reading EVENTS may have eaten the FD's edge: wake a waiter to re-check.
        waiter.poke(events)
        raise anyio.WouldBlock

    def _took(self, frames: list[zmq.Frame]) -> list[zmq.Frame]:
        self._run += 1
        self._after_op()
        return frames

    def _recv_frames(self) -> list[zmq.Frame]:
        # A multipart message is atomic: once its first frame is here, all of them are.
        sock = self._sock
        frame: zmq.Frame = _BASE_RECV(sock, _NOBLOCK, False)
        frames = [frame]
        while frame.more:
            frame = _BASE_RECV(sock, _NOBLOCK, False)
            frames.append(frame)
        return frames

    async def recv(self) -> list[zmq.Frame]:
        """Receive one multipart message, waiting for it if needed.

        Cancellation-safe: a cancelled receive has not taken a message off the socket.

        Returns:
            The message's frames, not copied (on a ROUTER the first is the routing id).
            ``frame.buffer`` is a memoryview of a frame's bytes that keeps it alive.

        Raises:
            ClosedError: The socket is closed (also while waiting).
            TransportError: Any other ZMQ failure.
        """
        self._check_open()
        if self.yield_due():
            # Yield before taking a message, never while holding one: another task that
            # receives from this socket meanwhile must not get the messages after it first.
            await anyio.lowlevel.cancel_shielded_checkpoint()
        get = self._get
        shown = False
        while True:
            try:
                # Rule 1: in a run of messages, or woken by an EVENTS read that showed a
                # message, try to take it at once (a failed receive reads the commands
                # as an EVENTS read does: it costs only the exception).
                if shown or self._run >= 2:
                    shown = False
                    try:
                        return self._took(self._recv_frames())
                    except zmq.Again:
                        self._run = 0
                events = get(_EVENTS)
                if not events & _POLLIN:
                    self._run = 0
                    shown = await self._wait(_POLLIN, events)
                    continue
                return self._took(self._recv_frames())
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                raise translate_zmq_error(exc, "recv") from exc

    def yield_due(self) -> bool:
        """Whether the caller should let the event loop run now (and the budget restarts).

        True after 32 operations in a row that did not wait, or once 2 ms have passed
        since the first operation after the socket last waited or yielded (including the
        time its user spent handling what it received, not the wait or the yield itself:
        other tasks running meanwhile must not make the next message yield at once). A
        loop that receives with `recv_nowait` calls this after each message and yields
        when it is true; `recv` does so itself.
        """
        if self._streak >= _FAIRNESS_STREAK or _monotonic() - self._since >= _FAIRNESS_S:
            self._streak = 0
            self._since = math.inf
            return True
        return False

    # -- waiting ----------------------------------------------------------------------------

    def _after_op(self) -> None:
        self._streak += 1
        if self._since == _INF:  # the first operation since a wait or a yield
            self._since = _monotonic()
        waiter = self._waiter
        if waiter.fd_mask or waiter.amask:
            waiter.poke(self._get(_EVENTS))

    def _wait(self, mask: int, events: int, patience: float | None = None) -> Awaitable[bool]:
        """Wait until ``EVENTS & mask`` may be true (see `_FdWaiter.wait`).

        A plain function returning the waiter's coroutine: no extra coroutine per wait.
        """
        self._streak = 0
        self._since = math.inf
        return self._waiter.wait(mask, events, patience)

    # -- handshake failures -----------------------------------------------------------------

    def handshake_failures(self) -> tuple[str, ...]:
        """The recent failed handshakes of this socket (CURVE refusals, mechanism mismatch).

        Reads the events libzmq's socket monitor queued since the last call (without
        waiting), logs each new reason at WARNING on the ``tensorrpc.security`` logger
        (a reason that repeats, as a peer retrying does, is logged again every 100th
        time), and returns the most recent 16, oldest first.

        Returns:
            One line per failure: ``"handshake on tcp://...: authentication failed (ZAP
            status 400: ...)"``; empty when none failed (or libzmq has no monitor).
        """
        return self._handshakes.read()

    async def disconnected(self) -> None:
        """Wait until one of this socket's established connections ends (ZMQ's
        ``EVENT_DISCONNECTED``): a socket created with ``watch_connections`` only.

        Raises:
            ClosedError: The socket was closed (or has no monitor).
        """
        await self._handshakes.disconnected()

    def connection_events(self) -> list[tuple[bool, int]]:
        """The connections that came (``(True, fd)``) and went (``(False, fd)``) since
        the last call, in the order libzmq reported them, without waiting (a socket
        created with ``watch_connections`` only; else always empty).

        libzmq reports a connection's end before it closes the descriptor, and a new
        connection before any message of it can be received: read after a message, these
        say whether the descriptor that message came on (``ZMQ_SRCFD``) still carries
        its connection.
        """
        log = self._handshakes
        log.read()
        kept = log.connections
        if not kept:
            return []
        events = list(kept)
        kept.clear()
        return events

    # -- closing ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the socket is closed")

    def close(self) -> None:
        """Close the socket now (synchronous form of `aclose`).

        Must not be called while another task waits on this socket outside an event loop;
        inside one, tasks waiting in `send`/`recv` get [`ClosedError`][tensorrpc.ClosedError].
        """
        if self._closed:
            return
        self._closed = True
        self._waiter.close()
        self._handshakes.close()
        self._sock.close(linger=None)
        self._remove_bound_files()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def _remove_bound_files(self) -> None:
        for path, (dev, ino) in self._bound_files.items():
            with contextlib.suppress(OSError):
                st = os.stat(path)
                if (st.st_dev, st.st_ino) == (dev, ino):
                    os.unlink(path)
        self._bound_files.clear()

    async def aclose(self) -> None:
        """Close the socket, remove the ipc:// files it bound, wake its waiters.

        Tasks waiting in `send` or `recv` raise [`ClosedError`][tensorrpc.ClosedError].
        Messages still queued are dropped after ``linger_ms``. Idempotent.
        """
        self.close()
        await anyio.lowlevel.cancel_shielded_checkpoint()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"fd={self._fd}"
        return f"<AsyncSocket {state}>"


#: ``SO_PEERPIDFD`` (Linux 6.5): a pidfd of the process at the other end of a unix socket.
_SO_PEERPIDFD: Final = 77
_SRCFD: Final = int(zmq.SRCFD)


def message_peer_address(frame: object) -> str:
    """The ``Peer-Address`` libzmq attached to a received frame ("" when none).

    On ``ipc://`` it carries the kernel's credentials of the connection the message came
    on (``"<host>:<uid>:<gid>:<pid>"``, read by libzmq with ``SO_PEERCRED`` when the
    connection was made); it cannot refer to another connection.
    """
    get = getattr(frame, "get", None)
    if get is None:
        return ""
    try:
        value = get("Peer-Address")
    except (zmq.ZMQError, TypeError, ValueError):
        return ""
    return value if isinstance(value, str) else ""


def peer_credentials(frame: object) -> KernelPeer | None:
    """The kernel's identity of the process that sent ``frame``, pinned by a pidfd.

    ``ipc://`` only: the message's ``Peer-Address`` names the connection's peer
    (pid, uid, gid); the connection's descriptor (``ZMQ_SRCFD``, deprecated in libzmq
    but present in 4.3) gives a pidfd of that very process (``SO_PEERPIDFD``; on older
    kernels ``pidfd_open`` of the pid the address names). `KernelPeer.pinned`
    refuses a pidfd of another process (the descriptor number reused meanwhile).

    Returns:
        None when the kernel cannot attest the peer (tcp, inproc, no credentials).
    """
    address = message_peer_address(frame)
    creds = parse_peer_address(address)
    if creds is None:
        return None
    try:
        fd = cast("zmq.Frame", frame).get(_SRCFD)
    except (zmq.ZMQError, TypeError, ValueError):
        return None
    if not isinstance(fd, int) or fd < 0:
        return None
    pidfd = -1
    try:
        # A dup of the connection's socket; closed below (the connection is libzmq's).
        sock = socket.fromfd(fd, socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:
        return None
    try:
        if sock.family != socket.AF_UNIX:
            return None
        try:
            pidfd = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
        except OSError:
            pidfd = -1
        if pidfd < 0:
            try:
                pidfd = os.pidfd_open(creds[0])
            except OSError:
                return None
    finally:
        sock.close()
    return KernelPeer.pinned(address, pidfd)


def _start_time(pid: int) -> int:
    """The start time of process ``pid`` (clock ticks after boot; -1: unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # The command name (field 2) may hold spaces and parentheses: count from its end.
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return -1


def source_fd(frame: object) -> int:
    """The descriptor of the connection ``frame`` came on (``ZMQ_SRCFD``; -1: none)."""
    try:
        fd = cast("zmq.Frame", frame).get(_SRCFD)
    except (zmq.ZMQError, TypeError, ValueError, AttributeError):
        return -1
    return fd if isinstance(fd, int) else -1


def shut_connection(fd: int) -> bool:
    """Shut down both ways the connection libzmq holds on descriptor ``fd``.

    libzmq then sees its connection end and tears it down as on any disconnect (it
    closes the descriptor; this only shuts a duplicate of it). How a ROUTER closes one
    peer's connection, which its API cannot. The caller must know that ``fd`` still
    carries the connection it means (`AsyncSocket.connection_events`).

    Returns:
        False: ``fd`` is no socket (any more).
    """
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return False
    with sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True


def connection_voucher(frame: object) -> Voucher:
    """What vouches for the connection ``frame`` came on (the bulk binding's input).

    The ZAP User-Id (the peer's CURVE public key) when CURVE authenticated it; else, on
    ``ipc://``, the process the kernel says is at its other end: pid, uid and start
    time, read while a pidfd pins that process (so a reused pid cannot stand in);
    else nothing (plain tcp, inproc).
    """
    get = getattr(frame, "get", None)
    if get is not None:
        try:
            user = get("User-Id")
        except (zmq.ZMQError, TypeError, ValueError):
            user = None
        if isinstance(user, str) and user:
            return Voucher("curve", user.encode())
    kernel = peer_credentials(frame)
    if kernel is None:
        return Voucher("none")
    try:
        start = _start_time(kernel.pid)
        if start < 0 or not kernel.alive():
            return Voucher("none")
        return Voucher("kernel", (kernel.pid, kernel.uid, start))
    finally:
        kernel.close()


def _done(tracker: zmq.MessageTracker | None) -> bool:
    return tracker is None or tracker.done


class PendingSends:
    """Keeps the memory of zero-copy sends alive until ZMQ is done with it.

    The pattern of vLLM's ``add_pending_message``: after ``send(..., track=True)``, call
    `add` with the tracker and the objects owning the sent buffers (tensors,
    contiguous temporaries). Done entries are dropped cheaply on every `add`, so the
    list stays as short as the number of messages ZMQ still holds. The owners of a large
    send (``nbytes`` at least `tensorrpc._release.threshold`) are dropped by the release
    thread, not on the event loop.

    Args:
        max_scan: Scan the whole list for done entries once it grows past this many
            entries since the last full scan (trackers usually finish in order, so the
            cheap check from the oldest end is normally enough).
    """

    __slots__ = ("_items", "_next_scan", "_scan")

    def __init__(self, *, max_scan: int = 64) -> None:
        self._items: deque[tuple[zmq.MessageTracker | None, object, bool]] = deque()
        self._scan = max_scan
        self._next_scan = max_scan

    def add(self, tracker: zmq.MessageTracker | None, keepalive: object, nbytes: int = 0) -> None:
        """Hold ``keepalive`` until ``tracker`` is done (a small send that already is
        needs nothing; a large one waits for the next `prune`).

        Args:
            tracker: What `AsyncSocket.send` returned with ``track=True``.
            keepalive: The objects owning the sent buffers (any object; a list is fine).
            nbytes: The size of the sent buffers (a large send's owners are released
                off the event loop).
        """
        self.prune()
        large = nbytes >= _release.threshold()
        # A large send is kept even when ZMQ is already done with it: its sender still
        # holds the message's frames, views of the same memory that the release thread
        # cannot see (it counts references to ``keepalive`` only). Handed over now, the
        # memory would die with those views, on the event loop; the next prune runs
        # once the sender has dropped them.
        if large or (tracker is not None and not tracker.done):
            self._items.append((tracker, keepalive, large))

    def prune(self) -> int:
        """Drop the entries whose tracker is done.

        Returns:
            How many entries are still pending.
        """
        items = self._items
        while items and _done(items[0][0]):
            _, keepalive, large = items.popleft()
            if large:
                _release.later(keepalive)
        if len(items) > self._next_scan:
            kept: deque[tuple[zmq.MessageTracker | None, object, bool]] = deque()
            for item in items:
                if not _done(item[0]):
                    kept.append(item)
                elif item[2]:
                    _release.later(item[1])
            self._items = items = kept
            self._next_scan = len(items) + self._scan
        return len(items)

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        """Forget every entry (only once the socket is closed and ZMQ holds nothing)."""
        items, self._items = self._items, deque()
        for _, keepalive, large in items:
            if large:
                _release.later(keepalive)
