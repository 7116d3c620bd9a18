"""The client's sessions with engines, sans-I/O: handshakes (HELLO, WELCOME, REJECT,
duplicate engine ids) and endings (BYE on one or two connections, silence, a failed
send, a lost bulk connection).

Rules 1, 2 and 4 of `tensorrpc._client_protocol.ClientProtocol`, written as functions
of the machine (its handlers and methods).
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any, Final

from tensorrpc._client_events import (
    CheckReachable,
    Dial,
    EngineJoined,
    EngineLost,
    EngineRefused,
    Ignored,
    Peer,
    PeerState,
    Pong,
)
from tensorrpc._engines import (
    BYE_BULK,
    BYE_CONTROL,
    CONTROL_GONE,
    MAX_PAST,
    Engine,
    EngineInfo,
    ShmCapability,
    check_hello,
)
from tensorrpc._exceptions import RemoteProtocolError
from tensorrpc._liveness import ping_interval, to_ms
from tensorrpc._protocol import (
    PROTOCOL_VERSION,
    Bye,
    Header,
    Hello,
    MessageKind,
    Reject,
    Welcome,
    decode_control,
    header_version,
)
from tensorrpc.transports._peer import shm_terms

if TYPE_CHECKING:
    from collections.abc import Sequence

    from typing_extensions import Buffer

    from tensorrpc._client_events import Event
    from tensorrpc._client_protocol import ClientProtocol
    from tensorrpc.transports._peer import PeerFacts

__all__ = [
    "HEARTBEAT_NONCE",
    "HELLO_REQUEST",
    "bulk_bound",
    "bulk_lost",
    "declare_dead",
    "dial",
    "hello_request",
    "forgotten",
    "lose",
    "malformed",
    "on_bulk",
    "on_bye",
    "on_hello",
    "on_ping",
    "on_pong",
    "on_reject",
    "reachable",
    "send_failed",
    "undial",
    "welcome",
]

_HELLO: Final = MessageKind.HELLO
_REJECT: Final = MessageKind.REJECT
_PING: Final = MessageKind.PING
_BYE: Final = MessageKind.BYE
_PONG: Final = MessageKind.PONG
#: PING nonce 0 asks a listening engine to (re)send HELLO. Heartbeat PINGs carry the send
#: time in nanoseconds of the caller's clock (always > 1), so that a PONG tells the round
#: trip; `HEARTBEAT_NONCE` is the nonce of a reachability PING.
HELLO_REQUEST: Final = 0
HEARTBEAT_NONCE: Final = 1
#: What an `EngineInfo` takes from the HELLO (all but the address we dialled).
_INFO_FIELDS: Final = tuple(f.name for f in fields(EngineInfo) if f.name != "address")


def malformed(
    proto: ClientProtocol, peer: bytes, frames: Sequence[Buffer], exc: Exception, now: float
) -> Event:
    """Drop a malformed message; a HELLO of another version gets REJECT ``version``."""
    version = header_version(frames[0]) if frames else None
    first = memoryview(frames[0]) if frames else None
    if (
        version is not None
        and version != PROTOCOL_VERSION
        and first is not None
        and first.nbytes > 3
        and first[3] == _HELLO
    ):
        message = f"engine speaks protocol version {version}, client speaks {PROTOCOL_VERSION}"
        proto._queue(None, peer, _REJECT, Reject("version", message), 0, now)
        return EngineRefused(proto.address_of(peer) or repr(peer), "version", message, True)
    return Ignored(peer, f"malformed message: {exc}")


def on_hello(
    proto: ClientProtocol,
    peer: bytes,
    engine: Engine | None,
    header: Header,
    payload: Buffer,
    now: float,
    key: str | None,
    facts: PeerFacts | None,
) -> Event | None:
    try:
        hello = decode_control(header, payload)
    except RemoteProtocolError as exc:
        message = f"malformed HELLO: {exc}"
        proto._queue(None, peer, _REJECT, Reject("protocol", message[:4096]), 0, now)
        return Ignored(peer, message)
    assert isinstance(hello, Hello)
    previous = engine
    if previous is not None:
        if previous.engine_id == hello.engine_id and previous.epoch == hello.epoch:
            # A repeat: the engine may have missed our WELCOME; say the same again.
            welcome(proto, previous, now, previous.welcome_transports)
            return None
        why = (
            "was replaced by a new session at its address (its calls are lost)"
            if previous.engine_id == hello.engine_id
            else f"was replaced by engine {hello.engine_id!r} at its address"
        )
        proto._events.append(lose(proto, previous, why))
    info = EngineInfo(
        address=proto.address_of(peer), **{name: getattr(hello, name) for name in _INFO_FIELDS}
    )
    refusal = _check(proto, info) or _check_key(proto, info.engine_id, key)
    if refusal is None:
        current = proto.engines.engines.get(info.engine_id)
        if current is not None:  # the shell answers whether it is reachable
            return _check_reachable(proto, peer, hello, info, current, facts, now)
    return _decided(proto, peer, info, hello, refusal, now, facts)


def _check_reachable(
    proto: ClientProtocol,
    peer: bytes,
    hello: Hello,
    info: EngineInfo,
    current: Engine,
    facts: PeerFacts | None,
    now: float,
) -> CheckReachable:
    proto._queue(current, current.peer, _PING, None, HEARTBEAT_NONCE, now)
    return CheckReachable(current.peer, peer, hello, info, current, facts)


def reachable(proto: ClientProtocol, check: CheckReachable, reachable: bool, now: float) -> None:
    """The shell's answer to `CheckReachable`: the HELLO is refused as
    ``duplicate_id`` while the live engine is reachable, else that engine is lost and
    the new one admitted (the events follow in `next_events`)."""
    if proto.closed or proto.engine_at(check.hello_peer) is not None:
        return
    info = check.info
    current = proto.engines.engines.get(info.engine_id)
    refusal = None
    if current is not None and current is not check.current:  # changed meanwhile
        again = _check_reachable(
            proto, check.hello_peer, check.hello, info, current, check.facts, now
        )
        proto._events.append(again)
        return
    if current is not None:
        if reachable:
            refusal = (
                "duplicate_id",
                f"engine id {info.engine_id!r} is already served by a live engine "
                f"(pid {current.info.pid}); a restart may reuse it once that one is "
                "dead or gone",
            )
        else:
            proto._events.append(lose(proto, current, "is unreachable (its connection closed)"))
    event = _decided(proto, check.hello_peer, info, check.hello, refusal, now, check.facts)
    if event is not None:
        proto._events.append(event)


def _decided(
    proto: ClientProtocol,
    peer: bytes,
    info: EngineInfo,
    hello: Hello,
    refusal: tuple[str, str] | None,
    now: float,
    facts: PeerFacts | None,
) -> Event | None:
    if refusal is not None:
        reason, message = refusal
        proto.engines.refuse(info.engine_id, reason, message)
        proto._queue(None, peer, _REJECT, Reject(reason, message), 0, now)
        return EngineRefused(info.engine_id, reason, message, by_client=True)
    return _admit(proto, peer, info, hello, now, facts)


def _check_key(proto: ClientProtocol, engine_id: str, key: str | None) -> tuple[str, str] | None:
    """With ``engine_keys``: an id is taken only with the CURVE key bound to it."""
    keys = proto.config.engine_keys
    if keys is None:
        return None
    bound = keys.get(engine_id)
    if bound is None:
        return ("other", f"engine id {engine_id!r} is not bound to a key at this client")
    if key != bound:
        return ("other", f"engine id {engine_id!r} is bound to another CURVE key")
    return None


def _check(proto: ClientProtocol, info: EngineInfo) -> tuple[str, str] | None:
    config = proto.config
    return check_hello(
        info,
        service=info.service if config.schemaless else config.service,
        fingerprint=info.fingerprint if config.schemaless else config.fingerprint,
        protocol_version=PROTOCOL_VERSION,
        signatures=None if config.schemaless else config.signatures,
    )


def _admit(
    proto: ClientProtocol,
    peer: bytes,
    info: EngineInfo,
    hello: Hello,
    now: float,
    facts: PeerFacts | None,
) -> EngineJoined:
    heartbeat = proto.config.heartbeat
    engine = Engine(
        info=info,
        peer=peer,
        epoch=hello.epoch,
        client_epoch=proto._epochs(),
        heard=now,
        sent=now,
        ping_every=ping_interval(heartbeat.interval, info.dead_after_ms),
    )
    engine.next_ping = now + engine.ping_every
    config = proto.config
    limits = [n for n in (config.max_message_bytes, info.max_message_bytes) if n > 0]
    engine.frame_limit = min(limits, default=0)
    if config.bulk_address:
        engine.bulk_token = proto._tokens()
    engine.bulk_offer = (hello.bulk, hello.bulk_token)
    # torch_shm from the kernel's facts about the connection; the HELLO's pid and
    # host id count only for an unattested peer we were told to trust.
    terms = shm_terms(
        facts,
        hello.transports,
        hello.pid,
        hello.host_id == config.host_id,
        trust_unattested=config.shm_trust_unattested,
    )
    if terms is not None:
        engine.welcome_transports = config.shm_transports
        engine.shm = ShmCapability(pid=terms.pid, to_engine=terms.send, from_engine=True)
    seen = info.engine_id in proto.engines.past
    proto.counters.event(info.engine_id, "rejoined" if seen else "joined")
    proto.engines.add(engine)
    proto.rejoining.rejoined(info.engine_id)
    rec = proto._peers.get(peer)
    if rec is None:
        rec = proto._peers[peer] = Peer(PeerState.LIVE)
    rec.state = PeerState.LIVE
    rec.engine = engine
    if rec.dial is not None:
        rec.dial.backoff.reset()
    welcome(proto, engine, now, engine.welcome_transports)
    return EngineJoined(engine, terms)


def welcome(proto: ClientProtocol, engine: Engine, now: float, transports: tuple[str, ...]) -> None:
    """Queue our WELCOME of ``engine``'s session."""
    config = proto.config
    welcome = Welcome(
        client_id=config.client_id,
        host_id=config.host_id,
        transports=transports,
        heartbeat_ms=to_ms(config.heartbeat.interval),
        stream_window=config.stream_window,
        pid=config.pid,
        max_message_bytes=config.max_message_bytes,
        epoch=engine.client_epoch,
        dead_after_ms=to_ms(config.heartbeat.dead_after),
        fingerprint="" if config.schemaless else config.fingerprint,
        compression=config.compression,
        bulk=config.bulk_address if engine.bulk_token else "",
        bulk_token=engine.bulk_token.hex(),
    )
    proto._queue(engine, engine.peer, MessageKind.WELCOME, welcome, 0, now)


