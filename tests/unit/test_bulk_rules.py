"""The bulk connection's rules (tensorrpc/_bulk.py, docs/design.md): sans-I/O, in memory."""

from __future__ import annotations

import pytest

from tensorrpc._bulk import (
    BULK_THRESHOLD,
    TOKEN_BYTES,
    BulkBinder,
    EarlyCancels,
    Pipe,
    Voucher,
    Wires,
    dial_endpoint,
    pipe_for,
)
from tensorrpc._protocol import MessageKind

KEY_A = Voucher("curve", b"A" * 32)
KEY_B = Voucher("curve", b"B" * 32)
PROC_1 = Voucher("kernel", (1234, 1000, 99))
PROC_2 = Voucher("kernel", (1235, 1000, 99))  # same user, another process
TOKEN = bytes(range(TOKEN_BYTES))
OTHER = bytes(TOKEN_BYTES)


# -- rule 3: what goes on the bulk pipe -----------------------------------------------------


@pytest.mark.parametrize("kind", [MessageKind.CALL, MessageKind.RESULT])
def test_large_calls_and_unary_results_go_on_a_bound_bulk_pipe(kind: MessageKind) -> None:
    assert pipe_for(kind, BULK_THRESHOLD, stream=False, bound=True) is Pipe.BULK
    assert pipe_for(kind, BULK_THRESHOLD - 1, stream=False, bound=True) is Pipe.CONTROL
    assert pipe_for(kind, BULK_THRESHOLD, stream=False, bound=False) is Pipe.CONTROL
    assert pipe_for(kind, BULK_THRESHOLD, stream=True, bound=True) is Pipe.CONTROL


@pytest.mark.parametrize(
    "kind", [k for k in MessageKind if k not in (MessageKind.CALL, MessageKind.RESULT)]
)
def test_everything_else_stays_on_control(kind: MessageKind) -> None:
    assert pipe_for(kind, 1 << 30, stream=False, bound=True) is Pipe.CONTROL


# -- rule 2: binding --------------------------------------------------------------------------


def bound(binder: BulkBinder, voucher: Voucher = KEY_A) -> None:
    assert binder.offer("s1", b"epoch-1", voucher, TOKEN)
    assert binder.opened("pipe-1", KEY_A) is None


def test_the_same_key_with_the_token_binds_the_pipe_to_the_session() -> None:
    binder = BulkBinder()
    bound(binder)
    got = binder.attach("pipe-1", b"epoch-1", TOKEN, KEY_A)
    assert got.session == "s1"
    assert binder.session_of("pipe-1") == "s1"
    assert binder.pipe_of("s1") == "pipe-1"


def test_the_same_process_binds_over_ipc() -> None:
    binder = BulkBinder()
    bound(binder, PROC_1)
    assert binder.attach("pipe-1", b"epoch-1", TOKEN, PROC_1).session == "s1"


@pytest.mark.parametrize(
    ("control", "bulk"), [(KEY_A, KEY_B), (PROC_1, PROC_2), (KEY_A, PROC_1), (PROC_1, KEY_A)]
)
def test_a_relayed_token_does_not_bind_and_is_spent(control: Voucher, bulk: Voucher) -> None:
    # A third party that learnt the token cannot attach: the key or the kernel says it
    # is not the session's peer. The token is then spent: the peer itself cannot use it.
    binder = BulkBinder()
    bound(binder, control)
    got = binder.attach("pipe-1", b"epoch-1", TOKEN, bulk)
    assert got.session is None
    assert "not vouched for" in got.refused
    assert binder.session_of("pipe-1") is None
    assert binder.opened("pipe-2", KEY_A) is None
    assert binder.attach("pipe-2", b"epoch-1", TOKEN, control).session is None


def test_nothing_vouches_over_plain_tcp_so_no_bulk_path() -> None:
    binder = BulkBinder()
    assert not binder.offer("s1", b"epoch-1", Voucher("none"), TOKEN)
    assert binder.opened("pipe-1", KEY_A) is None
    assert binder.attach("pipe-1", b"epoch-1", TOKEN, Voucher("none")).session is None


def test_a_wrong_token_is_refused_and_does_not_spend_the_right_one() -> None:
    binder = BulkBinder()
    bound(binder)
    assert binder.attach("pipe-1", b"epoch-1", OTHER, KEY_A).refused == "wrong bulk token"
    assert binder.opened("pipe-2", KEY_A) is None
    assert binder.attach("pipe-2", b"epoch-1", TOKEN, KEY_A).session == "s1"


