"""A call the client gives up on keeps its torch_shm argument regions until the engine is done.

The engine builds argument tensors on the client's pool regions; a cancelled handler may
still read them after the client gave up. So the client keeps the call's lease (its
regions are not reused) until the engine's RELEASE naming it, a late reply to the call,
or the engine's end; the engine sends that RELEASE when the handler of a call that ends
without a reply is done (after giving surviving argument tensors pages of their own).

In one process and without sockets: the client's I/O shell runs over a `ProtocolPair`'s
client machine (what it sends goes onto the pair's wire), the engine's side is the
workers' code over a `ProtocolPair` engine, and the "engine" resolves the client's handles
through ``/proc/self/fd`` as the one-copy tests do.
"""

from __future__ import annotations

import os
from types import MappingProxyType, SimpleNamespace
from typing import Any, cast

import anyio
import pytest
import torch

from tensorrpc import _codec, _dispatch
from tensorrpc._client_events import Dropped, LeasesFreed
from tensorrpc._client_io import ClientIO
from tensorrpc._protocol import (
    Bye,
    MessageKind,
    Release,
    decode_control,
    encode_control,
    pack_reply_header,
    split_frames,
)
from tensorrpc._server_calls import ServerCall
from tensorrpc._server_protocol import ShmPeer
from tensorrpc._service import ServiceSpec
from tensorrpc._zmq import SocketOptions
from tensorrpc.transports._policy import TransportPolicy
from tensorrpc.transports.torch_shm import TorchShmTransport
from tests import pair_work as work
from tests.helpers import ProtocolPair

pytestmark = pytest.mark.skipif(
    not TorchShmTransport.available(), reason="torch_shm needs Linux memfd and /proc"
)

N = 1 << 16  # float32 elements: 256 KiB, over the pool's threshold


class _PairSocket:
    """What the shell sends goes onto the pair's wire."""

    def __init__(self, pair: ProtocolPair) -> None:
        self.pair = pair

    def send_nowait(self, frames: list[Any]) -> None:
        self.pair.peers[frames[0]].inbox.append(list(frames[1:]))


class _Client:
    """A client I/O shell (no socket) over a connected pair, with a torch_shm policy."""

    def __init__(self, engines: tuple[str, ...] = ("e1",), **shm: Any) -> None:
        self.pair = ProtocolPair(engines).connect()
        self.policy = TransportPolicy()
        assert self.policy.shm is not None
        if shm:
            self.policy.shm.close()
            self.policy.shm = TorchShmTransport(**shm)
        self.io = ClientIO(
            self.pair.client.config,
            self.policy,
            ServiceSpec(name="S", methods=MappingProxyType({}), fingerprint=""),
            _codec.CodecConfig(),
            bind=[],
            connect=[],
            socket_options=SocketOptions(),
            curve=None,
            observer=None,
        )
        self.io.protocol = self.pair.client  # the shell over the pair's client machine
        self.io.sock = cast("Any", _PairSocket(self.pair))

    @property
    def shm(self) -> TorchShmTransport:
        assert self.policy.shm is not None
        return self.policy.shm

    def engine(self, name: str = "e1") -> Any:
        return self.pair.client.engines.engines[name]

    def send(self, value: torch.Tensor, engine: str = "e1") -> tuple[Any, tuple[str, bytes]]:
        """Start a call whose argument ``value`` goes by pool region: (call, handle)."""
        peer = self.engine(engine).peer
        placer = self.policy.placer("torch_shm", peer, peer_receives=True)
        assert placer is not None
        placed = placer.place(value)
        assert placed is not None
        call = work.call(self.pair, "add", 1, engine=engine, lease=placer.lease)
        return call, placed

    def from_engine(self, frames: list[Any], engine: str = "e1") -> Any:
        """Hand one engine message to the client's machine and its shell."""
        client = self.pair.client
        client.receive(self.engine(engine).peer, frames, self.pair.now)
        events = list(client._events)  # what the shell's flush is about to act on
        self.io.flush()
        return events[0] if len(events) == 1 else (events or None)

    @property
    def held(self) -> int:
        """Argument leases the client's protocol keeps for calls it gave up on."""
        return len(self.pair.client.leases)

    def close(self) -> None:
        self.policy.close()


