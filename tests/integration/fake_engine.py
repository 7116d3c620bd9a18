"""A scripted engine for client tests: a DEALER speaking the protocol one message at a time.

Unlike the real server, it does only what the test tells it to, so a test can check
exactly what the client sends (CANCEL, CREDIT, timeouts in headers) and feed it replies
the real server would never send (late, duplicated, from the wrong engine).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Any

import anyio
import zmq

from tensorrpc import _codec
from tensorrpc._protocol import (
    PROTOCOL_VERSION,
    Bye,
    ErrorInfo,
    Header,
    Hello,
    MessageKind,
    decode_control,
    encode_control,
    encode_error,
    pack_reply_header,
    split_frames,
)
from tensorrpc._service import describe
from tensorrpc._zmq import AsyncSocket, create_socket

from .services import Calculator


@dataclass
class Message:
    """One message received by the fake engine."""

    header: Header
    payload: bytes
    buffers: list[Any]

    @property
    def kind(self) -> MessageKind:
        return self.header.kind

    @property
    def call_id(self) -> int:
        return self.header.call_id

    def body(self) -> Any:
        return decode_control(self.header, self.payload)


class FakeEngine:
    """An engine driven step by step by a test.

    By default a DEALER that dials the client; with ``listen=True`` a ROUTER bound at
    ``address`` that the client dials (it learns the client's routing id from its PING).
    """

    def __init__(
        self,
        address: str,
        engine_id: str,
        *,
        service: type = Calculator,
        listen: bool = False,
        **hello: Any,
    ) -> None:
        self.address = address
        self.listen = listen
        self.peer: bytes | None = None
        self.engine_id = engine_id
        self.spec = describe(service)
        self.hello_fields: dict[str, Any] = {
            "engine_id": engine_id,
            "service": self.spec.name,
            "fingerprint": self.spec.fingerprint,
            "protocol_version": PROTOCOL_VERSION,
            "host_id": "fake-host",
            "pid": os.getpid(),
            "transports": ("frames",),
            "concurrency": 8,
            "heartbeat_ms": 100,
            "methods": tuple(self.spec.methods),
            "streaming": tuple(n for n, m in self.spec.methods.items() if m.streaming),
            "signatures": tuple(m.signature for m in self.spec.methods.values()),
            "epoch": secrets.randbits(63) + 1,
        }
        self.hello_fields.update(hello)
        self.answer_pings = True
        self.seen_pings = 0
        self.sock: AsyncSocket | None = None

    async def __aenter__(self) -> FakeEngine:
        if self.listen:
            self.sock = create_socket(zmq.ROUTER)
            self.sock.bind(self.address)
            return self
        routing_id = f"{self.engine_id}/{secrets.token_hex(4)}".encode()
        self.sock = create_socket(zmq.DEALER, routing_id=routing_id)
        self.sock.connect(self.address)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.sock is not None
        await self.sock.aclose()

    async def send(self, frames: list[Any]) -> None:
        assert self.sock is not None
        if self.listen:
            assert self.peer is not None, "the client has not sent anything yet"
            frames = [self.peer, *frames]
        await self.sock.send(frames)

    def hello_frames(self) -> list[bytes]:
        return encode_control(MessageKind.HELLO, Hello(**self.hello_fields))

    async def send_hello(self) -> None:
        await self.send(self.hello_frames())

    async def next(self, *kinds: MessageKind, wait: float = 5.0) -> Message:
        """The next message of one of ``kinds`` (PING/PONG are answered and skipped)."""
        assert self.sock is not None
        with anyio.fail_after(wait):
            while True:
                frames = await self.sock.recv()
                if self.listen:
                    self.peer = frames[0].bytes
                    frames = frames[1:]
                header, payload, buffers = split_frames([f.buffer for f in frames])
                if header.kind is MessageKind.PING:
                    self.seen_pings += 1
                    if self.answer_pings:
                        await self.send(encode_control(MessageKind.PONG, None, header.call_id))
                    if MessageKind.PING not in kinds:
                        continue
                if header.kind is MessageKind.PONG and MessageKind.PONG not in kinds:
                    continue
                msg = Message(header, bytes(payload), list(buffers))
                if kinds and header.kind not in kinds:
                    raise AssertionError(f"expected {kinds}, got {header.kind!r}")
                return msg

    async def join(self) -> Any:
        """Send HELLO and return the client's answer body (Welcome or Reject).

        A listening engine first waits for the client's PING (and answers it with HELLO).
        """
        if self.listen and self.peer is None:
            await self.next(MessageKind.PING)
        await self.send_hello()
        msg = await self.next(MessageKind.WELCOME, MessageKind.REJECT)
        return msg.body()

    def args(self, msg: Message) -> list[Any]:
        method = self.spec.methods[msg.header.method]
        return method.decode_args(_codec.decode(msg.payload, msg.buffers))

    async def reply(self, call_id: int, value: Any, kind: MessageKind = MessageKind.RESULT) -> None:
        encoded = _codec.encode(value)
        await self.send([pack_reply_header(kind, call_id), encoded.payload, *encoded.buffers])

    async def end(self, call_id: int) -> None:
        await self.send(encode_control(MessageKind.STREAM_END, None, call_id))

    async def error(self, call_id: int, code: int, message: str, type_: str = "") -> None:
        await self.send(encode_error(call_id, ErrorInfo(code, type_, message, "")))

    async def bye(self) -> None:
        await self.send(encode_control(MessageKind.BYE, Bye("shutdown")))
