"""A hypothesis state machine over ClientProtocol: random calls, replies, cancels, credit,
pings, deaths and restarts, checking the call table's invariants after every step."""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tensorrpc._calls import Call, CallState
from tensorrpc._client_events import EngineLost
from tensorrpc._exceptions import EngineDeadError
from tensorrpc._protocol import MessageKind

from .client_script import bye, control, end, error, hello, make_protocol, result

K = MessageKind
ENGINES = ("e0", "e1", "e2")
REPLY_KINDS = (K.RESULT, K.ERROR, K.STREAM_ITEM, K.STREAM_END)


class ClientMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.protocol = make_protocol(stream_window=3, max_in_flight=4)
        self.now = 0.0
        self.epochs = dict.fromkeys(ENGINES, 1)
        self.calls: list[Call] = []
        self.ends: dict[int, int] = {}  # call id -> times seen ending
        self.final_replies: dict[int, int] = {}
        self.ended_at_send: set[int] = set()
        self.dead_engines_seen: list[EngineLost] = []
        self.final_states: dict[int, CallState] = {}

    # -- helpers ---------------------------------------------------------------------------

    def peer(self, engine_id: str) -> bytes:
        return f"{engine_id}/{self.epochs[engine_id]}".encode()

    def observe(self) -> None:
        for ev in self.protocol.next_events():
            if isinstance(ev, EngineLost):
                self.dead_engines_seen.append(ev)
        self.check_sent()

    def check_sent(self) -> None:
        for _peer, frames in self.protocol.frames_to_send():
            out = sent_one(frames)
            if out is None:
                continue
            kind, call_id = out
            if kind is K.CREDIT:
                assert call_id not in self.ended_at_send, "CREDIT after the call ended"
            if kind is K.CANCEL:
                assert call_id not in self.ended_at_send, "a second CANCEL"
                self.ended_at_send.add(call_id)
        for call in self.calls:
            if call.ended:
                self.ended_at_send.add(call.call_id)

    # -- rules -----------------------------------------------------------------------------

    @rule(engine_id=st.sampled_from(ENGINES), restart=st.booleans())
    def hello(self, engine_id: str, restart: bool) -> None:
        if restart:
            self.epochs[engine_id] += 1
        peer = self.peer(engine_id)
        self.protocol.receive(peer, hello(engine_id, epoch=self.epochs[engine_id]), self.now)
        self.observe()

    @rule(engine_id=st.sampled_from(ENGINES), stream=st.booleans())
    def start(self, engine_id: str, stream: bool) -> None:
        engine = self.protocol.engines.engines.get(engine_id)
        if engine is None or engine.in_flight >= 4:
            return
        from .client_script import ADD, COUNT

        call = self.protocol.start_call(
            engine, COUNT if stream else ADD, None, stream=stream, now=self.now, payload=b"\x90"
        )
        self.calls.append(call)

    @precondition(lambda self: self.calls)
    @rule(data=st.data(), kind=st.sampled_from(REPLY_KINDS), foreign=st.booleans())
    def reply(self, data: st.DataObject, kind: MessageKind, foreign: bool) -> None:
        call = data.draw(st.sampled_from(self.calls))
        engine_id = call.engine.engine_id
        if foreign:
            engine_id = data.draw(st.sampled_from(ENGINES))
        peer = self.peer(engine_id)
        was_ended = call.ended
        if kind is K.RESULT or kind is K.STREAM_ITEM:
            frames = result(call.call_id, 1, kind)
        elif kind is K.ERROR:
            frames = error(call.call_id)
        else:
            frames = end(call.call_id)
        self.protocol.receive(peer, frames, self.now)
        if not was_ended and call.ended and call.state is CallState.REPLIED:
            self.final_replies[call.call_id] = self.final_replies.get(call.call_id, 0) + 1
        self.observe()

    @precondition(lambda self: any(c.stream and not c.ended for c in self.calls))
    @rule(data=st.data(), n=st.integers(1, 6))
    def stream_items(self, data: st.DataObject, n: int) -> None:
        call = data.draw(st.sampled_from([c for c in self.calls if c.stream and not c.ended]))
        peer = self.peer(call.engine.engine_id)
        for i in range(n):
            self.protocol.receive(peer, result(call.call_id, i, K.STREAM_ITEM), self.now)
        self.observe()

    @precondition(lambda self: self.calls)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        call = data.draw(st.sampled_from(self.calls))
        self.protocol.cancel(call, self.now)
        self.observe()

    @precondition(lambda self: any(c.items for c in self.calls))
    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        call = data.draw(st.sampled_from([c for c in self.calls if c.items]))
        self.protocol.take_item(call, self.now)
        self.observe()

    @rule(engine_id=st.sampled_from(ENGINES), nonce=st.integers(0, 2**64 - 1))
    def ping(self, engine_id: str, nonce: int) -> None:
        self.protocol.receive(self.peer(engine_id), control(K.PING, None, nonce), self.now)
        self.observe()

    @rule(engine_id=st.sampled_from(ENGINES))
    def bye(self, engine_id: str) -> None:
        self.protocol.receive(self.peer(engine_id), bye(), self.now)
        self.observe()

    @rule(dt=st.floats(0.0, 8.0))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.protocol.tick(self.now)
        self.observe()

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def in_flight_counts_equal_the_table(self) -> None:
        protocol = self.protocol
        live = [c for c in self.calls if not c.ended]
        assert len(protocol.calls) == len(live)
        total = sum(e.in_flight for e in protocol.engines.engines.values())
        assert total == len(live)
        for call in live:
            assert call.engine.alive
            assert protocol.calls.get(call.call_id) is call

    @invariant()
    def at_most_one_final_reply_per_call(self) -> None:
        assert all(n == 1 for n in self.final_replies.values())

    @invariant()
    def credit_is_never_negative(self) -> None:
        for call in self.calls:
            if call.credit is not None:
                assert call.credit.remaining >= 0

    @invariant()
    def a_call_ends_once_with_one_outcome(self) -> None:
        for call in self.calls:
            if call.ended:
                outcomes = (call.reply_kind is not None) + (call.error is not None)
                assert outcomes == (0 if call.state is CallState.CANCELLED else 1), call
                first = self.final_states.setdefault(call.call_id, call.state)
                assert first is call.state, "a call ended twice"

    @invariant()
    def no_call_outlives_its_engine(self) -> None:
        for lost in self.dead_engines_seen:
            for call in lost.calls:
                assert call.ended
                assert isinstance(call.error, EngineDeadError)
        for call in self.calls:
            if not call.engine.alive:
                assert call.ended


def sent_one(frames: list[bytes]) -> tuple[MessageKind, int] | None:
    from tensorrpc._protocol import split_frames

    header, _, _ = split_frames(frames)
    if header.kind in (K.CREDIT, K.CANCEL):
        return header.kind, header.call_id
    return None


ClientMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestClientMachine = ClientMachine.TestCase