def test_one_attach_per_pipe_and_one_pipe_per_session() -> None:
    binder = BulkBinder()
    bound(binder)
    assert binder.attach("pipe-1", b"epoch-1", TOKEN, KEY_A).session == "s1"
    assert binder.attach("pipe-1", b"epoch-1", TOKEN, KEY_A).session is None  # again
    assert binder.attach("never-opened", b"epoch-1", TOKEN, KEY_A).refused == "unknown bulk pipe"
    # A new epoch of the same session may attach one pipe again, with its new token;
    # the old pipe is the shell's to close.
    assert binder.offer("s1", b"epoch-2", KEY_A, OTHER)
    assert binder.session_of("pipe-1") is None
    assert binder.opened("pipe-2", KEY_A) is None
    assert binder.attach("pipe-2", b"epoch-1", TOKEN, KEY_A).session is None  # old epoch
    assert binder.opened("pipe-3", KEY_A) is None
    assert binder.attach("pipe-3", b"epoch-2", OTHER, KEY_A).session == "s1"


def test_a_refused_pipe_gets_no_second_attach() -> None:
    # One ATTACH per pipe, whatever its outcome: a connection cannot guess tokens.
    binder = BulkBinder()
    bound(binder)
    assert binder.attach("pipe-1", b"epoch-1", OTHER, KEY_A).refused == "wrong bulk token"
    assert binder.opened("pipe-1", KEY_A) is None
    assert binder.attach("pipe-1", b"epoch-1", TOKEN, KEY_A).refused == "one ATTACH per bulk pipe"
    assert binder.session_of("pipe-1") is None
    assert not binder._unbound
    assert binder.opened("pipe-2", KEY_A) is None  # a new connection may, with the token
    assert binder.attach("pipe-2", b"epoch-1", TOKEN, KEY_A).session == "s1"


def test_a_lost_or_forgotten_pipe_unbinds() -> None:
    binder = BulkBinder()
    bound(binder)
    binder.attach("pipe-1", b"epoch-1", TOKEN, KEY_A)
    assert binder.pipe_lost("pipe-1") == "s1"
    assert binder.pipe_of("s1") is None
    assert binder.pipe_lost("pipe-1") is None
    assert binder.offer("s2", b"epoch-9", KEY_B, TOKEN)
    assert binder.opened("pipe-9", KEY_A) is None
    binder.attach("pipe-9", b"epoch-9", TOKEN, KEY_B)
    assert binder.forget("s2") == "pipe-9"
    assert binder.session_of("pipe-9") is None


def test_tables_are_capped() -> None:
    binder = BulkBinder(max_sessions=2, max_unbound=2)
    for i in range(3):
        assert binder.offer(f"s{i}", f"e{i}".encode(), KEY_A, TOKEN)
    assert binder.opened("p0", KEY_A) is None
    assert binder.opened("p1", KEY_A) is None
    assert binder.opened("p2", KEY_A) == "p0"  # the oldest unbound pipe is closed
    assert binder.attach("p1", b"e0", TOKEN, KEY_A).session is None  # the oldest offer went
    assert binder.attach("p2", b"e2", TOKEN, KEY_A).session == "s2"


def test_an_attach_flood_from_one_process_evicts_only_its_own_pipes() -> None:
    # ATTACHes for epochs not offered (yet) are parked; one process sending many of them
    # (each on a fresh connection) must not push out another process's parked ATTACH.
    binder = BulkBinder(max_unbound=8, max_unbound_per_peer=2)
    assert binder.opened("honest", PROC_1) is None
    assert binder.attach("honest", b"epoch-1", TOKEN, PROC_1).parked
    closed = []
    for i in range(1000):
        pipe = f"flood-{i}"
        if (evicted := binder.opened(pipe, PROC_2)) is not None:
            closed.append(evicted)
        binder.attach(pipe, f"e{i}".encode(), TOKEN, PROC_2)
    assert "honest" not in closed
    assert len(closed) == 998  # all but the flood's newest two
    assert len(binder._unbound) == 3
    assert len(binder._parked) == 3
    assert binder.offer("s1", b"epoch-1", PROC_1, TOKEN)
    assert binder.parked(b"epoch-1") == ("honest", TOKEN, PROC_1)
    assert binder.attach("honest", b"epoch-1", TOKEN, PROC_1).session == "s1"


def test_the_total_cap_holds_across_peers() -> None:
    binder = BulkBinder(max_unbound=3, max_unbound_per_peer=2)
    peers = [Voucher("kernel", (pid, 1000, 1)) for pid in range(10)]
    closed = [binder.opened(f"p{i}", v) for i, v in enumerate(peers)]
    assert closed == [None, None, None, "p0", "p1", "p2", "p3", "p4", "p5", "p6"]
    assert len(binder._unbound) == 3


