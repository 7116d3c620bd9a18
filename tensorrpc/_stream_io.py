"""The client's request streams (client streaming and bidirectional calls), the I/O.

`send_request` is a task per request stream: it takes the caller's items as the engine's
credit allows (the rules are `tensorrpc._streams`'), checks, encodes and sends each one,
and half-closes once the caller's iterable is exhausted. It stops when the call ends (the
call's end cancels its scope), so a slow engine stalls only this stream. The engine's side
is `tensorrpc._dispatch.RequestItems`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from tensorrpc import _codec, _release, _streams
from tensorrpc._compression import OFF_LOOP_BYTES, ZSTD
from tensorrpc._exceptions import (
    PeerUnreachableError,
    TensorTransportError,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from tensorrpc._calls import Call
    from tensorrpc._client_io import ClientIO
    from tensorrpc._compression import Compression
    from tensorrpc._service import MethodSpec
    from tensorrpc.transports._policy import PolicyPlacer

__all__ = ["RequestSource", "fill_off_loop", "request_source", "send_request"]

logger = logging.getLogger("tensorrpc")


class RequestSource:
    """The caller's request items of one call (an async or a plain iterable)."""

    __slots__ = ("items",)

    def __init__(self, items: AsyncIterable[Any] | Iterable[Any]) -> None:
        self.items = items

    def __aiter__(self) -> AsyncIterator[Any]:
        items = self.items
        if isinstance(items, AsyncIterable):
            return aiter(items)
        return _from_sync(items)


async def _from_sync(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def request_source(
    spec: MethodSpec, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> RequestSource:
    """Bind a request-streaming call's one argument: the iterable of its items.

    Raises:
        TypeError: Not exactly one argument, or it is not iterable.
    """
    name = spec.item_param
    if len(args) + len(kwargs) != 1 or (kwargs and name not in kwargs):
        raise TypeError(f"{spec.qualname}() takes one argument, '{name}': the request items")
    items = args[0] if args else kwargs[name]
    if not isinstance(items, AsyncIterable | Iterable) or isinstance(items, str | bytes):
        raise TypeError(
            f"{spec.qualname}: '{name}' must be an async iterable (or an iterable) of items, "
            f"not {type(items).__name__}"
        )
    return RequestSource(items)


# -- the client's sender -------------------------------------------------------------------


async def send_request(
    io: ClientIO,
    call: Call,
    source: RequestSource,
    compression: Compression | None,
    maxmsgsize: int,
    transport: str = "auto",
) -> None:
    """Send ``source``'s items on ``call`` as credit allows, then half-close.

    ``transport`` is the call's tensor transport: an item's tensors go by handle under
    the same rules as a unary call's arguments, their lease held until the call ends.

    Runs as a task of its own; it ends when the items do or when the call ends (the
    call's end cancels its scope). An item that fails its check or encoding, or an
    exception from the caller's iterable, ends the call: the caller gets that error.
    """
    request = call.request
    assert request is not None
    with anyio.CancelScope() as scope:
        request.scope = scope
        if call.ended:
            return
        iterator = aiter(source)
        try:
            await _send_items(io, call, iterator, compression, maxmsgsize, transport)
        except Exception as exc:
            if not call.ended:
                call.error = exc
                io.abandon(call, error=True)
        finally:
            request.scope = None
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await aclose()
                    except Exception:
                        logger.debug("a request iterator failed to close", exc_info=True)


async def _send_items(
    io: ClientIO,
    call: Call,
    iterator: AsyncIterator[Any],
    compression: Compression | None,
    maxmsgsize: int,
    transport: str,
) -> None:
    request = call.request
    assert request is not None
    spec = call.spec
    check_item = spec.check_item
    assert check_item is not None
    engine = call.engine
    if engine.shm is not None or ZSTD not in engine.info.compression:
        compression = None
    index = 0
    while True:
        while request.credit <= 0:  # the engine's buffer for this stream is full
            waiters = io.waiters
            assert waiters is not None
            token = request.waiter = waiters.new()
            await waiters.wait(token)
        try:
            value = await iterator.__anext__()
        except StopAsyncIteration:
            break
        wire = check_item(value, index)
        index += 1
        if not await _send_item(io, call, wire, index - 1, compression, maxmsgsize, transport):
            return  # the call ended meanwhile
        # Not held while the caller makes the next item: the sent item's last
        # references are the pending send's (released off the loop once ZMQ is done).
        del value, wire
    if _streams.half_close(io.protocol, call, io.now()):
        io.flush()


async def _send_item(
    io: ClientIO,
    call: Call,
    wire: Any,
    index: int,
    compression: Compression | None,
    maxmsgsize: int,
    transport: str,
) -> bool:
    """Encode, place and send one request item; False when the call ended meanwhile."""
    engine = call.engine
    shm = engine.shm
    placer = io.policy.placer(transport, engine.peer, peer_receives=bool(shm and shm.to_engine))
    try:
        try:
            encoded = _codec.encode(
                wire, io.codec, placer=placer, compression=compression, off_loop=OFF_LOOP_BYTES
            )
        except _codec.OffLoop:
            # Large frames to compress (nothing placed): on a worker thread, as a CALL's
            # arguments are. Not abandoned on cancellation; the item is then not sent.
            encode = functools.partial(_codec.encode, wire, io.codec, compression=compression)
            encoded = await anyio.to_thread.run_sync(encode)
            await anyio.lowlevel.checkpoint_if_cancelled()
        _codec.check_message_size(
            encoded,
            maxmsgsize,
            engine.info.max_message_bytes,
            lambda: (f"{call.spec.qualname}: request item {index}", f"engine {engine.engine_id!r}"),
        )
    except BaseException:
        if placer is not None:
            placer.abort()
        raise
    lease = None
    if placer is not None:
        if placer.pending_bytes:
            await fill_off_loop(placer, "a request item")
        lease = placer.outcome()[0]
    if not _streams.send_item(io.protocol, call, encoded.payload, encoded.buffers, io.now(), lease):
        if placer is not None:
            placer.abort()
        return False
    await _send(io, call, io.take_sent(), encoded)
    return True


async def fill_off_loop(placer: PolicyPlacer, what: str) -> None:
    """Copy the large tensors ``placer`` placed by handle (``what``: a CALL's arguments, a
    request item) into the pool on a worker thread (the copies release the GIL: the
    loop keeps serving meanwhile); ``placer`` is released on any failure or
    cancellation.

    Raises:
        TensorTransportError: the kernel refused the copy's pages.
    """
    try:
        # Not abandoned on cancellation: the region must not be released mid-copy.
        await anyio.to_thread.run_sync(placer.fill)
    except OSError as exc:
        placer.abort()
        raise TensorTransportError(
            f"cannot copy {what} into shared memory: {exc.strerror}"
        ) from None
    except BaseException:
        placer.abort()
        raise


async def _send(io: ClientIO, call: Call, frames: list[Any], encoded: _codec.Encoded) -> None:
    sock = io.sock
    if sock is None:
        return
    track = bool(encoded.buffers)
    if encoded.buffers:
        io.policy.sent_frames(encoded.buffers)
    try:
        try:
            tracker = sock.send_nowait(frames, track=track)
        except anyio.WouldBlock:
            tracker = await sock.send(frames, track=track)
    except PeerUnreachableError:
        io.protocol.send_failed(call.engine.peer, io.now())
        io.flush()
        return
    if track:
        io.tracked.add(tracker, encoded.keepalive, _release.nbytes(encoded.buffers))