def on_reject(
    proto: ClientProtocol,
    peer: bytes,
    engine: Engine | None,
    header: Header,
    payload: Buffer,
    *rest: Any,
) -> Event:
    """A REJECT: the engine refused this client (a live one's session ends)."""
    try:
        body = decode_control(header, payload)
    except RemoteProtocolError as exc:
        body = Reject("other", f"malformed REJECT: {exc}")
    assert isinstance(body, Reject)
    who = engine.engine_id if engine is not None else proto.address_of(peer) or repr(peer)
    proto.engines.refuse(who, body.reason, body.message)
    if engine is not None:
        proto._events.append(lose(proto, engine, f"refused this client ({body.reason})"))
    return EngineRefused(who, body.reason, body.message, by_client=False)


def on_bye(proto: ClientProtocol, peer: bytes, engine: Engine | None, *rest: Any) -> Event | None:
    assert engine is not None
    return _bye(proto, engine, BYE_CONTROL)


def on_bulk(proto: ClientProtocol, engine: Engine, kind: MessageKind) -> Event | None:
    """A live session's bulk connection carried ``kind`` (not a RESULT)."""
    if kind is _BYE:
        return _bye(proto, engine, BYE_BULK)
    return Ignored(engine.peer, f"unexpected {kind.name} on the bulk connection")


