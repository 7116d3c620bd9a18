"""The observer hooks of the client and the engine, in one process, on both backends."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from tensorrpc import _observe
from tensorrpc._client import Client
from tensorrpc._exceptions import (
    CallTimeoutError,
    EngineDeadError,
    EngineNotFoundError,
    ErrorCode,
    RemoteError,
    error_from_wire,
)
from tensorrpc._observe import CallObservation, Observer
from tensorrpc._server import Server

from ..integration.services import Calculator

TRACE = b"\x00" + bytes(range(1, 26))


class _Call(CallObservation):
    __slots__ = ("events", "owner", "trace")

    def __init__(self, owner: Recorder, events: list[tuple[Any, ...]], trace: bytes = b"") -> None:
        self.owner = owner
        self.events = events
        self.trace = trace

    def trace_context(self) -> bytes:
        return self.trace

    def started(self) -> None:
        self.events.append(("started",))

    def item(self) -> None:
        self.events.append(("item",))

    def error(self, code: str) -> None:
        self.events.append(("error", code))

    def finished(self, outcome: str, nbytes: int) -> None:
        self.events.append(("finished", outcome, nbytes > 0))
        self.owner.changed()


class Recorder(Observer):
    """Remembers every hook call."""

    __slots__ = ("_changed", "calls", "events", "opened_targets", "trace")

    def __init__(self, trace: bytes = b"") -> None:
        self.events: list[tuple[Any, ...]] = []
        self.calls: list[list[tuple[Any, ...]]] = []
        self.opened_targets: list[Any] = []
        self.trace = trace
        self._changed: anyio.Event | None = None

    def changed(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait (bounded by the caller's scope) until ``predicate()`` holds."""
        while not predicate():
            self._changed = anyio.Event()
            await self._changed.wait()

    def opened(self, target: Any) -> None:
        self.opened_targets.append(target)

    def closed(self, target: Any) -> None:
        self.opened_targets.remove(target)

    def client_call(
        self, service: str, method: str, engine: str, stream: bool, nbytes: int, transport: str
    ) -> CallObservation | None:
        events: list[tuple[Any, ...]] = [("client", method, engine, stream, nbytes > 0)]
        self.calls.append(events)
        return _Call(self, events, self.trace)

    def engine_call(
        self,
        service: str,
        method: str,
        engine: str,
        client: str,
        stream: bool,
        trace: bytes,
        nbytes: int,
    ) -> CallObservation | None:
        events: list[tuple[Any, ...]] = [("engine", method, engine, client, stream, trace)]
        self.calls.append(events)
        return _Call(self, events)

    def engine_event(self, client: str, engine: str, event: str) -> None:
        self.events.append((client, engine, event))
        self.changed()

    def heartbeat(self, client: str, engine: str, rtt: float) -> None:
        assert 0 <= rtt < 60
        self.events.append(("heartbeat", engine))
        self.changed()


@contextlib.asynccontextmanager
async def pair(
    tmp_path: Path, client_observer: Observer | None, engine_observer: Observer | None
) -> AsyncIterator[tuple[Client[Calculator], Server]]:
    async with (
        Server(
            Calculator("e1"),
            bind=f"ipc://{tmp_path}/e1.sock",
            engine_id="e1",
            observer=engine_observer,
            grace_period=0.5,
        ) as server,
        Client(
            Calculator,
            connect=server.endpoint,
            client_id="c1",
            observer=client_observer,
            heartbeat_interval=0.05,
        ) as client,
    ):
        with anyio.fail_after(10):
            await client.wait_for_engines(1)
        yield client, server


async def test_client_and_engine_hooks_see_a_unary_call_an_error_and_a_stream(
    tmp_path: Path,
) -> None:
    client_obs, engine_obs = Recorder(TRACE), Recorder()
    async with pair(tmp_path, client_obs, engine_obs) as (client, server):
        assert client_obs.opened_targets == [client]
        assert engine_obs.opened_targets == [server]
        stub = client.stub()
        with anyio.fail_after(10):
            assert await stub.add(2, 3) == 5
            with pytest.raises(RemoteError):
                await stub.fail("boom")
            assert [i async for i in stub.count(3)] == [0, 1, 2]
            # the engine's side of the last call ends when its worker lets go of it
            await engine_obs.wait_for(
                lambda: len(engine_obs.calls) == 3 and engine_obs.calls[-1][-1][0] == "finished"
            )
            await client_obs.wait_for(lambda: ("heartbeat", "e1") in client_obs.events)
    assert client_obs.opened_targets == []
    assert engine_obs.opened_targets == []
    add, fail, count = client_obs.calls
    assert add == [("client", "add", "e1", False, True), ("finished", "ok", True)]
    assert fail == [("client", "fail", "e1", False, True), ("finished", "REMOTE", True)]
    assert count == [
        ("client", "count", "e1", True, True),
        *[("item",)] * 3,
        ("finished", "ok", False),
    ]
    e_add, e_fail, e_count = engine_obs.calls
    # the client's trace context reached the engine
    assert e_add == [
        ("engine", "add", "e1", "c1", False, TRACE),
        ("started",),
        ("finished", "ok", False),
    ]
    assert e_fail == [
        ("engine", "fail", "e1", "c1", False, TRACE),
        ("started",),
        ("error", "REMOTE"),
        ("finished", "ok", False),
    ]
    assert e_count[0] == ("engine", "count", "e1", "c1", True, TRACE)
    assert e_count[1:] == [("started",), *[("item",)] * 3, ("finished", "ok", False)]
    assert ("c1", "e1", "joined") in client_obs.events
    assert client_obs.events.index(("c1", "e1", "joined")) < client_obs.events.index(
        ("heartbeat", "e1")
    )