def test_an_attach_nothing_vouches_for_is_refused_not_parked() -> None:
    binder = BulkBinder()
    assert binder.opened("p", Voucher("none")) is None
    got = binder.attach("p", b"never-offered", TOKEN, Voucher("none"))
    assert not got.parked
    assert got.session is None
    assert not binder._parked
    assert not binder._unbound


@pytest.mark.parametrize(
    ("announced", "control", "dialed"),
    [
        # ipc: only the control path's own .bulk beside it, whatever was announced
        ("ipc:///tmp/eng.sock.bulk", "ipc:///tmp/eng.sock", "ipc:///tmp/eng.sock.bulk"),
        ("ipc:///run/other/victim.sock", "ipc:///tmp/eng.sock", "ipc:///tmp/eng.sock.bulk"),
        ("ipc://@other", "ipc://@eng", "ipc://@eng.bulk"),
        # tcp: the control host with the announced port, never the announced host
        ("tcp://0.0.0.0:4000", "tcp://127.0.0.1:5000", "tcp://127.0.0.1:4000"),
        ("tcp://10.9.9.9:4000", "tcp://127.0.0.1:5000", "tcp://127.0.0.1:4000"),
        ("tcp://evil.example:22", "tcp://[::1]:5000", "tcp://[::1]:22"),
        # never another transport, never a malformed port
        ("tcp://127.0.0.1:4000", "ipc:///tmp/eng.sock", None),
        ("ipc:///tmp/x", "tcp://127.0.0.1:5000", None),
        ("tcp://127.0.0.1:0", "tcp://127.0.0.1:5000", None),
        ("tcp://127.0.0.1:99999", "tcp://127.0.0.1:5000", None),
        ("tcp://127.0.0.1:+1", "tcp://127.0.0.1:5000", None),
        ("ipc://", "ipc:///tmp/eng.sock", None),
        ("ipc:///tmp/x.bulk", "inproc://eng", None),
    ],
)
def test_the_dialer_dials_only_what_it_can_tie_to_the_peer(
    announced: str, control: str, dialed: str | None
) -> None:
    assert dial_endpoint(announced, control) == dialed


def test_tokens_have_one_size() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        BulkBinder().offer("s1", b"e", KEY_A, b"short")


# -- rule 4: a CANCEL that overtook its CALL ------------------------------------------------


def test_a_call_whose_cancel_came_first_is_dropped_once() -> None:
    early = EarlyCancels(limit=2)
    early.cancelled(7)
    assert early.take(7)
    assert not early.take(7)
    assert not early.take(8)


def test_early_cancels_are_bounded_oldest_first() -> None:
    early = EarlyCancels(limit=2)
    for call_id in (1, 2, 3):
        early.cancelled(call_id)
    assert len(early) == 2
    assert not early.take(1)
    assert early.take(2)
    assert early.take(3)


# -- which connection carries which pipe (rules 2 and 5) --------------------------------------


def test_a_pipe_is_tied_to_the_connection_its_attach_came_on() -> None:
    wires = Wires()
    wires.up(7)
    assert wires.wire("pipe-1", 7)
    assert wires.fd_of("pipe-1") == 7
    assert wires.pipe_on(7) == "pipe-1"
    assert not wires.moved("pipe-1", 7)
    assert wires.down(7) == "pipe-1"  # its connection ended: the pipe is lost
    assert not wires.live(7)
    assert wires.fd_of("pipe-1") == -1
    assert len(wires) == 0


def test_an_attach_whose_connection_ended_ties_nothing() -> None:
    wires = Wires()
    wires.up(7)
    assert wires.down(7) is None
    assert not wires.wire("pipe-1", 7)
    assert len(wires) == 0


def test_a_reused_descriptor_belongs_to_the_new_connection() -> None:
    # libzmq reports the old connection's end before the number can be reused, and the
    # new connection before any message of it: in that order, nothing is mixed up.
    wires = Wires()
    wires.up(7)
    wires.wire("pipe-1", 7)
    assert wires.down(7) == "pipe-1"
    wires.up(7)
    assert wires.wire("pipe-2", 7)
    assert wires.pipe_on(7) == "pipe-2"
    assert wires.down(7) == "pipe-2"


def test_a_pipe_heard_on_another_connection_moved() -> None:
    # The dialer reconnected under the same routing id: what the first connection
    # carried last may be lost, so the pipe counts as lost.
    wires = Wires()
    wires.up(7)
    wires.up(9)
    wires.wire("pipe-1", 7)
    assert wires.moved("pipe-1", 9)
    assert not wires.moved("pipe-2", 9)  # not tied: nothing to compare
    wires.drop("pipe-1")
    assert wires.pipe_on(7) is None
    assert wires.live(7)
