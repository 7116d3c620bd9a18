"""The engine (``serve`` / ``Server``) driven by a hand-written protocol peer, on both backends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import ormsgpack
import pytest
import torch

from tensorrpc import _hostinfo as hostinfo
from tensorrpc._exceptions import ErrorCode, HandshakeRejectedError, PeerUnreachableError
from tensorrpc._hostinfo import host_id
from tensorrpc._protocol import (
    PROTOCOL_VERSION,
    Bye,
    Flags,
    Hello,
    MessageKind,
    Reject,
    decode_control,
    split_frames,
)
from tensorrpc._server import Server, serve
from tensorrpc._service import describe

from .server_peer import WAIT, Peer, open_peer
from .server_services import Probe

SPEC = describe(Probe)
MODES = ["ipc-dialin", "tcp-listen", "tcp-dialin", "ipc-listen"]


@contextlib.asynccontextmanager
async def engine(
    tmp_path: Path,
    mode: str = "ipc-dialin",
    *,
    probe: Probe | None = None,
    stream_window: int = 16,
    **options: Any,
) -> AsyncIterator[tuple[Server, Peer, Probe]]:
    """A running engine serving a Probe, and a peer that completed the handshake."""
    probe = probe if probe is not None else Probe()
    options.setdefault("engine_id", "e1")
    options.setdefault("grace_period", 0.5)
    transport, topology = mode.split("-")
    local = f"ipc://{tmp_path}/sock-{os.getpid()}" if transport == "ipc" else "tcp://127.0.0.1:0"
    if topology == "dialin":
        async with (
            open_peer(SPEC, bind=local) as (peer, address),
            Server(probe, connect=address, **options) as server,
        ):
            await peer.handshake(stream_window=stream_window)
            yield server, peer, probe
    else:
        async with Server(probe, bind=local, **options) as server:
            assert server.endpoint is not None
            async with open_peer(SPEC, connect=server.endpoint) as (peer, _):
                await peer.handshake(stream_window=stream_window, listen=True)
                yield server, peer, probe


async def error_of(peer: Peer, call_id: int, code: ErrorCode) -> str:
    msg = await peer.expect(MessageKind.ERROR, call_id)
    info = msg.error()
    assert info.code == code, info
    return info.message


# -- handshake ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_hello_describes_the_engine_and_calls_work(tmp_path: Path, mode: str) -> None:
    async with engine(tmp_path, mode, max_concurrency=7, heartbeat_interval=0.5) as (
        server,
        peer,
        _,
    ):
        hello = peer.hello
        assert hello is not None
        assert hello.engine_id == "e1" == server.engine_id
        assert hello.service == "Probe"
        assert hello.fingerprint == SPEC.fingerprint
        assert hello.protocol_version == PROTOCOL_VERSION
        assert hello.host_id == host_id()
        assert hello.pid == os.getpid()
        # torch_shm (and the alias of torch's shared files) is offered wherever the
        # platform has it; who may use it is decided from the kernel's credentials.
        assert hello.transports == ("frames", "torch_shm", "torch_shm_unsealed")
        assert hello.concurrency == 7
        assert hello.heartbeat_ms == 500
        assert hello.methods == tuple(SPEC.methods)
        if mode.endswith("dialin"):
            assert peer.route is not None
            assert peer.route.startswith(b"e1/")
        else:
            assert server.endpoint is not None
            assert not server.endpoint.endswith(":0")
        call_id = peer.call("add", 2, 3)
        assert await peer.result(call_id) == 5


async def test_each_incarnation_dials_in_under_a_fresh_routing_id(tmp_path: Path) -> None:
    routes = []
    async with open_peer(SPEC, bind=f"ipc://{tmp_path}/c") as (peer, address):
        for _ in range(2):
            async with Server(Probe(), connect=address, engine_id="same", grace_period=0):
                await peer.handshake()
                routes.append(peer.route)
            await peer.expect(MessageKind.BYE)
    assert routes[0] != routes[1]
    assert all(r is not None and r.startswith(b"same/") for r in routes)


async def test_reject_makes_serve_raise_with_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tensorrpc.server")
    async with open_peer(SPEC, bind=f"ipc://{tmp_path}/c") as (peer, address):

        async def refuse() -> None:
            msg = await peer.expect(MessageKind.HELLO)
            peer.route = msg.route
            peer.control(MessageKind.REJECT, Reject("fingerprint", "schema abc != def"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(refuse)
            with pytest.raises(HandshakeRejectedError) as info, anyio.fail_after(WAIT):
                await serve(Probe(), connect=address, engine_id="e9")
    assert info.value.reason == "fingerprint"
    assert info.value.engine_id == "e9"
    assert "schema abc != def" in str(info.value)
    assert any("schema abc != def" in r.getMessage() for r in caplog.records)


async def test_serve_reports_readiness_and_stops_on_cancel(tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    async with anyio.create_task_group() as tg:
        server = await tg.start(
            lambda task_status: serve(
                Probe(), bind=f"ipc://{path}", engine_id="e2", task_status=task_status
            )
        )
        assert isinstance(server, Server)
        assert server.endpoint == f"ipc://{path}"
        assert path.exists()
        async with open_peer(SPEC, connect=server.endpoint) as (peer, _):
            await peer.handshake(listen=True)
            assert await peer.result(peer.call("add", 1)) == 2
            tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await peer.expect(MessageKind.BYE)
    assert not path.exists()


# -- calls --------------------------------------------------------------------------------


async def test_async_sync_and_default_arguments(tmp_path: Path) -> None:
    async with engine(tmp_path) as (server, peer, _):
        ids = [peer.call("add", 5), peer.call("mul", 6, 7), peer.call("add", -1, 1)]
        results = {}
        for _ in ids:
            msg = await peer.expect(MessageKind.RESULT)
            results[msg.call_id] = msg.value()
        assert results == {ids[0]: 6, ids[1]: 42, ids[2]: 0}
        stats = server.statistics()
        assert stats.calls == 3
        assert stats.errors == 0
        assert stats.in_flight == 0
        (client,) = stats.clients
        assert client.client_id == "test-peer"
        assert client.state == "live"
        assert client.calls == 3
        assert client.bytes_in > 0
        assert client.bytes_out > 0


async def test_stream_items_arrive_in_order_then_end(tmp_path: Path) -> None:
    async with engine(tmp_path) as (_, peer, _):
        call_id = peer.call("count", 5, flags=Flags.STREAM)
        items = [(await peer.expect(MessageKind.STREAM_ITEM, call_id)).value() for _ in range(5)]
        assert items == [0, 1, 2, 3, 4]
        await peer.expect(MessageKind.STREAM_END, call_id)


async def test_stream_waits_for_credit_beyond_the_window(tmp_path: Path) -> None:
    async with engine(tmp_path, stream_window=2) as (_, peer, probe):
        call_id = peer.call("count", 6, "w", flags=Flags.STREAM)
        for i in range(2):
            assert (await peer.expect(MessageKind.STREAM_ITEM, call_id)).value() == i
        assert await peer.result(peer.call("add", 1)) == 2  # the engine had time to run ahead
        assert probe.produced["w"] == 2
        peer.credit(call_id, 1)
        assert (await peer.expect(MessageKind.STREAM_ITEM, call_id)).value() == 2
        assert await peer.result(peer.call("add", 1)) == 2
        assert probe.produced["w"] == 3
        peer.credit(call_id, 10)
        rest = [(await peer.expect(MessageKind.STREAM_ITEM, call_id)).value() for _ in range(3)]
        assert rest == [3, 4, 5]
        await peer.expect(MessageKind.STREAM_END, call_id)


async def test_stream_error_after_items(tmp_path: Path) -> None:
    async with engine(tmp_path) as (_, peer, _):
        call_id = peer.call("fail_stream", 2, flags=Flags.STREAM)
        for i in range(2):
            assert (await peer.expect(MessageKind.STREAM_ITEM, call_id)).value() == i
        info = (await peer.expect(MessageKind.ERROR, call_id)).error()
        assert info.code == ErrorCode.REMOTE
        assert info.type == "builtins.RuntimeError"
        assert "stream broke after 2" in info.message


async def test_slow_call_does_not_block_a_fast_one(tmp_path: Path) -> None:
    async with engine(tmp_path) as (_, peer, probe):
        slow = peer.call("block", "slow")
        with anyio.fail_after(WAIT):
            await probe.started("slow").wait()
        assert await peer.result(peer.call("add", 40, 2)) == 42
        assert probe.events["slow"] == "started"
        probe.gate("slow").set()
        assert await peer.result(slow) == "slow"


async def test_sync_handler_runs_in_a_thread(tmp_path: Path) -> None:
    probe = Probe()
    try:
        async with engine(tmp_path, probe=probe) as (_, peer, _):
            waiting = peer.call("sync_wait", "t")
            assert await peer.result(peer.call("mul", 3, 3)) == 9
            probe.thread_gate.set()
            assert await peer.result(waiting) == "t"
    finally:
        probe.thread_gate.set()


# -- cancellation and deadlines -----------------------------------------------------------


async def test_cancel_stops_an_async_handler_without_a_reply(tmp_path: Path) -> None:
    async with engine(tmp_path) as (server, peer, probe):
        call_id = peer.call("block", "c")
        with anyio.fail_after(WAIT):
            await probe.started("c").wait()
        peer.control(MessageKind.CANCEL, None, call_id)
        with anyio.fail_after(WAIT):
            await probe.done("c").wait()
        assert probe.events["c"] == "cancelled"
        assert await peer.result(peer.call("add", 1)) == 2  # no reply for the cancelled call
        assert server.statistics().in_flight == 0


async def test_cancel_closes_a_generator(tmp_path: Path) -> None:
    async with engine(tmp_path, stream_window=2) as (_, peer, probe):
        call_id = peer.call("count", 1000, "g", flags=Flags.STREAM)
        await peer.expect(MessageKind.STREAM_ITEM, call_id)
        peer.control(MessageKind.CANCEL, None, call_id)
        with anyio.fail_after(WAIT):
            await probe.done("g").wait()
        assert probe.events["g"] == "closed"
        assert probe.produced["g"] <= 2
        add = peer.call("add", 1)
        while (msg := await peer.recv()).call_id == call_id:
            assert msg.kind is MessageKind.STREAM_ITEM  # sent before the CANCEL arrived
        assert (msg.kind, msg.call_id, msg.value()) == (MessageKind.RESULT, add, 2)


async def test_call_already_late_is_refused(tmp_path: Path) -> None:
    async with engine(tmp_path, max_concurrency=1) as (_, peer, probe):
        busy = peer.call("block", "busy")
        with anyio.fail_after(WAIT):
            await probe.started("busy").wait()
        late = peer.call("block", "late", timeout_ms=1)
        assert "past its deadline" in await error_of(peer, late, ErrorCode.DEADLINE_EXCEEDED)
        probe.gate("busy").set()
        assert await peer.result(busy) == "busy"
        assert "late" not in probe.events


async def test_a_queued_call_is_refused_when_its_deadline_passes(tmp_path: Path) -> None:
    async with engine(tmp_path, max_concurrency=1) as (server, peer, probe):
        busy = peer.call("block", "busy")
        with anyio.fail_after(WAIT):
            await probe.started("busy").wait()
        late = peer.call("block", "late", timeout_ms=100)
        # Answered while the only worker is still busy (it was: when the worker freed up).
        message = await error_of(peer, late, ErrorCode.DEADLINE_EXCEEDED)
        assert "waited in the queue past its deadline" in message
        assert server.statistics().queued == 0
        probe.gate("busy").set()
        assert await peer.result(busy) == "busy"
        assert "late" not in probe.events


async def test_deadline_cancels_a_running_handler(tmp_path: Path) -> None:
    async with engine(tmp_path) as (_, peer, probe):
        call_id = peer.call("block", "d", timeout_ms=50)
        await error_of(peer, call_id, ErrorCode.DEADLINE_EXCEEDED)
        with anyio.fail_after(WAIT):
            await probe.done("d").wait()
        assert probe.events["d"] == "cancelled"


async def test_sync_handler_past_its_deadline_finishes_in_the_background(
    tmp_path: Path,
) -> None:
    probe = Probe()
    try:
        async with engine(tmp_path, probe=probe) as (_, peer, _):
            call_id = peer.call("sync_wait", "bg", timeout_ms=50)
            await error_of(peer, call_id, ErrorCode.DEADLINE_EXCEEDED)
            assert probe.events["bg"] == "started"  # the thread cannot be interrupted
            probe.thread_gate.set()
            assert await anyio.to_thread.run_sync(probe.thread_done.wait, WAIT)
            assert probe.events["bg"] == "finished"
            assert await peer.result(peer.call("add", 1)) == 2  # its result was dropped
    finally:
        probe.thread_gate.set()


# -- errors -------------------------------------------------------------------------------


async def test_errors_have_their_codes_and_the_engine_keeps_serving(tmp_path: Path) -> None:
    async with engine(tmp_path) as (server, peer, _):
        assert "nope" in await error_of(peer, peer.call("nope"), ErrorCode.METHOD_NOT_FOUND)

        peer.raw_call(100, "add", ormsgpack.packb(["x", 2]))
        refused = (await peer.expect(MessageKind.ERROR, 100)).error()
        assert (refused.code, refused.path) == (ErrorCode.INVALID_ARGUMENT, ("req", "a"))
        assert "add" in refused.message

        peer.raw_call(101, "add", b"\xc1")
        await error_of(peer, 101, ErrorCode.DECODE)

        peer.raw_call(102, "count", ormsgpack.packb([3]))  # a stream called as unary
        await error_of(peer, 102, ErrorCode.INVALID_ARGUMENT)

        msg = await peer.expect(MessageKind.ERROR, peer.call("fail", "boom"))
        info = msg.error()
        assert info.code == ErrorCode.REMOTE
        assert info.type == "builtins.ValueError"
        assert info.message == "boom"
        assert "raise ValueError(message)" in info.traceback
        assert "in fail" in info.traceback

        assert "bad result" in await error_of(peer, peer.call("bad_result"), ErrorCode.BAD_RESULT)

        dropped = server.statistics().dropped
        peer.send([b"garbage", b""])  # no usable call id: dropped
        assert await peer.result(peer.call("add", 1, 1)) == 2
        stats = server.statistics()
        assert stats.dropped == dropped + 1
        assert stats.errors == 6


async def test_overloaded_when_the_queue_is_full(tmp_path: Path) -> None:
    async with engine(tmp_path, max_concurrency=1, max_queued=1) as (server, peer, probe):
        busy = peer.call("block", "busy")
        with anyio.fail_after(WAIT):
            await probe.started("busy").wait()
        no_wait = peer.call("add", 1, flags=Flags.NO_WAIT)
        assert "busy" in await error_of(peer, no_wait, ErrorCode.OVERLOADED)
        queued = peer.call("add", 2)
        refused = peer.call("add", 3)
        assert "full" in await error_of(peer, refused, ErrorCode.OVERLOADED)
        assert server.statistics().queued == 1
        probe.gate("busy").set()
        assert await peer.result(busy) == "busy"
        assert await peer.result(queued) == 3
        assert server.statistics().overloaded == 2


# -- liveness -----------------------------------------------------------------------------


async def test_silent_client_is_forgotten_then_greeted_again(tmp_path: Path) -> None:
    async with engine(tmp_path, heartbeat_interval=0.05, dead_after=0.3) as (server, peer, probe):
        peer.call("block", "z")
        with anyio.fail_after(WAIT):
            await probe.started("z").wait()
            await probe.done("z").wait()  # the peer answers no PING meanwhile
        assert probe.events["z"] == "cancelled"
        assert server.statistics().clients[0].state == "hello"
        await peer.handshake()  # the engine greets the (restarted) client again
        assert await peer.result(peer.call("add", 1)) == 2


# -- drain --------------------------------------------------------------------------------


async def test_drain_finishes_running_calls_refuses_new_ones_and_says_bye(
    tmp_path: Path,
) -> None:
    path = tmp_path / "drain.sock"
    probe = Probe()
    async with Server(probe, bind=f"ipc://{path}", grace_period=WAIT) as server:
        assert server.endpoint is not None
        async with open_peer(SPEC, connect=server.endpoint) as (peer, _):
            await peer.handshake(listen=True)
            running = peer.call("block", "r")
            with anyio.fail_after(WAIT):
                await probe.started("r").wait()
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.aclose)
                await anyio.wait_all_tasks_blocked()
                assert "shutting down" in await error_of(
                    peer, peer.call("add", 1), ErrorCode.DRAINING
                )
                probe.gate("r").set()
                assert await peer.result(running) == "r"
                bye = (await peer.expect(MessageKind.BYE)).body()
                assert bye == Bye("shutdown")
    assert probe.events["r"] == "finished"
    assert not path.exists()


async def test_drain_cancels_calls_past_the_grace_period(tmp_path: Path) -> None:
    async with engine(tmp_path, grace_period=0.05) as (server, peer, probe):
        call_id = peer.call("block", "s")
        with anyio.fail_after(WAIT):
            await probe.started("s").wait()
        with anyio.fail_after(WAIT):
            await server.aclose()
        assert "shut down before" in await error_of(peer, call_id, ErrorCode.DRAINING)
        await peer.expect(MessageKind.BYE)
        assert probe.events["s"] == "cancelled"


# -- tensors ------------------------------------------------------------------------------


def _churn(stop: threading.Event) -> None:
    """Allocate, fill and free memory in a loop, so that freed buffers get overwritten."""
    while not stop.is_set():
        for size in (64 * 96, 96 * 64 * 3, 1 << 16):
            torch.full((size,), float("nan")).add_(1.0)


async def test_tensor_results_arrive_bit_exact_while_memory_churns(tmp_path: Path) -> None:
    stop = threading.Event()
    churners = [threading.Thread(target=_churn, args=(stop,)) for _ in range(2)]
    for thread in churners:
        thread.start()
    try:
        async with engine(tmp_path) as (server, peer, _):
            ids = {peer.call("tensors", seed, 6): seed for seed in range(24)}
            x = torch.arange(300_000, dtype=torch.float32)
            scale_id = peer.call("scale", x, 0.5)
            for _ in range(len(ids) + 1):
                msg = await peer.expect(MessageKind.RESULT)
                if msg.call_id == scale_id:
                    assert torch.equal(msg.value(), x * 0.5)
                    continue
                got = msg.value()
                gen = torch.Generator().manual_seed(ids[msg.call_id])
                for i, tensor in enumerate(got):
                    base = torch.randn(64, 96, generator=gen)
                    expected = base.t() if i % 2 else base
                    assert tensor.shape == expected.shape
                    assert torch.equal(tensor, expected)
            assert server.statistics().clients[0].bytes_out > 24 * 6 * 64 * 96 * 4
    finally:
        stop.set()
        for thread in churners:
            thread.join()


async def test_call_from_a_stranger_gets_a_protocol_error(tmp_path: Path) -> None:
    async with Server(Probe(), bind="tcp://127.0.0.1:0") as server:
        assert server.endpoint is not None
        async with open_peer(SPEC, connect=server.endpoint) as (peer, _):
            peer.route = b"engine"
            with anyio.fail_after(WAIT):
                while True:  # until the connection is up
                    with contextlib.suppress(PeerUnreachableError):
                        peer.call("add", 1, call_id=5)
                    with anyio.move_on_after(0.05):
                        msg = await peer.recv()
                        break
            assert msg.kind is MessageKind.ERROR
            assert msg.error().code == ErrorCode.PROTOCOL
            assert msg.call_id == 5


async def test_two_clients_of_a_listening_engine_get_their_own_replies(tmp_path: Path) -> None:
    async with Server(Probe(), bind="tcp://127.0.0.1:0", engine_id="shared") as server:
        assert server.endpoint is not None
        async with (
            open_peer(SPEC, connect=server.endpoint) as (first, _),
            open_peer(SPEC, connect=server.endpoint) as (second, _),
        ):
            await first.handshake(listen=True)
            await second.handshake(listen=True)
            a = [first.call("add", i, 1000) for i in range(20)]
            b = [second.call("add", i, 2000) for i in range(20)]
            assert [await first.result(c) for c in a] == [i + 1000 for i in range(20)]
            assert [await second.result(c) for c in b] == [i + 2000 for i in range(20)]
            assert len(server.statistics().clients) == 2


async def test_the_hello_request_gets_pong_and_the_same_hello(tmp_path: Path) -> None:
    """A client that forgot the engine asks for HELLO with nonce 0: PONG 0 and the same
    HELLO (that PINGs alone keep a session is tested with a fake clock: test_pair.py)."""
    async with engine(tmp_path, "tcp-listen", heartbeat_interval=0.05, dead_after=5.0) as (
        server,
        peer,
        _,
    ):
        first = peer.hello
        assert first is not None
        assert first.epoch != 0
        assert first.dead_after_ms == 5000
        kinds: set[str] = set()
        with anyio.fail_after(WAIT):
            while len(kinds) < 2:
                # As a client does, the request is repeated each heartbeat interval: the
                # engine sends at most one HELLO per interval (the handshake's was one).
                peer.control(MessageKind.PING, None, 0)
                with anyio.move_on_after(0.1):
                    while len(kinds) < 2:
                        frames = await peer.sock.recv()
                        header, payload, _ = split_frames([f.buffer for f in frames[1:]])
                        if header.kind is MessageKind.PONG:
                            assert header.call_id == 0
                            kinds.add("pong")
                        elif header.kind is MessageKind.HELLO:
                            hello = decode_control(header, payload)
                            assert isinstance(hello, Hello)
                            assert hello.epoch == first.epoch  # the same session
                            kinds.add("hello")
        assert server.statistics().clients[0].state == "live"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_task_cancel_drains_serve(tmp_path: Path, anyio_backend: str) -> None:
    probe = Probe()
    async with open_peer(SPEC, bind=f"ipc://{tmp_path}/c") as (peer, address):
        task = asyncio.create_task(serve(probe, connect=address, engine_id="e3", grace_period=WAIT))
        try:
            await peer.handshake()
            running = peer.call("block", "t")
            with anyio.fail_after(WAIT):
                await probe.started("t").wait()
            task.cancel()
            assert "shutting down" in await error_of(peer, peer.call("add", 1), ErrorCode.DRAINING)
            probe.gate("t").set()
            assert await peer.result(running) == "t"
            await peer.expect(MessageKind.BYE)
            with anyio.fail_after(WAIT), pytest.raises(asyncio.CancelledError):
                await task
        finally:
            task.cancel()


def test_host_id_is_the_same_in_another_process() -> None:
    # _hostinfo uses the standard library only: load it alone (importing the package
    # would import torch, seconds on a loaded machine, for nothing this test checks).
    path = Path(hostinfo.__file__ or "")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('hostinfo', {str(path)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print(module.host_id())\n"
    )
    other = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=WAIT, check=True
    )
    assert other.stdout.strip() == host_id()
    assert host_id().startswith(socket.gethostname()[:200] + "/")


# -- issue 10: sessions, answers to every readable call id, credit, BYE (over sockets) -------


async def test_a_reused_call_id_cancels_the_original_and_gets_one_protocol_error(
    tmp_path: Path,
) -> None:
    async with engine(tmp_path) as (server, peer, probe):
        peer.call("block", "dup", call_id=500)
        with anyio.fail_after(WAIT):
            await probe.started("dup").wait()
        peer.call("block", "dup2", call_id=500)
        info = (await peer.expect(MessageKind.ERROR, 500)).error()
        assert info.code == ErrorCode.PROTOCOL
        assert "already in flight" in info.message
        with anyio.fail_after(WAIT):
            await probe.done("dup").wait()
        assert probe.events["dup"] == "cancelled"
        assert "dup2" not in probe.events
        # nothing more for id 500: the next message is the answer to the next call
        assert await peer.result(peer.call("add", 1)) == 2
        assert server.statistics().in_flight == 0


@pytest.mark.parametrize(
    ("frame", "fault"),
    [
        (struct.pack("<2sBBHHQI", b"TR", 1, 4, 0x200, 0, 77, 0) + b"add", "unknown flag bits"),
        (struct.pack("<2sBBHHQI", b"TR", 1, 4, 0, 1, 77, 0) + b"add", "reserved"),
        (struct.pack("<2sBBHHQI", b"TR", 1, 4, 0, 0, 77, 0), "method name"),
        (struct.pack("<2sBBHHQI", b"TR", 9, 4, 0, 0, 77, 0) + b"add", "version 9"),
    ],
)
async def test_a_bad_call_header_with_a_readable_call_id_is_answered(
    tmp_path: Path, frame: bytes, fault: str
) -> None:
    async with engine(tmp_path) as (_, peer, _):
        peer.send([frame, b"\x91\x01"])
        info = (await peer.expect(MessageKind.ERROR, 77)).error()
        assert info.code == ErrorCode.PROTOCOL
        assert fault in info.message


async def test_a_malformed_welcome_gets_a_reject_with_the_reason(tmp_path: Path) -> None:
    async with (
        open_peer(SPEC, bind=f"ipc://{tmp_path}/c") as (peer, address),
        Server(Probe(), connect=address, engine_id="e1"),
    ):
        msg = await peer.expect(MessageKind.HELLO)
        peer.route = msg.route
        header = struct.pack("<2sBBHHQI", b"TR", 1, int(MessageKind.WELCOME), 0, 0, 0, 0)
        peer.send([header, b"\x81\xa9client_id\x07"])
        reject = (await peer.expect(MessageKind.REJECT)).body()
        assert isinstance(reject, Reject)
        assert reject.reason == "protocol"
        assert "client_id" in reject.message


async def test_stream_window_zero_sends_nothing_before_the_first_credit(tmp_path: Path) -> None:
    async with engine(tmp_path, stream_window=0) as (_, peer, probe):
        call_id = peer.call("count", 4, "w0", flags=Flags.STREAM)
        assert await peer.result(peer.call("add", 1)) == 2  # the engine had time to run
        assert probe.produced.get("w0", 0) == 0
        peer.credit(call_id, 2)
        items = [(await peer.expect(MessageKind.STREAM_ITEM, call_id)).value() for _ in range(2)]
        assert items == [0, 1]
        assert await peer.result(peer.call("add", 1)) == 2
        assert probe.produced["w0"] == 2


async def test_after_a_clients_bye_hello_waits_until_it_speaks_again(tmp_path: Path) -> None:
    # dead_after is long: a parted client is greeted again after it (a starved test loop
    # would otherwise see that HELLO inside its 0.4 s window).
    async with engine(tmp_path, heartbeat_interval=0.05, dead_after=30.0) as (server, peer, _):
        first = peer.hello
        assert first is not None
        peer.control(MessageKind.BYE, Bye("closed"))
        with anyio.move_on_after(0.4):  # 8 heartbeats: no HELLO (and nothing else) comes
            msg = await peer.recv(hello=True)
            raise AssertionError(f"unexpected {msg.kind!r} after BYE")
        assert server.statistics().clients[0].state == "parted"
        peer.control(MessageKind.PING, None, 1)
        hello = (await peer.expect(MessageKind.HELLO)).body()
        assert isinstance(hello, Hello)
        assert hello.epoch not in (0, first.epoch)


async def test_a_stalled_client_gets_a_new_epoch_when_it_speaks_again(tmp_path: Path) -> None:
    async with engine(tmp_path, "ipc-listen", heartbeat_interval=0.05, dead_after=0.3) as (
        server,
        peer,
        probe,
    ):
        first = peer.hello
        assert first is not None
        peer.call("block", "stall")
        with anyio.fail_after(WAIT):
            await probe.started("stall").wait()
            await probe.done("stall").wait()  # the peer stalls: its session ends
        assert probe.events["stall"] == "cancelled"
        # no session; a HELLO of a new one went out at once (§9)
        assert [c.state for c in server.statistics().clients] == ["hello"]
        hello = (await peer.expect(MessageKind.HELLO)).body()
        assert isinstance(hello, Hello)
        assert hello.epoch not in (0, first.epoch)


async def test_streams_waiting_for_credit_do_not_hold_workers(tmp_path: Path) -> None:
    async with engine(tmp_path, stream_window=1, max_concurrency=2) as (server, peer, _):
        streams = [peer.call("count", 5, f"s{i}", flags=Flags.STREAM) for i in range(6)]
        for call_id in streams:
            assert (await peer.expect(MessageKind.STREAM_ITEM, call_id)).value() == 0
        # six streams wait for credit on a two-worker engine; unary calls still run
        assert [await peer.result(peer.call("add", i)) for i in range(3)] == [1, 2, 3]
        assert server.statistics().in_flight == 6
        for call_id in streams:
            peer.control(MessageKind.CANCEL, None, call_id)


async def test_idle_streams_are_capped_per_client_with_a_clear_error(tmp_path: Path) -> None:
    async with engine(tmp_path, stream_window=0, max_parked_streams=1) as (_, peer, _):
        first = peer.call("count", 3, flags=Flags.STREAM)
        assert await peer.result(peer.call("add", 1)) == 2  # the first stream is parked
        second = peer.call("count", 3, flags=Flags.STREAM)
        info = (await peer.expect(MessageKind.ERROR, second)).error()
        assert info.code == ErrorCode.OVERLOADED
        assert "waiting for credit" in info.message
        peer.credit(first, 3)
        items = [(await peer.expect(MessageKind.STREAM_ITEM, first)).value() for _ in range(3)]
        assert items == [0, 1, 2]
