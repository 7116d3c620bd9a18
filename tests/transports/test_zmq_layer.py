from __future__ import annotations

import contextlib
import hashlib
import os
import re
import select
import threading
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import zmq

from tensorrpc._exceptions import (
    ClosedError,
    ConnectError,
    PeerUnreachableError,
    TransportError,
)
from tensorrpc._zmq import (
    AsyncSocket,
    PendingSends,
    SocketOptions,
    create_socket,
    loop_clock,
    map_zmq_errors,
    translate_zmq_error,
)

SocketFactory = Callable[..., AsyncSocket]


@pytest.fixture(params=["ipc", "tcp"])
def endpoint(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "ipc":
        return f"ipc://{tmp_path}/sock"
    return "tcp://127.0.0.1:0"


async def test_the_shells_clock_is_anyios_clock() -> None:
    # The shells feed the machines this clock and bound calls with anyio's cancel scopes:
    # on trio, anyio's clock is offset from time.monotonic by hours.
    clock = loop_clock()
    before = clock()
    now = anyio.current_time()
    assert before <= now <= clock()


def fill_until_blocked(sock: AsyncSocket, frames: list[bytes], limit: int) -> int:
    """send_nowait ``frames`` until the socket would block; return how many went."""
    for sent in range(limit):
        try:
            sock.send_nowait(frames)
        except anyio.WouldBlock:
            return sent
    raise AssertionError(f"{limit} messages were queued without reaching the high-water mark")


def bound_pair(make_socket: SocketFactory, endpoint: str, **kwargs: object):
    router = make_socket(zmq.ROUTER, **kwargs)
    dealer = make_socket(zmq.DEALER, routing_id=b"dealer-1", **kwargs)
    real = router.bind(endpoint)
    dealer.connect(real)
    return router, dealer, real


async def test_router_dealer_round_trip(anyio_backend, make_socket, endpoint):
    router, dealer, real = bound_pair(make_socket, endpoint)
    if endpoint.startswith("tcp"):
        assert real.startswith("tcp://127.0.0.1:")
        assert int(real.rsplit(":", 1)[1]) > 0
    else:
        assert real == endpoint
    with anyio.fail_after(10):
        assert await dealer.send([b"header", b"payload"]) is None
        frames = await router.recv()
        assert [f.bytes for f in frames] == [b"dealer-1", b"header", b"payload"]
        await router.send([frames[0], b"reply"])
        assert [f.bytes for f in await dealer.recv()] == [b"reply"]


async def test_many_messages_both_ways_at_once_keep_their_order(
    anyio_backend, make_socket, endpoint
):
    router, dealer, _ = bound_pair(
        make_socket, endpoint, options=SocketOptions(sndhwm=50, rcvhwm=50)
    )
    count = 3000
    echoed: list[int] = []

    async def echo() -> None:
        for _ in range(count):
            frames = await router.recv()
            await router.send(frames)

    async def produce() -> None:
        for i in range(count):
            await dealer.send([i.to_bytes(4, "little")])

    async def consume() -> None:
        for _ in range(count):
            (frame,) = await dealer.recv()
            echoed.append(int.from_bytes(frame.bytes, "little"))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(echo)
            tg.start_soon(consume)
            tg.start_soon(produce)
    assert echoed == list(range(count))


async def test_two_tasks_receiving_on_one_socket_share_the_messages(
    anyio_backend, make_socket, endpoint
):
    router, dealer, _ = bound_pair(make_socket, endpoint)
    got: list[bytes] = []

    async def receiver() -> None:
        while len(got) < 200:
            frames = await router.recv()
            got.append(frames[1].bytes)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiver)
            tg.start_soon(receiver)
            for i in range(201):
                await dealer.send([b"%d" % i])
                if i % 10 == 0:
                    await anyio.lowlevel.checkpoint()
    assert len(set(got)) == len(got) >= 200