@pytest.fixture
def client():
    c = _Client()
    yield c
    c.close()


def _on_region(shm: TorchShmTransport, placed: tuple[str, bytes], keep: object) -> torch.Tensor:
    """The engine's argument tensor, built on the client's region (one copy)."""
    resolver = shm.resolver(os.getpid(), keep=keep)
    return resolver.resolve(*placed, torch.float32, (N,))


def test_a_cancelled_calls_region_is_not_reused_until_the_engine_releases_it(client):
    x = torch.full((N,), 7.0)
    call, placed = client.send(x)
    lease = call.lease
    held = _on_region(client.shm, placed, ("session", call.call_id))  # the handler's view
    client.io.abandon(call)  # the caller gives up: CANCEL goes, the handler still runs
    assert call.ended
    assert client.shm.leased(lease)
    assert client.held == 1
    # The next call's tensor must not land where the cancelled handler still reads.
    for _ in range(3):
        nxt, _placed = client.send(torch.full((N,), -1.0))
        assert torch.equal(held, x), "the cancelled handler saw the next call's tensor"
        client.io.ended(nxt)
    # The engine is done: its RELEASE names the lease, which ends now.
    event = client.from_engine(encode_control(MessageKind.RELEASE, Release((lease,))))
    assert isinstance(event, LeasesFreed)
    assert event.leases == (lease,)
    assert not client.shm.leased(lease)
    assert client.held == 0
    assert client.shm.statistics().releases_refused == 0


def test_releases_the_client_did_not_keep_for_that_engine_are_refused_and_counted():
    c = _Client(("e1", "e2"))
    try:
        cancelled, _ = c.send(torch.ones(N))
        lease = cancelled.lease
        c.io.abandon(cancelled)
        running, _ = c.send(torch.ones(N))  # in flight: its lease ends with the reply
        bogus = (
            running.lease,  # a call the engine has not answered: not its to end
            lease + 1000,  # never made
        )
        c.from_engine(encode_control(MessageKind.RELEASE, Release(bogus)))
        c.from_engine(encode_control(MessageKind.RELEASE, Release((lease,))), engine="e2")
        assert c.shm.statistics().releases_refused == 3
        assert c.shm.leased(lease)
        assert c.shm.leased(running.lease)
        c.from_engine(encode_control(MessageKind.RELEASE, Release((lease,))))
        assert not c.shm.leased(lease)
        c.from_engine(encode_control(MessageKind.RELEASE, Release((lease,))))  # twice
        assert c.shm.statistics().releases_refused == 4
    finally:
        c.close()


def test_a_late_reply_to_a_cancelled_call_ends_its_kept_lease(client):
    call, _ = client.send(torch.ones(N))
    lease = call.lease
    client.io.abandon(call)
    assert client.shm.leased(lease)
    # The engine had replied before it read the CANCEL (so it made the arguments private).
    payload = _codec.encode(3).payload
    freed, event = client.from_engine(
        [pack_reply_header(MessageKind.RESULT, call.call_id), payload]
    )
    assert isinstance(freed, LeasesFreed)
    assert isinstance(event, Dropped)
    assert event.call_id == call.call_id
    assert not client.shm.leased(lease)
    # ...and for a late ERROR or STREAM_END too.
    other, _ = client.send(torch.ones(N))
    other_lease = other.lease
    assert other_lease is not None
    client.io.abandon(other)
    end = encode_control(MessageKind.STREAM_END, None, other.call_id)
    assert isinstance(client.from_engine(end), LeasesFreed)
    assert not client.shm.leased(other_lease)
    assert client.held == 0


