"""A hypothesis state machine over a `ProtocolPair`: one client, one to three engines.

Random interleavings of calls, deliveries (in either direction, one message at a time),
engine replies, stream items, cancels, credit, pings, time passing (heartbeats, deaths
by silence), kills, freezes and restarts under the same id. After every step the
invariants of both machines hold:

- a call ends once, with one outcome;
- at most one final reply (RESULT, ERROR, STREAM_END) per call id goes on the wire;
- in-flight counts equal the sizes of the call tables, on both sides;
- credit is never negative, on both sides, and a stream never has more items sent than
  ``window + sum(CREDIT)``;
- nothing is sent for a call after it ended (the client's one CANCEL aside);
- no call is left without an outcome once its engine is declared dead.
"""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tensorrpc._calls import Call, CallState
from tensorrpc._client_events import EngineLost
from tensorrpc._exceptions import EngineDeadError, ErrorCode
from tensorrpc._protocol import MessageKind, encode_control
from tensorrpc._server_protocol import ServerCall

from .. import pair_work as work
from ..helpers import EngineEnd, ProtocolPair

K = MessageKind
FINAL = (K.RESULT, K.ERROR, K.STREAM_END)
WINDOW = 2


class PairMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pair = ProtocolPair(())
        self.calls: list[Call] = []
        self.ended: dict[int, CallState] = {}  # call id -> its final state, first seen
        self.final_replies: dict[int, int] = {}  # call id -> final replies on the wire
        self.items_sent: dict[int, int] = {}  # call id -> STREAM_ITEMs on the wire
        self.cancels: dict[int, int] = {}  # call id -> CANCELs the client sent
        self.seen_client = 0
        self.seen_engine: dict[EngineEnd, int] = {}  # engine process -> messages looked at
        self.taken: list[tuple[EngineEnd, ServerCall]] = []  # taken by a worker, not done

    @initialize(
        engines=st.integers(1, 3),
        dial_in=st.booleans(),
        short_engine_bound=st.booleans(),
    )
    def start(self, engines: int, dial_in: bool, short_engine_bound: bool) -> None:
        bound = (0.2, 1.0) if short_engine_bound else (1.0, 5.0)
        self.pair = ProtocolPair(
            [f"e{i}" for i in range(engines)],
            dial_in=dial_in,
            heartbeat_interval=0.5,
            dead_after=2.0,
            stream_window=WINDOW,
            max_in_flight=4,
            engine={
                "heartbeat_interval": bound[0],
                "dead_after": bound[1],
                "max_concurrency": 2,
                "max_queued": 1,
                "max_parked_streams": 2,
            },
        ).connect()
        self.check_wire()

    # -- bookkeeping ------------------------------------------------------------------------

    def ends(self) -> list[EngineEnd]:
        return list(self.pair.engines.values())

    def check_wire(self) -> None:
        """Look at every message sent since the last step."""
        pair = self.pair
        ended_before = dict(self.ended)
        for wire in pair.client_sent[self.seen_client :]:
            if wire.kind is K.CANCEL:
                self.cancels[wire.call_id] = self.cancels.get(wire.call_id, 0) + 1
                assert self.cancels[wire.call_id] == 1, "a second CANCEL"
            elif wire.kind is K.CREDIT:
                assert wire.call_id not in ended_before, "CREDIT for a call that had ended"
            elif wire.kind is K.CALL:
                assert wire.call_id not in ended_before, "CALL for a call that had ended"
        self.seen_client = len(pair.client_sent)
        for end in self.pair.peers.values():
            start = self.seen_engine.get(end, 0)
            for wire in end.sent[start:]:
                if wire.kind in FINAL and wire.call_id:
                    count = self.final_replies.get(wire.call_id, 0) + 1
                    self.final_replies[wire.call_id] = count
                    assert count == 1, f"two final replies for call {wire.call_id}"
                elif wire.kind is K.STREAM_ITEM:
                    assert not self.final_replies.get(wire.call_id), "an item after the end"
                    self.items_sent[wire.call_id] = self.items_sent.get(wire.call_id, 0) + 1
            self.seen_engine[end] = len(end.sent)
        for call in self.calls:
            if call.ended:
                first = self.ended.setdefault(call.call_id, call.state)
                assert first is call.state, f"{call!r} ended twice"

    def running(self, streaming: bool | None = None) -> list[tuple[EngineEnd, ServerCall]]:
        """Calls a worker of a live process took and is not done with."""
        return [
            (end, call)
            for end, call in self.taken
            if end.up and (streaming is None or call.spec.streaming == streaming)
        ]

    def done(self, end: EngineEnd, call: ServerCall) -> None:
        self.taken.remove((end, call))

    # -- the caller -------------------------------------------------------------------------

    @rule(stream=st.booleans(), data=st.data())
    def call(self, stream: bool, data: st.DataObject) -> None:
        pair = self.pair
        live = sorted(pair.client.engines.engines)
        if not live:
            return
        target = data.draw(st.sampled_from([None, *live]))
        if pair.client.select(target) is None:
            return
        if stream:
            self.calls.append(work.call(pair, "count", 50, engine=target))
        else:
            self.calls.append(work.call(pair, "add", 1, 2, engine=target))
        self.check_wire()

    @precondition(lambda self: any(not c.ended for c in self.calls))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        call = data.draw(st.sampled_from([c for c in self.calls if not c.ended]))
        assert work.cancel(self.pair, call)
        assert call.state is CallState.CANCELLED
        self.check_wire()

    @precondition(lambda self: any(c.items for c in self.calls))
    @rule(data=st.data())
    def take_item(self, data: st.DataObject) -> None:
        call = data.draw(st.sampled_from([c for c in self.calls if c.items]))
        assert isinstance(work.items(self.pair, call, 1)[0], int)
        self.check_wire()

    # -- the wire ---------------------------------------------------------------------------

    @rule(data=st.data(), n=st.integers(1, 4))
    def deliver_to_engine(self, data: st.DataObject, n: int) -> None:
        end = data.draw(st.sampled_from(self.ends()))
        for _ in range(n):
            self.pair.deliver_to_engine(end.name)
        self.check_wire()

    @rule(n=st.integers(1, 4))
    def deliver_to_client(self, n: int) -> None:
        for _ in range(n):
            self.pair.deliver_to_client()
        self.check_wire()

    @rule()
    def flush(self) -> None:
        self.pair.flush()
        self.check_wire()

    @rule(data=st.data(), nonce=st.sampled_from([0, 1, 77]))
    def ping_engine(self, data: st.DataObject, nonce: int) -> None:
        end = data.draw(st.sampled_from(self.ends()))
        end.inbox.append(encode_control(K.PING, None, nonce))
        self.check_wire()

    # -- the engines' workers ---------------------------------------------------------------

    @rule(data=st.data())
    def worker_takes(self, data: st.DataObject) -> None:
        end = data.draw(st.sampled_from(self.ends()))
        if end.up and (call := end.proto.next_call()) is not None:
            self.taken.append((end, call))
        self.check_wire()

    @precondition(lambda self: self.running(streaming=False))
    @rule(data=st.data(), outcome=st.sampled_from(["result", "raise", "deadline"]))
    def unary_returns(self, data: st.DataObject, outcome: str) -> None:
        end, call = data.draw(st.sampled_from(self.running(streaming=False)))
        gone = call.cancelled
        if outcome == "result":
            sent = work.reply(end, call, 3)
        elif outcome == "raise":
            sent = work.error(end, call, ErrorCode.REMOTE, "x", "builtins.ValueError")
        else:
            sent = work.error(end, call, ErrorCode.DEADLINE_EXCEEDED)
        assert not (gone and sent), "a reply for a cancelled call"
        self.done(end, call)
        self.check_wire()

    @precondition(lambda self: self.running(streaming=True))
    @rule(data=st.data(), n=st.integers(1, 5))
    def stream_yields(self, data: st.DataObject, n: int) -> None:
        end, call = data.draw(st.sampled_from(self.running(streaming=True)))
        if call.parked:
            return
        for i in range(n):
            allowed = end.proto.may_send_item(call)
            sent = work.item(end, call, i)
            assert sent == allowed
            assert not (sent and call.cancelled)
            if not sent and not call.cancelled and not call.answered:
                # out of credit: the stream parks (or is refused, as the shell does)
                reason = end.proto.park(call)
                if reason is not None:
                    work.error(end, call, ErrorCode.OVERLOADED, reason)
                    self.done(end, call)
                break
        self.check_wire()

    @precondition(lambda self: any(c.parked for _e, c in self.running(streaming=True)))
    @rule(data=st.data())
    def parked_stream_wakes(self, data: st.DataObject) -> None:
        end, call = data.draw(
            st.sampled_from([(e, c) for e, c in self.running(streaming=True) if c.parked])
        )
        if call.credits > 0 or call.cancelled:  # what the shell's wakeup would see
            end.proto.unpark(call)

    @precondition(lambda self: self.running(streaming=True))
    @rule(data=st.data(), error=st.booleans())
    def stream_finishes(self, data: st.DataObject, error: bool) -> None:
        end, call = data.draw(st.sampled_from(self.running(streaming=True)))
        if call.parked:
            end.proto.unpark(call)  # (cancelled or shut down while waiting for credit)
        gone = call.cancelled
        sent = (
            work.error(end, call, ErrorCode.REMOTE, "stream failed", "builtins.RuntimeError")
            if error
            else work.end_stream(end, call)
        )
        assert not (gone and sent)
        self.done(end, call)
        self.check_wire()

    # -- time and processes -----------------------------------------------------------------

    @rule(dt=st.sampled_from([0.05, 0.3, 1.5, 6.0]), deliver=st.booleans())
    def time_passes(self, dt: float, deliver: bool) -> None:
        self.pair.advance(dt, deliver=deliver)
        self.check_wire()

    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        data.draw(st.sampled_from(self.ends())).up = False
        self.check_wire()

    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        end = data.draw(st.sampled_from(self.ends()))
        end.up = False  # kill -9, then a new process under the same name
        self.pair.add_engine(end.name)
        self.check_wire()

    @rule(data=st.data(), frozen=st.booleans())
    def freeze(self, data: st.DataObject, frozen: bool) -> None:
        end = data.draw(st.sampled_from(self.ends()))
        if end.up:
            end.frozen = frozen

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def client_in_flight_counts_equal_the_table(self) -> None:
        client = self.pair.client
        live = [c for c in self.calls if not c.ended]
        assert len(client.calls) == len(live)
        assert sum(e.in_flight for e in client.engines.engines.values()) == len(live)
        for call in live:
            assert client.calls.get(call.call_id) is call
            assert call.call_id in call.engine.calls

    @invariant()
    def engine_in_flight_counts_equal_the_tables(self) -> None:
        for end in self.ends():
            proto = end.proto
            running = [c for e, c in self.taken if e is end]
            parked = [c for c in running if c.parked]
            assert proto.busy == len(running) - len(parked)
            assert proto.in_flight() == len(proto.queue) + len(running)
            taken = {id(c) for c in running} | {id(c) for c in proto.queue}
            for session in proto.sessions.values():
                for call_id, call in session.calls.items():
                    assert call.call_id == call_id
                    assert id(call) in taken, "a call in a session table nobody runs"

    @invariant()
    def credit_is_never_negative(self) -> None:
        for call in self.calls:
            if call.credit is not None:
                assert call.credit.remaining >= 0
                # the window inequality, counted on the wire
                assert self.items_sent.get(call.call_id, 0) <= WINDOW + call.credit.granted
        for _end, server_call in self.running(streaming=True):
            assert server_call.credits >= 0

    @invariant()
    def a_call_ends_once_with_one_outcome(self) -> None:
        for call in self.calls:
            if call.ended:
                outcomes = (call.reply_kind is not None) + (call.error is not None)
                assert outcomes == (0 if call.state is CallState.CANCELLED else 1), call
                assert self.ended[call.call_id] is call.state

    @invariant()
    def no_call_outlives_its_engine(self) -> None:
        for lost in self.pair.events:
            if isinstance(lost, EngineLost):
                for call in lost.calls:
                    assert call.state is CallState.FAILED
                    assert isinstance(call.error, EngineDeadError)
        for call in self.calls:
            if not call.engine.alive:
                assert call.ended, f"{call!r} outlived its engine"


PairMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPairMachine = PairMachine.TestCase
