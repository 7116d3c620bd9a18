"""torch_shm terms from kernel facts, sans-I/O: `shm_terms`, and the client machine taking
a HELLO's facts as an input of ``receive`` (it asks with `FactsNeeded`; no shell is
called back, and no other message costs the shell anything).

The facts are data: a `KernelPeer` here carries numbers the kernel would have given
(its pidfd is never touched by the machine), so no process or socket is involved.
"""

from __future__ import annotations

from tensorrpc._client_events import EngineJoined, FactsNeeded
from tensorrpc._protocol import MessageKind
from tensorrpc.transports._peer import UNSEALED_OFFER, KernelPeer, PeerFacts, shm_terms
from tensorrpc.transports.torch_shm import TRANSPORT_NAME
from tests.unit.client_script import feed, hello, make_protocol, sent

OURS = 1000
OFFERS = ("frames", TRANSPORT_NAME, UNSEALED_OFFER)
SHM_TRANSPORTS = ("frames", TRANSPORT_NAME)


def attested(pid: int = 4242, uid: int = 0) -> KernelPeer:
    return KernelPeer(pid, uid, 0, f"@:{uid}:0:{pid}", pidfd=10**6, ino=9)


def facts(kernel: KernelPeer | None, **kw: object) -> PeerFacts:
    return PeerFacts(kernel, OURS, **kw)  # type: ignore[arg-type]


def test_the_kernel_says_who_the_peer_is_whatever_it_claims() -> None:
    terms = shm_terms(facts(attested(), opens_ours=True), OFFERS, 7, True, trust_unattested=False)
    assert terms is not None
    assert (terms.pid, terms.send, terms.unsealed_in, terms.unsealed_out) == (
        4242,
        True,
        False,
        False,
    )


def test_without_facts_or_an_offer_torch_shm_is_off() -> None:
    assert shm_terms(None, OFFERS, 7, True, trust_unattested=True) is None
    assert shm_terms(facts(attested()), ("frames",), 7, True, trust_unattested=False) is None
    assert shm_terms(facts(attested(OURS)), OFFERS, 7, True, trust_unattested=False) is None


def test_an_unattested_peer_only_on_trust_and_on_our_host() -> None:
    assert shm_terms(facts(None), OFFERS, 7, True, trust_unattested=False) is None
    assert shm_terms(facts(None), OFFERS, 7, False, trust_unattested=True) is None
    assert shm_terms(facts(None), OFFERS, 0, True, trust_unattested=True) is None
    trusted = shm_terms(facts(None, unsealed=(True, True)), OFFERS, 7, True, trust_unattested=True)
    assert trusted is not None
    # Its claimed pid, no pidfd; it never maps torch's unsealed files either way.
    assert (trusted.pid, trusted.kernel.attested, trusted.send) == (7, False, True)
    assert (trusted.unsealed_in, trusted.unsealed_out) == (False, False)


def test_the_unsealed_gate_goes_out_only_where_the_peer_offered_it() -> None:
    gate = facts(attested(), unsealed=(True, True), opens_ours=False)
    offered = shm_terms(gate, OFFERS, 7, True, trust_unattested=False)
    assert offered is not None
    assert (offered.send, offered.unsealed_in, offered.unsealed_out) == (False, True, True)
    quiet = shm_terms(gate, ("frames", TRANSPORT_NAME), 7, True, trust_unattested=False)
    assert quiet is not None
    assert (quiet.unsealed_in, quiet.unsealed_out) == (True, False)


def test_the_client_machine_takes_a_hellos_facts_as_input() -> None:
    protocol = make_protocol(shm_transports=SHM_TRANSPORTS)
    kernel = attested()
    event = feed(
        protocol,
        b"e1/x",
        hello(transports=OFFERS, pid=7),
        0.0,
        facts=facts(kernel, opens_ours=True),
    )
    assert isinstance(event, EngineJoined)
    assert event.shm is not None
    assert event.shm.kernel is kernel
    shm = event.engine.shm
    assert shm is not None
    assert (shm.pid, shm.to_engine, shm.from_engine) == (4242, True, True)
    (welcome,) = [s for s in sent(protocol) if s.kind is MessageKind.WELCOME]
    assert tuple(welcome.body.transports) == SHM_TRANSPORTS


def test_a_hello_without_facts_asks_for_them_and_does_nothing_else() -> None:
    protocol = make_protocol(shm_transports=SHM_TRANSPORTS)
    event = feed(protocol, b"e1/x", hello(transports=OFFERS), 0.0)
    assert isinstance(event, FactsNeeded)
    assert (event.peer, event.key) == (b"e1/x", None)  # the shell gives it back with facts
    assert not protocol.pending
    assert not protocol.engines.engines


def test_a_hello_whose_facts_are_not_usable_gets_frames_only() -> None:
    protocol = make_protocol(shm_transports=SHM_TRANSPORTS)
    unusable = PeerFacts(None, OURS, usable=False)
    event = feed(protocol, b"e1/x", hello(transports=OFFERS), 0.0, facts=unusable)
    assert isinstance(event, EngineJoined)
    assert event.shm is None
    assert event.engine.shm is None
    (welcome,) = [s for s in sent(protocol) if s.kind is MessageKind.WELCOME]
    assert tuple(welcome.body.transports) == ("frames",)


def test_with_torch_shm_off_here_no_facts_are_asked_for() -> None:
    protocol = make_protocol()  # shm_transports: frames only
    assert isinstance(feed(protocol, b"e1/x", hello(transports=OFFERS), 0.0), EngineJoined)