def test_kept_leases_end_with_the_engine_and_count_against_its_limit():
    c = _Client(peer_max_leases=2)
    try:
        first, _ = c.send(torch.ones(N))
        c.io.abandon(first)
        second, _ = c.send(torch.ones(N))
        c.io.abandon(second)
        peer = c.engine().peer
        placer = c.policy.placer("torch_shm", peer, peer_receives=True)
        assert placer is not None
        assert placer.place(torch.ones(N)) is None  # the engine's share is used up: frames
        assert c.shm.statistics().peer_limited >= 1
        c.pair.client.send_failed(peer, c.pair.now)  # the engine is gone
        c.io.flush()
        assert c.held == 0
        assert c.shm.statistics().leases_held == 0
    finally:
        c.close()


# -- the engine's side ----------------------------------------------------------------------


class _Engine:
    """The workers' code over a `ProtocolPair` engine whose session has torch_shm."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.end = client.pair["e1"]
        self.end.proto.shm_decided(self.end.session, ShmPeer(os.getpid() + 1, True, True))
        self.sent: list[list[Any]] = []

        # What the workers read of the engine shell (`tensorrpc._dispatch`).
        self.shell = SimpleNamespace(
            _proto=self.end.proto,
            _policy=TransportPolicy(torch_shm=False),
            _codec=_codec.CodecConfig(),
            _flush=self.flush,
            _now=anyio.current_time,
        )

    def flush(self) -> None:
        self.sent += [frames for _key, frames in self.end.proto.frames_to_send()]

    def take(self, value: torch.Tensor) -> tuple[Any, Any]:
        """The client sends a call carrying ``value`` by region; a worker takes it."""
        # The pair encodes without a placer: carry the handle as the real client does.
        placer = self.client.policy.placer(
            "torch_shm", self.client.engine().peer, peer_receives=True
        )
        assert placer is not None
        encoded = _codec.encode([value, 1], placer=placer)
        call = work.call(self.client.pair, "add", 1, lease=placer.lease)
        self.client.pair.deliver_to_engine("e1")
        server_call = self.end.proto.next_call()
        assert server_call is not None
        server_call.payload, server_call.buffers = encoded.payload, encoded.buffers
        return call, server_call

    def releases(self) -> list[tuple[int, ...]]:
        out = []
        for frames in self.sent:
            header, payload, _ = split_frames(frames)
            if header.kind is MessageKind.RELEASE:
                body = decode_control(header, payload)
                assert isinstance(body, Release)
                out.append(tuple(body.leases))
        return out


def worker_done(engine: _Engine, call: ServerCall) -> None:
    """A worker is done with ``call`` (on an event loop: the shell reads its clock)."""

    async def done() -> None:
        _dispatch._done(engine.shell, call)  # type: ignore[arg-type]

    anyio.run(done)


def test_the_engine_releases_the_arguments_of_a_call_that_ends_without_a_reply(client):
    engine = _Engine(client)
    call, server_call = engine.take(torch.ones(N))
    lease = call.lease
    assert lease is not None
    client.io.abandon(call)
    client.pair.flush()  # the CANCEL reaches the engine
    assert server_call.cancelled
    assert engine.releases() == []
    worker_done(engine, server_call)  # the worker is done with it
    assert engine.releases() == [(lease,)]
    assert client.shm.leased(lease)
    # Delivered to the client, it ends the kept lease.
    client.from_engine(engine.sent[-1])
    assert not client.shm.leased(lease)
    assert client.shm.statistics().releases_refused == 0


def test_the_engine_sends_no_release_for_an_answered_call_or_an_ended_session(client):
    engine = _Engine(client)
    _call, answered = engine.take(torch.ones(N))
    assert engine.end.proto.may_reply(answered)  # its reply went: the client frees on it
    answered.cancelled = True
    worker_done(engine, answered)
    _call2, orphan = engine.take(torch.ones(N))
    # The client says BYE: the session ends (the client frees its leases on its side).
    engine.end.inbox.append(encode_control(MessageKind.BYE, Bye("closed")))
    client.pair.deliver_to_engine("e1")
    assert orphan.cancelled
    worker_done(engine, orphan)
    assert engine.releases() == []