def _bye(proto: ClientProtocol, engine: Engine, via: int) -> Event | None:
    """Rule 4 of the bulk connection: a draining engine says BYE on both of a
    session's connections, each behind what it sent there last; the session ends
    once both came (or the bulk connection is lost, or was never bound). Until then
    the engine takes no new calls."""
    engine.byes |= via
    if engine.bulk_bound and not (engine.byes & BYE_BULK and engine.byes & ~BYE_BULK):
        return None
    return lose(proto, engine, "said BYE")


def lose(proto: ClientProtocol, engine: Engine, why: str) -> EngineLost:
    proto.leases.engine_lost(engine)
    calls = proto.calls.fail_engine(engine, why)
    proto.engines.remove(engine)  # after the calls: its counters include their errors
    counters = proto.counters
    counters.event(engine.engine_id, "lost")
    if len(counters.engines) > 2 * MAX_PAST:  # keep those of the ids still reported
        table = proto.engines
        counters.prune({*table.past, *table.engines})
    rec = proto._peers.get(engine.peer)
    if rec is not None and rec.engine is engine:
        rec.engine = None
        if rec.dial is None:
            del proto._peers[engine.peer]
        else:
            rec.state = PeerState.DIALING
            rec.dial.due = 0.0  # ask the address for a HELLO again at once
    return EngineLost(engine, why, tuple(calls))


