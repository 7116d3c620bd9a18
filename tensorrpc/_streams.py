"""Request streams (client streaming and bidirectional calls), sans-I/O.

A CALL with the ``REQUEST_STREAM`` flag opens a stream of request items from the client
to the engine: STREAM_ITEMs the client sends after the CALL, ended by its STREAM_END (the
half-close), under credit the engine grants with CREDIT; the response is a RESULT
(client streaming) or a stream of its own (bidirectional, ``STREAM`` set too, under the
client's credit as for server streaming). This module holds the per-stream state of both
sides and the rules the machines apply to it; `ServerProtocol` and `ClientProtocol`
delegate the new rows of their tables here (docs/protocol.md §10). Nothing here performs
I/O or imports zmq, anyio, asyncio, trio or ``time``.

Rules (numbered as the tests cite them):

1. The client may send ``window + sum(CREDIT n)`` request items, ``window`` being the
   engine's HELLO ``stream_window``. The engine grants credit as its handler takes items
   (in batches of half the window, at least 1), never after the half-close.
2. A request item beyond the credit, a request item or STREAM_END after the
   half-close, and a request item or STREAM_END for a call without ``REQUEST_STREAM``
   are malformed (§11): ERROR(id, PROTOCOL), and the call ends (cancelled).
3. A request item or STREAM_END for a call id not in flight is dropped and counted:
   the engine may have answered the call while the client was still sending.
4. The client sends nothing for a call after it ended (its final reply came, or it gave
   up): request items and the half-close stop, except the one CANCEL.
5. The engine's buffer of request items the handler has not taken is bounded by the
   window: a slow handler stalls only its own stream's client.
6. ``torch_shm`` request items: an item's tensors may go by handle under leases of the
   client's pool, like a unary CALL's arguments. Every item lease of a call ends with
   the call: its final reply (RESULT, STREAM_END, ERROR; the engine detaches item
   tensors its handler kept before building it), or, for a call the client gave up
   on, the engine's RELEASE naming them (sent when the cancelled call ends, for the
   items it decoded and those it never took), a late reply, or the engine's end.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from tensorrpc._exceptions import RemoteProtocolError
from tensorrpc._protocol import (
    Credit,
    MessageKind,
    decode_control,
    encode_control,
    pack_reply_header,
)

if TYPE_CHECKING:
    from collections.abc import Hashable, Sequence

    from typing_extensions import Buffer

    from tensorrpc._calls import Call
    from tensorrpc._client_protocol import ClientProtocol
    from tensorrpc._engines import Engine
    from tensorrpc._protocol import Header
    from tensorrpc._server_calls import ServerCall, Settable
    from tensorrpc._server_protocol import ServerProtocol, Session

__all__ = [
    "CreditGranted",
    "RequestCredit",
    "RequestStream",
    "half_close",
    "send_item",
    "on_engine_credit",
    "on_half_close",
    "on_request_item",
    "take_item",
]

_STREAM_ITEM: Final = MessageKind.STREAM_ITEM
_STREAM_END: Final = MessageKind.STREAM_END
_CREDIT: Final = MessageKind.CREDIT
_U32: Final = 0xFFFF_FFFF


class RequestStream:
    """The engine's side of one request stream: items received and not yet taken.

    Args:
        window: The engine's HELLO ``stream_window``: the client's initial credit.
    """

    __slots__ = (
        "_batch",
        "_pending",
        "credit",
        "half_closed",
        "items",
        "keep",
        "leases",
        "refused",
        "taken",
        "waiter",
    )

    def __init__(self, window: int) -> None:
        #: Items the client may still send (window + granted - received; rule 1).
        self.credit = window
        self._batch = max(1, window // 2)
        self._pending = 0
        #: Items received and not taken by the handler (at most the window: rule 5).
        self.items: collections.deque[tuple[Buffer, Sequence[Buffer]]] = collections.deque()
        #: The client's STREAM_END came.
        self.half_closed = False
        #: Items the handler took.
        self.taken = 0
        #: Shell: what the handler waiting for an item waits on (set by `ServerCall.wake`).
        self.waiter: Settable | None = None
        #: Shell: why an item was refused, ``(ErrorCode, message, path)``: the call's reply.
        self.refused: tuple[Any, str, tuple[str | int, ...]] | None = None
        #: torch_shm: the key item tensors on the client's regions are kept under (the
        #: shell detaches it before the call's final reply; rule 6); None: none resolved.
        self.keep: Hashable | None = None
        #: torch_shm: the client's leases of the items decoded so far (rule 6).
        self.leases: list[int] = []

    def resolved(self, keep: Hashable, leases: Sequence[int]) -> None:
        """An item resolved handles under ``leases``; its tensors are kept under ``keep``."""
        self.keep = keep
        self.leases.extend(leases)

    def end_leases(self) -> list[int]:
        """The call ends: the item leases it holds (the shell detached ``keep``)."""
        leases, self.leases = self.leases, []
        self.keep = None
        return leases

    def push(self, payload: Buffer, buffers: Sequence[Buffer]) -> str | None:
        """One request item arrived; the reason it is malformed (rule 2), or None."""
        if self.half_closed:
            return "a request STREAM_ITEM after the request stream's STREAM_END"
        if self.credit <= 0:
            return "more request items than the engine's stream_window and CREDIT allow"
        self.credit -= 1
        self.items.append((payload, buffers))
        return None

    def end(self) -> str | None:
        """The half-close arrived; the reason it is malformed (rule 2), or None."""
        if self.half_closed:
            return "a second STREAM_END for the request stream"
        self.half_closed = True
        return None

    def take(self) -> tuple[tuple[Buffer, Sequence[Buffer]] | None, int]:
        """The next item for the handler (None: none buffered), and the credit to grant."""
        if not self.items:
            return None, 0
        item = self.items.popleft()
        self.taken += 1
        if self.half_closed:
            return item, 0
        self._pending += 1
        if self._pending < self._batch:
            return item, 0
        grant, self._pending = self._pending, 0
        self.credit += grant
        return item, grant

    def drop(self) -> list[Sequence[Buffer]]:
        """The handler ended: forget the items it did not take; their buffers, for the
        shell to release (a large one off the event loop)."""
        left = [buffers for _, buffers in self.items if buffers]
        self.items.clear()
        return left

    @property
    def done(self) -> bool:
        """The client half-closed and the handler took every item."""
        return self.half_closed and not self.items


# -- the engine's rows -------------------------------------------------------------------


def _stream_of(
    proto: ServerProtocol, session: Session, header: Header
) -> tuple[ServerCall, RequestStream] | None:
    """The call and request stream a client's STREAM_ITEM or STREAM_END is about; None
    (dropped, counted, or answered by §11's rule) when there is none."""
    call = session.calls.get(header.call_id)
    if call is None or call.cancelled:
        proto.dropped += 1  # rule 3: the call ended while the client was sending
        return None
    stream = call.request
    if stream is None:
        exc = RemoteProtocolError(
            f"{header.kind.name} for call {header.call_id}, whose request is not a stream"
        )
        proto._malformed(session.key, session, header.call_id, exc)
        return None
    return call, stream


def on_request_item(
    proto: ServerProtocol,
    session: Session,
    header: Header,
    payload: Buffer,
    buffers: Sequence[Buffer],
) -> None:
    """A live client's STREAM_ITEM: one request item (rules 1-3)."""
    found = _stream_of(proto, session, header)
    if found is None:
        return
    call, stream = found
    fault = stream.push(payload, buffers)
    if fault is not None:
        proto._malformed(session.key, session, header.call_id, RemoteProtocolError(fault))
    elif stream.waiter is not None:
        proto._wake(call)  # wake the handler waiting for an item


def on_half_close(
    proto: ServerProtocol,
    key: Hashable,
    session: Session,
    header: Header,
    payload: Buffer,
    now: float,
) -> None:
    """A live client's STREAM_END: the request stream ends (rule 2)."""
    found = _stream_of(proto, session, header)
    if found is None:
        return
    call, stream = found
    fault = stream.end()
    if fault is not None:
        proto._malformed(key, session, header.call_id, RemoteProtocolError(fault))
    elif stream.waiter is not None:
        proto._wake(call)


def take_item(proto: ServerProtocol, call: ServerCall) -> tuple[Buffer, Sequence[Buffer]] | None:
    """The handler takes the next request item (None: none buffered); the credit it
    earns the client goes out as CREDIT (rule 1)."""
    stream = call.request
    assert stream is not None
    item, grant = stream.take()
    if grant and not call.cancelled and not call.answered:
        proto._send(call.key, encode_control(_CREDIT, Credit(grant), call.call_id))
    return item


# -- the client's side -------------------------------------------------------------------


class RequestCredit:
    """The client's side of one request stream: how many items it may still send.

    Args:
        window: The engine's HELLO ``stream_window``.
    """

    __slots__ = ("closed", "credit", "leases", "scope", "sent", "waiter")

    def __init__(self, window: int) -> None:
        #: Items the engine still accepts before its next CREDIT.
        self.credit = window
        #: Items sent.
        self.sent = 0
        #: The half-close went.
        self.closed = False
        #: Shell: what the sender waiting for credit waits on.
        self.waiter: Any = None
        #: Shell: the sender's cancel scope (cancelled when the call ends).
        self.scope: Any = None
        #: The torch_shm leases of the items sent: they end with the call (rule 6).
        self.leases: list[int] = []


@dataclass(frozen=True, slots=True)
class CreditGranted:
    """The engine granted credit to a request stream: wake its sender."""

    call: Call


def on_engine_credit(
    proto: ClientProtocol,
    peer: bytes,
    engine: Engine | None,
    header: Header,
    payload: Buffer,
    *rest: Any,
) -> CreditGranted | None:
    """A live engine's CREDIT for a request stream; anything else is dropped."""
    try:
        body = decode_control(header, payload)
    except RemoteProtocolError:
        return None
    assert isinstance(body, Credit)
    call = proto.calls.get(header.call_id)
    if call is None or call.engine is not engine or call.request is None:
        return None  # ended meanwhile, or not a request stream
    request = call.request
    request.credit = min(request.credit + body.n, _U32)
    return CreditGranted(call)


def send_item(
    proto: ClientProtocol,
    call: Call,
    payload: Buffer,
    buffers: Sequence[Buffer],
    now: float,
    lease: int | None = None,
) -> bool:
    """Queue the STREAM_ITEM of the next request item, counted against the credit;
    False when it may not go (no credit, ended: rule 4). ``lease``: the item's
    torch_shm lease, held until the call ends (rule 6)."""
    request = call.request
    assert request is not None
    if call.ended or request.closed or request.credit <= 0:
        return False
    request.credit -= 1
    request.sent += 1
    if lease is not None:
        request.leases.append(lease)
    engine = call.engine
    header = pack_reply_header(_STREAM_ITEM, call.call_id)
    engine.sent = now
    proto._send_data(engine, header, payload, buffers)
    return True


def half_close(proto: ClientProtocol, call: Call, now: float) -> bool:
    """Queue the STREAM_END that ends the request stream; False when the call ended."""
    request = call.request
    assert request is not None
    if call.ended or request.closed:
        return False
    request.closed = True
    engine = call.engine
    proto._queue(engine, engine.peer, _STREAM_END, None, call.call_id, now)
    return True
