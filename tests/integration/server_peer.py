"""A minimal hand-written client for engine tests: one ROUTER speaking the protocol.

It uses only ``_protocol``, ``_codec`` and ``_zmq`` (never ``_client``), so that the engine
is tested against the wire format itself. Dial-in mode: the peer binds and the engine's
DEALER connects; listen mode: the peer connects to the engine's ROUTER under the alias
``b"engine"`` and asks for HELLO with a PING.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import anyio
import zmq
from typing_extensions import Buffer

from tensorrpc import _codec
from tensorrpc._protocol import (
    Credit,
    ErrorInfo,
    Header,
    Hello,
    MessageKind,
    Welcome,
    decode_control,
    encode_control,
    pack_call_header,
    split_frames,
)
from tensorrpc._service import ServiceSpec
from tensorrpc._zmq import AsyncSocket, create_socket

#: Every wait in these tests is bounded by this many seconds.
WAIT = 10.0
ENGINE_ALIAS = b"engine"


@dataclass
class Msg:
    """One message received by the peer."""

    route: bytes
    header: Header
    payload: Any
    buffers: Sequence[Any]

    @property
    def kind(self) -> MessageKind:
        return self.header.kind

    @property
    def call_id(self) -> int:
        return self.header.call_id

    def body(self) -> Any:
        return decode_control(self.header, self.payload)

    def value(self) -> Any:
        return _codec.decode(self.payload, self.buffers)

    def error(self) -> ErrorInfo:
        body = self.body()
        assert isinstance(body, ErrorInfo), body
        return body


class Peer:
    """A scripted client; ``route`` is the engine's routing id once known."""

    def __init__(self, sock: AsyncSocket, spec: ServiceSpec) -> None:
        self.sock = sock
        self.spec = spec
        self.route: bytes | None = None
        self.next_id = 1
        self.hello: Hello | None = None
        self.pings = 0

    # -- sending -------------------------------------------------------------------------

    def send(self, frames: Sequence[Buffer]) -> None:
        assert self.route is not None
        self.sock.send_nowait([self.route, *frames])

    def control(self, kind: MessageKind, body: Any = None, call_id: int = 0) -> None:
        self.send(encode_control(kind, body, call_id))

    def call(
        self,
        method: str,
        *args: Any,
        flags: int = 0,
        timeout_ms: int = 0,
        call_id: int | None = None,
    ) -> int:
        """Send a CALL with arguments checked by the method's spec; return its call id."""
        if call_id is None:
            call_id = self.next_id
            self.next_id += 1
        spec = self.spec.methods.get(method)
        wire = list(args) if spec is None else spec.encode_args(args, {})
        encoded = _codec.encode(wire)
        self.send(
            [
                pack_call_header(call_id, method, flags, timeout_ms),
                encoded.payload,
                *encoded.buffers,
            ]
        )
        return call_id

    def raw_call(self, call_id: int, method: str, payload: bytes, flags: int = 0) -> None:
        """Send a CALL whose payload the test writes by hand."""
        self.send([pack_call_header(call_id, method, flags), payload])

    # -- receiving -----------------------------------------------------------------------

    async def recv(self, *, hello: bool = False) -> Msg:
        """The next message that is not a heartbeat (PINGs are answered), bounded by WAIT.

        After the handshake, repeated HELLOs (the engine re-sends until WELCOME arrives)
        are skipped unless ``hello`` is true.
        """
        with anyio.fail_after(WAIT):
            while True:
                frames = await self.sock.recv()
                route = frames[0].bytes
                header, payload, buffers = split_frames(cast("list[Buffer]", frames[1:]))
                if header.kind is MessageKind.PING:
                    self.pings += 1
                    if self.route is not None:
                        self.control(MessageKind.PONG, None, header.call_id)
                    continue
                if header.kind is MessageKind.PONG:
                    continue
                if header.kind is MessageKind.HELLO and self.hello is not None and not hello:
                    continue
                return Msg(route, header, payload, buffers)

    async def expect(self, kind: MessageKind, call_id: int | None = None) -> Msg:
        msg = await self.recv(hello=kind is MessageKind.HELLO)
        assert msg.kind is kind, (msg.kind, msg.payload and bytes(msg.payload)[:200])
        if call_id is not None:
            assert msg.call_id == call_id
        return msg

    async def handshake(
        self,
        *,
        stream_window: int = 16,
        listen: bool = False,
        nudge: Callable[[], None] | None = None,
    ) -> Hello:
        """Wait for HELLO (asking for it in listen mode) and answer WELCOME.

        ``nudge`` (dial-in) runs after each 50 ms without the HELLO: a test whose engine
        runs on a clock that stands still moves it there, or the engine's re-send of a
        HELLO that went out before the connection was up would never come due.
        """
        if listen:
            self.route = ENGINE_ALIAS
            self._ask_hello()  # the connection may not be up yet: ask until HELLO comes
            msg = await self._hello_polling(self._ask_hello)
        else:
            msg = await (self.recv(hello=True) if nudge is None else self._hello_polling(nudge))
            self.route = msg.route
        assert msg.kind is MessageKind.HELLO, msg.kind
        hello = msg.body()
        assert isinstance(hello, Hello)
        self.hello = hello
        self.control(
            MessageKind.WELCOME,
            Welcome(
                client_id="test-peer",
                host_id="elsewhere",
                transports=("frames",),
                heartbeat_ms=1000,
                stream_window=stream_window,
            ),
        )
        return hello

    def _ask_hello(self) -> None:
        with contextlib.suppress(Exception):
            self.control(MessageKind.PING, None, 0)

    async def _hello_polling(self, poke: Callable[[], None]) -> Msg:
        """The next HELLO (bounded by WAIT), calling ``poke`` after each 50 ms without."""
        with anyio.fail_after(WAIT):
            while True:
                with anyio.move_on_after(0.05):
                    return await self.recv(hello=True)
                poke()

    async def result(self, call_id: int) -> Any:
        msg = await self.recv()
        assert msg.call_id == call_id, (msg.kind, msg.call_id, call_id)
        if msg.kind is MessageKind.ERROR:
            raise AssertionError(f"call failed: {msg.error()}")
        assert msg.kind is MessageKind.RESULT
        return msg.value()

    def credit(self, call_id: int, n: int) -> None:
        self.control(MessageKind.CREDIT, Credit(n), call_id)


@contextlib.asynccontextmanager
async def open_peer(
    spec: ServiceSpec, *, bind: str | None = None, connect: str | None = None
) -> AsyncIterator[tuple[Peer, str]]:
    """A peer ROUTER bound at ``bind`` or connected to ``connect``; yields it and its address."""
    sock = create_socket(zmq.ROUTER)
    try:
        if bind is not None:
            address = sock.bind(bind)
        else:
            assert connect is not None
            sock.connect(connect, peer_id=ENGINE_ALIAS)
            address = connect
        yield Peer(sock, spec), address
    finally:
        await sock.aclose()