def forgotten(proto: ClientProtocol, engine: Engine, now: float) -> EngineLost:
    proto.rejoining.forgotten(engine.engine_id)
    return lose(
        proto,
        engine,
        f"lost this client's session: nothing was sent to it for {now - engine.sent:.1f} s, "
        f"longer than its bound ({engine.dead_after:g} s; did the client's event loop "
        "stall?)",
    )


def declare_dead(proto: ClientProtocol, engine_id: str, *, pid: int, reason: str) -> bool:
    """End the session of ``engine_id`` if its engine runs as process ``pid``
    (`EngineLost` in `next_events`); False: nothing happened.

    For supervisors that saw the process die before its heartbeats stopped.
    """
    engine = proto.engines.engines.get(engine_id)
    if engine is None or engine.info.pid != pid:
        return False
    proto._events.append(lose(proto, engine, reason))
    return True


def send_failed(proto: ClientProtocol, peer: bytes, now: float) -> None:
    """A send to ``peer`` failed because no connection to it exists (yet): its
    session ends (`EngineLost` in `next_events`), unless it said BYE already or a
    bound bulk connection has not yet carried its BYE (rule 4: that BYE, the bulk
    connection's loss or ``dead_after`` ends it); a dialled address is asked again
    after a backoff."""
    rec = proto._peers.get(peer)
    if rec is None:
        return
    engine = rec.engine
    if engine is not None:
        if engine.byes & BYE_CONTROL:  # (after its BYE, its control connection may go)
            return
        if engine.bulk_bound and not engine.byes & BYE_BULK:
            # Its control BYE may be queued unread behind the closed connection (rule
            # 4): the bulk connection's BYE or loss, or dead_after, ends the session.
            engine.byes |= CONTROL_GONE
            return
        said = engine.byes & BYE_BULK  # the bulk BYE came: this is the other end
        why = "said BYE" if said else "is unreachable (its connection closed)"
        proto._events.append(lose(proto, engine, why))
    elif rec.dial is not None:
        rec.dial.due = now + rec.dial.backoff.failed()


def _session_of(proto: ClientProtocol, peer: bytes, epoch: int, ours: bool) -> Engine | None:
    """The live session of ``peer`` whose epoch (ours, or the engine's) is ``epoch``."""
    rec = proto._peers.get(peer)
    engine = rec.engine if rec is not None else None
    if engine is None or epoch != (engine.client_epoch if ours else engine.epoch):
        return None
    return engine