async def test_a_stream_closed_early_and_a_lost_engine_are_observed(tmp_path: Path) -> None:
    client_obs = Recorder()
    async with pair(tmp_path, client_obs, None) as (client, server):
        with anyio.fail_after(10):
            async with client.stream(Calculator.forever, "t") as stream:
                async for item in stream:
                    if item == 2:
                        break
            await server.aclose()
            await client_obs.wait_for(lambda: ("c1", "e1", "lost") in client_obs.events)
    (forever,) = client_obs.calls
    assert forever[0] == ("client", "forever", "e1", True, True)
    assert forever[-1] == ("finished", "ok", False)
    assert forever.count(("finished", "ok", False)) == 1


async def test_without_an_observer_calls_carry_no_trace_context(tmp_path: Path) -> None:
    engine_obs = Recorder()
    async with pair(tmp_path, None, engine_obs) as (client, _):
        with anyio.fail_after(10):
            assert await client.stub().add(1) == 2
    ((first, *_),) = engine_obs.calls
    assert first == ("engine", "add", "e1", "c1", False, b"")


def test_resolve_combines_installed_and_given_observers() -> None:
    a, b = Recorder(), Recorder()
    assert _observe.resolve(None) is None
    assert _observe.resolve(a) is a
    _observe.install(b)
    try:
        combined = _observe.resolve([a, a])
        assert isinstance(combined, Observer)
        assert combined.members == (b, a)  # type: ignore[attr-defined]
        call = combined.client_call("S", "m", "e", False, 1, "inline")
        assert call is not None
        call.finished("ok", 3)
        assert a.calls[0][-1] == ("finished", "ok", True)
        assert b.calls[0][-1] == ("finished", "ok", True)
    finally:
        _observe.uninstall(b)
    assert _observe.installed() == ()
    with pytest.raises(TypeError, match="Observer"):
        _observe.resolve([object()])  # type: ignore[list-item]


def test_outcome_labels() -> None:
    assert _observe.outcome_of(None) == "ok"
    assert _observe.outcome_of(KeyboardInterrupt()) == "cancelled"
    assert _observe.outcome_of(ValueError("x")) == "INTERNAL"
    # The engine's labels: the client names each error that an ERROR reply becomes (and
    # its own deadline) by the same code, so both sides of one call agree.
    for code in ErrorCode:
        exc = error_from_wire(int(code), "T", "m", "")
        assert _observe.outcome_of(exc) == code.name, code
    assert _observe.outcome_of(CallTimeoutError("local deadline")) == "DEADLINE_EXCEEDED"
    assert _observe.outcome_of(EngineDeadError("x")) == "UNAVAILABLE"
    assert _observe.outcome_of(EngineNotFoundError("x")) == "UNAVAILABLE"


async def test_an_engine_that_comes_back_under_its_id_is_observed_as_rejoined(
    tmp_path: Path,
) -> None:
    client_obs = Recorder()
    address = f"ipc://{tmp_path}/e1.sock"
    async with Client(
        Calculator, connect=address, client_id="c1", observer=client_obs, heartbeat_interval=0.05
    ) as client:
        with anyio.fail_after(20):
            async with Server(Calculator("e1"), bind=address, engine_id="e1", grace_period=0.5):
                await client.wait_for_engines(1)
            await client_obs.wait_for(lambda: ("c1", "e1", "lost") in client_obs.events)
            async with Server(Calculator("e1"), bind=address, engine_id="e1", grace_period=0.5):
                await client_obs.wait_for(lambda: ("c1", "e1", "rejoined") in client_obs.events)
                assert await client.stub().add(1) == 2
    joins = [e for e in client_obs.events if e[0] == "c1"]
    # (a last "lost" may or may not arrive before the client closes)
    assert joins[:3] == [("c1", "e1", "joined"), ("c1", "e1", "lost"), ("c1", "e1", "rejoined")]