async def test_large_zero_copy_frames_arrive_exactly_and_tracker_completes(
    anyio_backend, make_socket, endpoint
):
    router, dealer, _ = bound_pair(make_socket, endpoint)
    size = 64 * 1024 * 1024
    data = bytearray(os.urandom(1024)) * (size // 1024)
    digest = hashlib.sha256(data).hexdigest()
    pending = PendingSends()
    with anyio.fail_after(60):
        tracker = await dealer.send([b"head", memoryview(data), b"tail"], track=True)
        assert tracker is not None
        pending.add(tracker, data)
        frames = await router.recv()
        assert [len(f) for f in frames] == [8, 4, size, 4]
        assert hashlib.sha256(frames[2].buffer).hexdigest() == digest
        assert await anyio.to_thread.run_sync(tracker.wait, 30) is None
    assert tracker.done
    assert pending.prune() == 0
    assert len(pending) == 0


async def test_small_tracked_frames_are_copied_and_done_at_once(
    anyio_backend, make_socket, endpoint
):
    router, dealer, _ = bound_pair(make_socket, endpoint)
    with anyio.fail_after(10):
        tracker = await dealer.send([b"small", bytearray(100)], track=True)
        assert tracker is not None
        assert tracker.done
        await router.recv()


async def test_cancelled_receives_lose_no_message(anyio_backend, make_socket, endpoint):
    router, dealer, _ = bound_pair(make_socket, endpoint)
    count = 60
    received: list[bytes] = []

    async def receive_once(*, task_status: anyio.abc.TaskStatus[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            frames = await router.recv()
            received.append(frames[1].bytes)

    with anyio.fail_after(30):
        # A receive cancelled while idle takes nothing.
        with anyio.move_on_after(0.01):
            await router.recv()
        for i in range(count):
            async with anyio.create_task_group() as tg:
                scope = await tg.start(receive_once)
                if i % 3 == 1:
                    await anyio.lowlevel.checkpoint()
                await dealer.send([b"%d" % i])
                if i % 3 == 2:
                    await anyio.lowlevel.checkpoint()
                scope.cancel()
        while len(received) < count:
            frames = await router.recv()
            received.append(frames[1].bytes)
    assert sorted(received, key=int) == [b"%d" % i for i in range(count)]


async def test_send_waits_at_the_high_water_mark_and_completes_later(
    anyio_backend, make_socket, tmp_path
):
    options = SocketOptions(sndhwm=5, rcvhwm=5)
    dealer = make_socket(zmq.DEALER, options=options)
    endpoint = f"ipc://{tmp_path}/later"
    dealer.connect(endpoint)
    queued = fill_until_blocked(dealer, [b"queued"], 10_000)
    assert queued > 0
    router = make_socket(zmq.ROUTER, options=options)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(dealer.send, [b"last"])
            await anyio.lowlevel.checkpoint()
            router.bind(endpoint)
            bodies = [(await router.recv())[1].bytes for _ in range(queued + 1)]
    assert bodies == [b"queued"] * queued + [b"last"]


async def test_router_send_to_a_full_peer_waits_while_another_peer_has_room(
    anyio_backend, make_socket, endpoint
):
    options = SocketOptions(sndhwm=4, rcvhwm=4)
    router = make_socket(zmq.ROUTER, options=options)
    real = router.bind(endpoint)
    slow = make_socket(zmq.DEALER, routing_id=b"slow", options=options)
    idle = make_socket(zmq.DEALER, routing_id=b"idle", options=options)
    for peer in (slow, idle):
        peer.connect(real)
    with anyio.fail_after(20):
        for peer, name in ((slow, b"slow"), (idle, b"idle")):
            await peer.send([b"hello"])
            assert (await router.recv())[0].bytes == name
        chunk = bytes(256 * 1024)  # large, so that kernel buffers fill after a few
        sent = fill_until_blocked(router, [b"slow", chunk], 2000)
        assert router.socket.get(zmq.EVENTS) & zmq.POLLOUT  # "idle" still has room
        async with anyio.create_task_group() as tg:
            tg.start_soon(router.send, [b"slow", b"last"])
            bodies = [(await slow.recv())[0] for _ in range(sent + 1)]
    assert bodies[-1].bytes == b"last"
    assert len(bodies) == sent + 1


async def test_router_mandatory_reports_an_unknown_peer(anyio_backend, make_socket, endpoint):
    router = make_socket(zmq.ROUTER)
    router.bind(endpoint)
    with pytest.raises(PeerUnreachableError) as info:
        await router.send([b"nobody", b"payload"])
    assert info.value.peer == b"nobody"
    assert isinstance(info.value.__cause__, zmq.ZMQError)
    with pytest.raises(PeerUnreachableError):
        router.send_nowait([zmq.Frame(b"nobody"), b"payload"])


async def test_router_dials_a_router_with_a_chosen_peer_id(anyio_backend, make_socket, endpoint):
    engine = make_socket(zmq.ROUTER, routing_id=b"engine")
    client = make_socket(zmq.ROUTER, routing_id=b"client")
    real = engine.bind(endpoint)
    client.connect(real, peer_id=b"engine-A")
    with anyio.fail_after(10):
        await client.send([b"engine-A", b"ping"])
        frames = await engine.recv()
        assert [f.bytes for f in frames] == [b"client", b"ping"]
        await engine.send([b"client", b"pong"])
        assert [f.bytes for f in await client.recv()] == [b"engine-A", b"pong"]


def test_routing_ids_are_checked(make_socket):
    with pytest.raises(ValueError, match="zero byte"):
        make_socket(zmq.DEALER, routing_id=b"\x00abc")
    with pytest.raises(ValueError, match="1 to 255"):
        make_socket(zmq.DEALER, routing_id=b"")
    router = make_socket(zmq.ROUTER)
    with pytest.raises(ValueError, match="1 to 255"):
        router.connect("tcp://127.0.0.1:1", peer_id=b"x" * 256)


async def test_closing_wakes_every_waiting_task_with_closed_error(
    anyio_backend, make_socket, endpoint
):
    router, _dealer, _ = bound_pair(make_socket, endpoint)
    errors: list[BaseException] = []

    async def wait_forever() -> None:
        try:
            await router.recv()
        except ClosedError as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_forever)
            tg.start_soon(wait_forever)
            await anyio.wait_all_tasks_blocked()
            await router.aclose()
    assert len(errors) == 2
    assert router.closed
    with pytest.raises(ClosedError):
        await router.recv()
    with pytest.raises(ClosedError):
        await router.send([b"x", b"y"])
    with pytest.raises(ClosedError):
        router.bind(endpoint)
    await router.aclose()  # idempotent


async def test_ipc_socket_file_is_removed_on_close(anyio_backend, make_socket, tmp_path):
    path = tmp_path / "engine.sock"
    async with make_socket(zmq.ROUTER) as router:
        assert router.bind(f"ipc://{path}") == f"ipc://{path}"
        assert path.exists()
    assert not path.exists()


async def test_close_leaves_a_file_that_is_no_longer_ours(anyio_backend, make_socket, tmp_path):
    path = tmp_path / "engine.sock"
    router = make_socket(zmq.ROUTER)
    router.bind(f"ipc://{path}")
    path.unlink()
    path.write_text("someone else's")
    await router.aclose()
    assert path.read_text() == "someone else's"


async def test_bind_errors_are_connect_errors(anyio_backend, make_socket, tmp_path):
    first = make_socket(zmq.ROUTER)
    real = first.bind("tcp://127.0.0.1:0")
    second = make_socket(zmq.ROUTER)
    with pytest.raises(ConnectError, match=re.escape("bind tcp://127.0.0.1")):
        second.bind(real)
    with pytest.raises(ConnectError):
        second.bind("nonsense://where")
    with pytest.raises(ConnectError):
        second.bind(f"ipc://{tmp_path}/{'x' * 200}")


def test_zmq_errors_map_to_tensorrpc_errors():
    assert isinstance(translate_zmq_error(zmq.ZMQError(zmq.ENOTSOCK)), ClosedError)
    assert isinstance(translate_zmq_error(zmq.ZMQError(zmq.ETERM)), ClosedError)
    unreachable = translate_zmq_error(zmq.ZMQError(zmq.EHOSTUNREACH), peer=b"p")
    assert isinstance(unreachable, PeerUnreachableError)
    assert unreachable.peer == b"p"
    other = translate_zmq_error(zmq.ZMQError(zmq.EFSM), "recv")
    assert type(other) is TransportError
    assert str(other).startswith("recv: ")
    with pytest.raises(ConnectError) as info, map_zmq_errors("bind"):
        raise zmq.ZMQError(zmq.EADDRINUSE)
    assert isinstance(info.value.__cause__, zmq.ZMQError)


def test_socket_options_are_applied(make_socket):
    options = SocketOptions(sndhwm=7, rcvhwm=9, maxmsgsize=1234, linger_ms=5)
    router = make_socket(zmq.ROUTER, options=options)
    sock = router.socket
    assert sock.get(zmq.SNDHWM) == 7
    assert sock.get(zmq.RCVHWM) == 9
    assert sock.get(zmq.MAXMSGSIZE) == 1234
    assert sock.get(zmq.LINGER) == 5
    assert sock.get(zmq.TCP_KEEPALIVE) == 1
    assert router.socket_type == zmq.ROUTER
    defaults = make_socket(zmq.DEALER).socket
    assert defaults.get(zmq.SNDHWM) > 0
    assert defaults.get(zmq.MAXMSGSIZE) >= 1 << 30


def test_unlimited_message_size_must_be_explicit():
    with pytest.raises(ValueError, match="maxmsgsize"):
        SocketOptions(maxmsgsize=0)
    assert SocketOptions(maxmsgsize=-1).maxmsgsize == -1


async def test_a_frame_over_maxmsgsize_is_refused_by_the_receiver(
    anyio_backend, make_socket, endpoint
):
    router = make_socket(zmq.ROUTER, options=SocketOptions(maxmsgsize=1000))
    real = router.bind(endpoint)
    big = make_socket(zmq.DEALER, routing_id=b"big")
    small = make_socket(zmq.DEALER, routing_id=b"small")
    big.connect(real)
    with anyio.fail_after(10):
        await big.send([b"x" * 2000])
        small.connect(real)
        await small.send([b"x" * 1000])
        frames = await router.recv()
    assert [f.bytes for f in frames] == [b"small", b"x" * 1000]


async def test_a_busy_socket_still_lets_other_tasks_run(anyio_backend, make_socket):
    # inproc: the 200 messages are in the router's queue as soon as send returns, so the
    # receive loop never has to wait and only the fairness checkpoints let others run.
    router, dealer, _ = bound_pair(make_socket, f"inproc://busy-{anyio_backend}")
    with anyio.fail_after(20):
        for i in range(200):
            await dealer.send([b"%d" % i])
        ticks = 0
        seen_ticks: list[int] = []

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.lowlevel.checkpoint()
            start = ticks
            for _ in range(200):
                await router.recv()
            seen_ticks.append(ticks - start)
            tg.cancel_scope.cancel()
    assert seen_ticks[0] > 0


def _clock_and_yields(monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], list[int]]:
    """Give the socket layer our clock (``now[0]``) and count the yields it makes."""
    from tensorrpc import _zmq

    now = [1000.0]
    monkeypatch.setattr(_zmq, "_monotonic", lambda: now[0])
    yields = [0]
    original = anyio.lowlevel.cancel_shielded_checkpoint

    async def counting_checkpoint() -> None:
        yields[0] += 1
        await original()

    monkeypatch.setattr(anyio.lowlevel, "cancel_shielded_checkpoint", counting_checkpoint)
    return now, yields


async def test_a_socket_whose_messages_are_costly_to_handle_yields_by_time(
    anyio_backend, make_socket, monkeypatch
):
    # A flood of messages that each take long to handle (a decode bomb before the caps)
    # must not hold the loop for 32 messages: the socket yields once 2 ms have passed
    # since it last let others run. The clock is ours, so that the test measures nothing,
    # and the yields are counted where the socket makes them.
    now, yields = _clock_and_yields(monkeypatch)
    router, dealer, _ = bound_pair(make_socket, f"inproc://costly-{anyio_backend}")
    with anyio.fail_after(20):
        for i in range(8):
            await dealer.send([b"%d" % i])
        await router.recv()
        start = yields[0]
        await router.recv()
        await router.recv()  # cheap handling: no yield
        assert yields[0] == start
        for _ in range(3):
            now[0] += 0.5  # handling the previous message took 0.5 s
            await router.recv()
            assert yields[0] == start + 1, "the socket did not let the other tasks run"
            start = yields[0]
        # the recv_nowait loops (the client's reader) ask the same budget
        router.recv_nowait()
        assert not router.yield_due()
        now[0] += 0.5
        assert router.yield_due()
        assert not router.yield_due()  # the budget restarted


async def test_the_time_budget_restarts_when_a_wait_or_a_yield_ends(
    anyio_backend, make_socket, monkeypatch
):
    # The 2 ms budget counts the socket user's own handling time: a wait for the next
    # message, or other tasks running while the user yielded, must not make the next
    # message yield at once (at 64 calls in flight a client's reader then yielded after
    # nearly every reply: one more event loop iteration each).
    now, yields = _clock_and_yields(monkeypatch)
    router, dealer, _ = bound_pair(make_socket, f"inproc://resume-{anyio_backend}")
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(router.recv)  # waits: nothing was sent yet
            await anyio.wait_all_tasks_blocked()
            now[0] += 0.5  # the wait lasts 0.5 s
            await dealer.send([b"first"])
        await dealer.send([b"second"])
        start = yields[0]
        await router.recv()  # handled at once after the wait: no yield
        assert yields[0] == start, "the wait counted against the budget"
        # the recv_nowait loops (the client's reader): a yield's duration does not count
        for body in (b"third", b"fourth"):
            await dealer.send([body])
            assert router.socket.poll(5000, zmq.POLLIN)  # bounded: it has arrived
            router.recv_nowait()
            if body == b"third":
                now[0] += 0.5  # handling it took 0.5 s
                assert router.yield_due()
                now[0] += 0.5  # the other tasks ran 0.5 s while the reader yielded
        assert not router.yield_due(), "the yield counted against the budget"


async def test_recv_never_holds_a_message_across_its_fairness_yield(
    anyio_backend, make_socket, monkeypatch
):
    # Another task may receive from the same socket while recv yields (the client's
    # housekeeping tick handles the messages already received): recv yields before it
    # takes a message, so whoever takes one handles it before the next is taken.
    from tensorrpc import _zmq

    got: list[bytes] = []
    original = anyio.lowlevel.cancel_shielded_checkpoint

    async def another_reader_runs() -> None:
        with contextlib.suppress(anyio.WouldBlock):
            got.append(router.recv_nowait()[1].bytes)
        await original()

    monkeypatch.setattr(_zmq.AsyncSocket, "yield_due", lambda self: True)
    monkeypatch.setattr(anyio.lowlevel, "cancel_shielded_checkpoint", another_reader_runs)
    router, dealer, _ = bound_pair(make_socket, f"inproc://order-{anyio_backend}")
    with anyio.fail_after(10):
        for i in range(6):
            await dealer.send([b"%d" % i])
        while len(got) < 6:
            got.append((await router.recv())[1].bytes)
    assert got == [b"%d" % i for i in range(6)]


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_opening_and_closing_many_sockets_leaks_no_file_descriptor(anyio_backend, tmp_path):
    async def cycle(rounds: int) -> None:
        for i in range(rounds):
            router = create_socket(zmq.ROUTER)
            dealer = create_socket(zmq.DEALER)
            try:
                real = router.bind(f"ipc://{tmp_path}/s{i}")
                dealer.connect(real)
                await dealer.send([b"x"])
                await router.recv()
            finally:
                await dealer.aclose()
                await router.aclose()

    with anyio.fail_after(30):
        await cycle(3)  # warm up lazily created context resources
        before = fd_count()
        await cycle(40)
        # libzmq's reaper thread releases closed sockets' descriptors asynchronously.
        for _ in range(2000):
            if fd_count() <= before:
                break
            await anyio.sleep(0.01)
    assert fd_count() <= before
    assert not list(tmp_path.iterdir())


def test_pending_sends_hold_memory_until_trackers_are_done():
    events = [threading.Event() for _ in range(4)]
    trackers = [zmq.MessageTracker(event) for event in events]
    pending = PendingSends(max_scan=3)
    for tracker, owner in zip(trackers[:3], ["a", "b", "c"], strict=True):
        pending.add(tracker, owner)
    assert len(pending) == 3
    events[1].set()
    assert pending.prune() == 3  # the oldest is not done: the cheap prune stops there
    pending.add(zmq.MessageTracker(), "done already")
    assert len(pending) == 3
    pending.add(trackers[3], "d")
    assert pending.prune() == 3  # past max_scan: a full scan dropped "b"
    events[0].set()
    assert pending.prune() == 2
    events[2].set()
    events[3].set()
    assert pending.prune() == 0
    pending.add(None, "untracked")
    assert len(pending) == 0
    pending.add(zmq.MessageTracker(threading.Event()), "x")
    pending.clear()
    assert len(pending) == 0


async def test_a_waiting_receiver_is_woken_when_another_operation_ate_the_fd_edge(
    anyio_backend, make_socket, endpoint
):
    router, dealer, _ = bound_pair(make_socket, endpoint)
    received: list[bytes] = []

    async def receive() -> None:
        received.append((await dealer.recv())[0].bytes)

    with anyio.fail_after(10):
        await dealer.send([b"hello"])
        peer = (await router.recv())[0]
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            await anyio.wait_all_tasks_blocked()
            await router.send([peer, b"reply"])
            # Block until the reply is queued: zmq_poll processes the socket's commands and
            # resets its FD, as libzmq does inside any send from time to time.
            assert dealer.socket.poll(5000, zmq.POLLIN) == zmq.POLLIN
            await dealer.send([b"another operation on the same socket"])
    assert received == [b"reply"]


async def test_a_task_parking_behind_the_fd_waiter_passes_on_what_it_saw(
    anyio_backend, make_socket
):
    # inproc: no I/O thread drains the pipe behind our back, so "full" stays full.
    options = SocketOptions(sndhwm=1, rcvhwm=1)
    router, dealer, _ = bound_pair(
        make_socket, f"inproc://parking-{anyio_backend}", options=options
    )
    reply_seen = anyio.Event()
    received: list[bytes] = []

    async def receive() -> None:
        received.append((await dealer.recv())[0].bytes)
        reply_seen.set()

    async def drain_router() -> None:
        await reply_seen.wait()
        while (await router.recv())[1].bytes != b"last":
            pass

    with anyio.fail_after(20):
        await dealer.send([b"hello"])
        peer = (await router.recv())[0]
        for _ in range(100):  # EVENTS reads process the commands a failed send may not
            if not dealer.socket.get(zmq.EVENTS) & zmq.POLLOUT:
                break
            with contextlib.suppress(anyio.WouldBlock):
                dealer.send_nowait([b"fill"])
        assert not dealer.socket.get(zmq.EVENTS) & zmq.POLLOUT
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            tg.start_soon(drain_router)
            await anyio.wait_all_tasks_blocked()
            await router.send([peer, b"reply"])
            # Wait (blocking, without touching the socket) until the reply is signalled.
            assert select.select([dealer.socket.FD], [], [], 5)[0]
            # This send would block: before the event loop polls the FD again it reads
            # EVENTS (eating the edge meant for the receiver) and parks behind the
            # receiver, which must still be woken to take the reply.
            await dealer.send([b"last"])
    assert received == [b"reply"]


async def test_a_closed_socket_leaves_no_registration_behind_and_its_fd_can_be_reused(
    anyio_backend, make_socket, endpoint
):
    # On asyncio the FD stays registered with the loop between waits: closing must remove
    # it, or a new socket that gets the same FD number would inherit a stale entry.
    for round_no in range(3):
        ep = endpoint if endpoint.startswith("tcp") else f"{endpoint}{round_no}"
        router, dealer, _ = bound_pair(make_socket, ep)
        fd = dealer.socket.FD
        with anyio.fail_after(10):
            await dealer.send([b"ping"])
            peer = (await router.recv())[0]
            await router.send([peer, b"pong"])
            assert [f.bytes for f in await dealer.recv()] == [b"pong"]
        await router.aclose()
        await dealer.aclose()
        if anyio_backend == "asyncio":
            import asyncio

            assert not asyncio.get_running_loop().remove_reader(fd)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_socket_keeps_working_on_a_second_event_loop(backend, make_socket):
    router, dealer, _ = bound_pair(make_socket, f"inproc://two-loops-{backend}")

    async def ping(payload: bytes) -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:

                async def answer() -> None:
                    frames = await router.recv()
                    await router.send([frames[0], frames[1]])

                tg.start_soon(answer)
                await anyio.wait_all_tasks_blocked()  # the router waits on its FD
                await dealer.send([payload])
                assert [f.bytes for f in await dealer.recv()] == [payload]

    anyio.run(ping, b"first", backend=backend)
    anyio.run(ping, b"second", backend=backend)


async def test_a_receive_that_timed_out_does_not_steal_a_later_message(
    anyio_backend, make_socket, endpoint
):
    router, dealer, _ = bound_pair(make_socket, endpoint)
    with anyio.fail_after(10):
        await dealer.send([b"hello"])
        peer = (await router.recv())[0]
        for _ in range(3):
            with anyio.move_on_after(0.01) as scope:
                await dealer.recv()
            assert scope.cancelled_caught
        await router.send([peer, b"reply"])
        assert [f.bytes for f in await dealer.recv()] == [b"reply"]


def count_events_reads(sock: AsyncSocket) -> list[int]:
    """Count the socket's EVENTS reads from now on (each is two system calls in libzmq)."""
    reads: list[int] = []
    get = sock._get

    def counting(option: int) -> int:
        if option == zmq.EVENTS:
            reads.append(option)
        return get(option)

    sock._get = counting
    sock._waiter._get = counting
    return reads


async def test_a_run_of_messages_is_received_without_reading_events_for_each(
    anyio_backend, make_socket
):
    # inproc: no I/O thread, so the 20 messages are all queued once sent.
    router, dealer, _ = bound_pair(make_socket, f"inproc://run-{os.getpid()}-{anyio_backend}")
    with anyio.fail_after(10):
        await dealer.send([b"first"])
        peer = (await router.recv())[0]
        for i in range(20):
            await router.send([peer, b"%d" % i])
        reads = count_events_reads(dealer)
        got = [dealer.recv_nowait()[0].bytes for _ in range(20)]
        # The first two receives read EVENTS (two in a row make a run); the rest of the
        # run is taken without.
        assert len(reads) == 2
        with pytest.raises(anyio.WouldBlock):
            dealer.recv_nowait()
    assert got == [b"%d" % i for i in range(20)]


async def test_a_receive_after_a_run_ran_dry_still_wakes_for_the_next_message(
    anyio_backend, make_socket, endpoint
):
    # The failed receive that ends a run reads the socket's commands (it may eat the
    # FD's edge); a receive that then waits must still be woken.
    router, dealer, _ = bound_pair(make_socket, endpoint)
    received: list[bytes] = []

    async def receive() -> None:
        received.append((await dealer.recv())[0].bytes)

    with anyio.fail_after(10):
        await dealer.send([b"hello"])
        peer = (await router.recv())[0]
        await router.send([peer, b"one"])
        await router.send([peer, b"two"])
        assert dealer.socket.poll(5000, zmq.POLLIN) == zmq.POLLIN
        assert (await dealer.recv())[0].bytes == b"one"
        with anyio.fail_after(5):  # the second may still be in the I/O thread
            assert (await dealer.recv())[0].bytes == b"two"
        with pytest.raises(anyio.WouldBlock):
            dealer.recv_nowait()  # the run ends: a failed receive, no EVENTS read
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            await anyio.wait_all_tasks_blocked()
            await router.send([peer, b"three"])
    assert received == [b"three"]


async def test_a_receive_woken_by_a_read_that_showed_a_message_takes_it_at_once(
    anyio_backend, make_socket
):
    # asyncio: the FD callback reads EVENTS and wakes the receive only when they show a
    # message, so the receive takes it without reading EVENTS a third time.
    router, dealer, _ = bound_pair(make_socket, f"inproc://woken-{os.getpid()}-{anyio_backend}")
    received: list[bytes] = []

    async def receive() -> None:
        received.append((await dealer.recv())[0].bytes)

    with anyio.fail_after(10):
        await dealer.send([b"hello"])
        peer = (await router.recv())[0]
        reads = count_events_reads(dealer)
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            await anyio.wait_all_tasks_blocked()
            assert len(reads) == 1  # found nothing, then waited
            await router.send([peer, b"one"])
    assert received == [b"one"]
    # trio has no FD callback: its waiter learns only that the FD is readable, and the
    # receive reads EVENTS itself (also two reads in all).
    assert len(reads) == 2


async def test_a_receive_woken_for_a_message_another_task_took_waits_again(
    anyio_backend, make_socket
):
    # Two receivers wait; one message wakes both (asyncio) and only one gets it: the
    # other's attempt at once fails and it must wait again, then get the next message.
    router, dealer, _ = bound_pair(make_socket, f"inproc://woken2-{os.getpid()}-{anyio_backend}")
    send, got = anyio.create_memory_object_stream[bytes](2)

    async def receive() -> None:
        await send.send((await dealer.recv())[0].bytes)

    with anyio.fail_after(10):
        await dealer.send([b"hello"])
        peer = (await router.recv())[0]
        async with send, got, anyio.create_task_group() as tg:
            tg.start_soon(receive)
            tg.start_soon(receive)
            await anyio.wait_all_tasks_blocked()
            await router.send([peer, b"one"])
            assert await got.receive() == b"one"
            await anyio.wait_all_tasks_blocked()  # the other receiver waits again
            await router.send([peer, b"two"])
            assert await got.receive() == b"two"


def test_bulk_sockets_get_an_io_thread_of_their_own():
    """Where the context has two I/O threads, a bulk connection's socket uses the second
    and every other socket the first, so a large message's bytes never hold up a small
    one's; a context of one thread (a user's) is left as it is."""
    two: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=2)
    one: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
    made = [
        create_socket(zmq.ROUTER, context=two),
        create_socket(zmq.ROUTER, context=two, bulk=True),
        create_socket(zmq.ROUTER, context=one, bulk=True),
    ]
    try:
        assert [s.socket.getsockopt(zmq.AFFINITY) for s in made] == [1, 2, 0]
    finally:
        for sock in made:
            sock.close()
        two.term()
        one.term()
