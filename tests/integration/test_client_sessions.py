"""Sessions, liveness and capacity of the client over real sockets (issue 9 and 10 fixes).

Each behaviour here also has a protocol-level test in tests/unit/test_client_protocol.py;
these check that the I/O shell acts on what the protocol decides.
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
import zmq

from tensorrpc._client import Client
from tensorrpc._engines import MAX_REJECTED, MAX_REJECTED_KEY, MAX_REJECTED_TEXT
from tensorrpc._exceptions import EngineDeadError, EnginesUnavailableError
from tensorrpc._hostinfo import host_id
from tensorrpc._protocol import MessageKind, Reject, Welcome
from tensorrpc._zmq import create_socket

from .fake_engine import FakeEngine
from .services import Calculator

CALL = MessageKind.CALL


def make_client(tmp_path: Path, **kw: object) -> Client[Calculator]:
    # The fake engine answers PINGs only while a test reads from it: a dead_after short
    # enough to pass while a loaded machine pauses the test would make tests flaky.
    options: dict[str, object] = {"heartbeat_interval": 0.05, "dead_after": 10.0}
    options.update(kw)
    return Client(Calculator, bind=f"ipc://{tmp_path}/client.sock", **options)  # type: ignore[arg-type]


async def test_welcome_names_our_session_and_bound(tmp_path: Path) -> None:
    async with (
        make_client(tmp_path) as client,
        FakeEngine(client.addresses[0], "e1", epoch=5) as engine,
    ):
        welcome = await engine.join()
        assert isinstance(welcome, Welcome)
        assert welcome.epoch != 0
        assert welcome.dead_after_ms == 10_000
        assert welcome.fingerprint == client.service.fingerprint


async def test_client_pings_often_enough_for_the_engines_bound(tmp_path: Path) -> None:
    # Our own heartbeat is 30 s; the engine forgets us after 0.9 s of silence, so we
    # must ping it about every 0.3 s (three per bound; a loaded machine may delay one
    # by most of a bound without the client giving the session up). The cadence itself
    # is tested with a fake clock in tests/unit/test_pair.py.
    async with (
        make_client(tmp_path, heartbeat_interval=30.0, dead_after=60.0) as client,
        FakeEngine(client.addresses[0], "e1", dead_after_ms=900) as engine,
    ):
        await engine.join()
        with anyio.fail_after(10):
            for _ in range(3):
                await engine.next(MessageKind.PING)
        assert "e1" in client.engines


async def test_new_epoch_fails_calls_at_once(tmp_path: Path) -> None:
    async with (
        make_client(tmp_path, dead_after=30.0) as client,
        FakeEngine(client.addresses[0], "e1", epoch=1) as engine,
    ):
        await engine.join()
        outcome: list[BaseException] = []

        async def call() -> None:
            try:
                await client.stub().sleep(60.0)  # no timeout: only the new epoch ends it
            except EngineDeadError as exc:
                outcome.append(exc)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await engine.next(CALL)
                engine.hello_fields["epoch"] = 2  # the engine lost the session (and the call)
                assert isinstance(await engine.join(), Welcome)
        assert "new session" in str(outcome[0])
        assert "e1" in client.engines


async def test_repeated_hello_of_the_session_keeps_calls(tmp_path: Path) -> None:
    async with (
        make_client(tmp_path) as client,
        FakeEngine(client.addresses[0], "e1", epoch=1) as engine,
    ):
        first = await engine.join()
        async with anyio.create_task_group() as tg:
            results: list[str] = []

            async def call() -> None:
                results.append(await client.stub().echo("a"))

            tg.start_soon(call)
            msg = await engine.next(CALL)
            again = await engine.join()
            assert isinstance(again, Welcome)
            assert isinstance(first, Welcome)
            assert again.epoch == first.epoch
            await engine.reply(msg.call_id, "A")
        assert results == ["A"]


async def test_impostor_claiming_a_dead_pid_cannot_displace_a_live_engine(tmp_path: Path) -> None:
    async with (
        make_client(tmp_path) as client,
        FakeEngine(client.addresses[0], "e1") as real,
        FakeEngine(
            client.addresses[0], "e1", host_id=host_id(), pid=2**22 + 12345, epoch=99
        ) as impostor,
    ):
        assert isinstance(await real.join(), Welcome)
        reject = await impostor.join()
        assert isinstance(reject, Reject)
        assert reject.reason == "duplicate_id"
        async with anyio.create_task_group() as tg:
            results: list[str] = []

            async def call() -> None:
                results.append(await client.with_options(engine="e1").stub().echo("x"))

            tg.start_soon(call)
            msg = await real.next(CALL)
            await impostor.reply(msg.call_id, "stolen")  # not its call: dropped
            await real.reply(msg.call_id, "X")
        assert results == ["X"]


async def test_stalled_client_fails_calls_at_once_when_it_wakes(tmp_path: Path) -> None:
    async with (
        make_client(tmp_path, heartbeat_interval=0.05, dead_after=30.0) as client,
        FakeEngine(client.addresses[0], "e1", dead_after_ms=200) as engine,
    ):
        await engine.join()
        outcome: list[BaseException] = []

        async def call() -> None:
            try:
                await client.stub().sleep(60.0)  # no timeout
            except EngineDeadError as exc:
                outcome.append(exc)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await engine.next(CALL)
                time.sleep(0.5)  # noqa: ASYNC251 - the fault under test: a stalled event loop
        assert "lost this client's session" in str(outcome[0])
        assert client.statistics().calls_in_flight == 0


async def test_first_hello_request_is_retried_until_the_engine_listens(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/late.sock"
    # The engine binds after the client sent its first PING (which found no peer).
    async with (
        Client(Calculator, connect=address, heartbeat_interval=30.0, dead_after=60.0) as client,
        FakeEngine(address, "l1", listen=True) as engine,
    ):
        with anyio.fail_after(10):
            assert isinstance(await engine.join(), Welcome)
            await client.wait_for_engines(1)


async def test_refused_strangers_cost_bounded_state(tmp_path: Path) -> None:
    async with make_client(tmp_path) as client:
        sock = create_socket(zmq.DEALER, routing_id=b"stranger")
        try:
            sock.connect(client.addresses[0])
            n = MAX_REJECTED * 3
            for i in range(n):
                engine = FakeEngine(client.addresses[0], f"{i}-" + "x" * 1000, fingerprint="bad")
                await sock.send(engine.hello_frames())
            with anyio.fail_after(20):
                for _ in range(n):
                    await sock.recv()  # each HELLO is answered by a REJECT
        finally:
            await sock.aclose()
        assert client.statistics().rejected_total == n
        assert len(client.rejected) == MAX_REJECTED
        with pytest.raises(EnginesUnavailableError) as info:
            await client.wait_for_engines(1, timeout=0.01)
        assert len(str(info.value)) < MAX_REJECTED * (MAX_REJECTED_KEY + MAX_REJECTED_TEXT + 8)
        assert f"{n - MAX_REJECTED} earlier refusals" in str(info.value)


async def test_many_waiting_callers_are_woken_once_each(tmp_path: Path) -> None:
    calls = 600
    async with (
        make_client(tmp_path, max_in_flight=4, dead_after=30.0) as client,
        FakeEngine(client.addresses[0], "e1") as engine,
    ):
        await engine.join()

        async def serve() -> None:
            for _ in range(calls):
                msg = await engine.next(CALL)
                await engine.reply(msg.call_id, engine.args(msg)[0])

        results: list[str] = []

        async def call(i: int) -> None:
            results.append(await client.stub().echo(str(i)))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve)
                for i in range(calls):
                    tg.start_soon(call, i)
        assert sorted(results, key=int) == [str(i) for i in range(calls)]
        # One wake-up per freed slot (plus a few passed on), not one per waiter per slot.
        assert client._protocol.capacity.wakeups <= calls + 8


def test_each_option_has_one_spelling_and_both_sides_take_keywords(tmp_path: Path) -> None:
    from tensorrpc import ServerConfig
    from tensorrpc._codec import CodecConfig
    from tensorrpc._server import Server

    codec = CodecConfig(max_tensors=7)
    address = f"ipc://{tmp_path}/c.sock"
    client = Client(Calculator, bind=address, codec=codec)
    assert client._io.codec is codec
    server = Server(Calculator(), bind=address, codec=codec, max_queued=3)
    assert (server.config.codec, server.config.max_queued) == (codec, 3)
    # The spellings kept beside the one way are gone: codec_config= (codec=),
    # high_water_mark= (socket_options=), metrics_port= (observer=metrics.exporter(port)).
    for removed in ({"codec_config": codec}, {"high_water_mark": 10}, {"metrics_port": 0}):
        with pytest.raises(TypeError, match=next(iter(removed))):
            Client(Calculator, bind=address, **removed)
    with pytest.raises(TypeError, match="metrics_port"):
        Server(Calculator(), bind=address, metrics_port=0)  # type: ignore[call-arg]
    # The engine takes keywords only, as the client does: no config object beside them.
    with pytest.raises(TypeError):
        Server(Calculator(), ServerConfig(bind=address))  # type: ignore[arg-type, call-arg]


def test_a_views_stub_calls_with_the_views_options(tmp_path: Path) -> None:
    from tensorrpc._views import CallOptions

    client = Client(Calculator, bind=f"ipc://{tmp_path}/c.sock")
    options = CallOptions(engine="e1", timeout=2.0, wait=False, transport="frames")
    view = client.with_options(engine="e1", timeout=2.0, wait=False, transport="frames")
    assert view.options == options
    # Per-call options are set one way, on the view: its stub keeps them (it used to
    # take keywords of its own and drop the view's).
    assert view.stub()._options == options  # type: ignore[misc]
    assert client.stub()._options == CallOptions()  # type: ignore[misc]


def test_chained_views_keep_the_options_they_do_not_set(tmp_path: Path) -> None:
    from tensorrpc._views import CallOptions

    client = Client(Calculator, bind=f"ipc://{tmp_path}/c.sock")
    view = client.with_options(timeout=5.0, metadata={"tenant": "a"})
    chained = view.with_options(engine="e1", wait=False)
    assert chained.options == CallOptions(
        engine="e1", timeout=5.0, wait=False, metadata={"tenant": "a"}
    )
    assert chained.options.metadata == {"tenant": "a"}
    # None clears an option; the earlier view is unchanged.
    assert chained.with_options(timeout=None).options.timeout is None
    assert view.options.timeout == 5.0
    assert view.options.engine is None