def bulk_bound(proto: ClientProtocol, peer: bytes, epoch: int, *, ours: bool = False) -> None:
    """The bulk connection of ``peer``'s session of ``epoch`` (our WELCOME's epoch
    when ``ours``: the engine dialed our bulk endpoint; else its HELLO's) is bound: a
    BYE of that session comes on it too (rule 4)."""
    engine = _session_of(proto, peer, epoch, ours)
    if engine is not None:
        engine.bulk_bound = True


def bulk_lost(
    proto: ClientProtocol, peer: bytes, epoch: int, now: float, *, ours: bool = False
) -> None:
    """Rule 5 (docs/design.md, "a bulk connection per peer"): the bound bulk
    connection of ``peer``'s session of ``epoch`` (as in `bulk_bound`) broke while
    control may live. The session is over, as if control had broken: its calls fail
    with `EngineDeadError` at once (what they had on the bulk connection is lost
    with it), and a new session starts over control: we ask the engine for a HELLO
    (the address we dial), or (the engine dialed us) tell it BYE and ask for a new
    one (`EngineLost` in `next_events`). After the engine's BYE on control, the end of
    its bulk connection is the other BYE; after its BYE on the bulk connection, that
    connection's end is expected and the control BYE still ends the session (what
    control carried before it, a RESULT, is delivered). Nothing: that session is
    over already."""
    engine = _session_of(proto, peer, epoch, ours)
    if engine is None:
        return
    if engine.byes == BYE_BULK:
        return
    if engine.byes & BYE_CONTROL:
        proto._events.append(lose(proto, engine, "said BYE"))
        return
    if engine.byes & CONTROL_GONE:
        proto._events.append(lose(proto, engine, "is unreachable (its connections closed)"))
        return
    proto._events.append(lose(proto, engine, "lost its bulk connection"))
    if proto._peers.get(peer) is None:  # the engine dialed us: it ends its side, HELLOs anew
        proto._queue(None, peer, _BYE, Bye("lost the bulk connection"), 0, now)
        proto._queue(None, peer, _PING, None, HELLO_REQUEST, now)


# -- dialling and liveness ---------------------------------------------------------------


def dial(proto: ClientProtocol, alias: bytes, address: str, now: float) -> None:
    """An address was connected under routing id ``alias``: ask it for HELLO."""
    dial = Dial(address, proto.config.heartbeat.interval)
    proto._peers[alias] = Peer(PeerState.DIALING, dial)
    proto._dial_count += 1
    hello_request(proto, alias, dial, now)


def undial(proto: ClientProtocol, address: str) -> list[bytes]:
    """Stop asking ``address`` for HELLO; its live engine (if any) stays.

    Returns:
        The aliases that dialled it (empty: it was not dialled).
    """
    aliases = [
        alias
        for alias, rec in proto._peers.items()
        if rec.dial is not None and rec.dial.address == address
    ]
    for alias in aliases:
        rec = proto._peers[alias]
        rec.dial = None
        if rec.state is PeerState.DIALING:
            del proto._peers[alias]
    return aliases


def hello_request(proto: ClientProtocol, alias: bytes, dial: Dial, now: float) -> None:
    proto._queue(None, alias, _PING, None, HELLO_REQUEST, now)
    dial.due = now + proto.config.heartbeat.interval


def on_ping(
    proto: ClientProtocol, peer: bytes, engine: Engine | None, header: Header, *rest: Any
) -> Event | None:
    """A live engine's PING: PONG echoing its nonce."""
    assert engine is not None
    proto._queue(engine, peer, _PONG, None, header.call_id, rest[1])
    return None


def on_pong(
    proto: ClientProtocol, peer: bytes, engine: Engine | None, header: Header, *rest: Any
) -> Event | None:
    """A PONG: a heartbeat's tells the round trip (its nonce is when it was sent)."""
    if engine is not None and header.call_id > HEARTBEAT_NONCE:
        proto.counters.heartbeat(engine.engine_id, rest[1] - header.call_id / 1e9)
        return Pong(engine, header.call_id)
    return None
