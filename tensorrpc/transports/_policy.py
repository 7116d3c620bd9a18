"""Which tensor transport a message uses, and the counters that say what happened.

One `TransportPolicy` per [`Client`][tensorrpc.Client] or engine
[`Server`][tensorrpc.Server] owns that endpoint's `TorchShmTransport` (when torch_shm
is enabled and the platform has it) and decides, per message and per tensor, where bytes
go:

* ``"frames"``: every tensor of at least ``CodecConfig.inline_threshold`` bytes travels in
  a ZMQ frame of its own (smaller ones ride inline in the payload).
* ``"torch_shm"``: every such tensor travels by shared-memory handle when the peer can take
  it; otherwise it goes as a frame and counts as a fallback.
* ``"auto"`` (default): ``torch_shm`` for tensors of at least ``shm_threshold`` bytes (and
  every CUDA tensor) when the peer can take it, frames otherwise. A tensor that torch_shm
  should have taken but could not (pool full, unsupported layout) counts as a fallback;
  a large tensor to a peer on another host is not a fallback, frames are the plan there.

Whether the peer "can take it" is decided at handshake, from what the peer *proved*, not
what it claimed (docs/protocol.md §8.1): same host id, the peer offers ``torch_shm``, and
it answered our fresh challenge with an HMAC keyed by the secret in its probe memfd, which
we read through ``/proc/<its pid>/fd``. Only a proven peer gets tensors by handle or a
resolver; any other peer's handles are refused without a word about files or descriptors.
The handshake methods here (`TransportPolicy.challenge`,
`TransportPolicy.welcome_fields`, `TransportPolicy.on_welcome`,
`TransportPolicy.on_proof`) are the calls the client and engine make.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

from tensorrpc._exceptions import TensorTransportError
from tensorrpc._lazy import LazyModule
from tensorrpc._protocol import Hello, Proof, Welcome
from tensorrpc.transports._shm_auth import CHALLENGE_BYTES, Role, ShmLink, decide, new_challenge
from tensorrpc.transports._shm_pool import pid as current_pid
from tensorrpc.transports.torch_shm import (
    TRANSPORT_NAME,
    ShmPlacer,
    ShmResolver,
    TorchShmStatistics,
    TorchShmTransport,
    _unpack,
)

if TYPE_CHECKING:
    from collections.abc import Hashable, Sequence

    import torch
    from typing_extensions import Buffer

    from tensorrpc.transports._shm_holds import Holds
else:
    torch = LazyModule("torch", globals())

__all__ = [
    "DEFAULT_SHM_THRESHOLD",
    "TRANSPORTS",
    "LazyResolver",
    "LeaseCollector",
    "PolicyPlacer",
    "TransportCounters",
    "TransportName",
    "TransportPolicy",
    "TransportStatistics",
]

logger = logging.getLogger("tensorrpc.transports")

#: Tensor transport names a call may ask for.
TransportName = Literal["auto", "frames", "torch_shm"]
#: The accepted values of [`TransportName`][tensorrpc.TransportName].
TRANSPORTS: Final = frozenset({"auto", "frames", "torch_shm"})
#: ``auto`` sends CPU tensors of at least this many bytes by torch_shm (see
#: docs/transports.md for the measurement behind it).
DEFAULT_SHM_THRESHOLD: Final = 64 << 10
#: Most peers with a torch_shm handshake state (the oldest is forgotten beyond it).
MAX_LINKS: Final = 4096
#: ``(pid, we send handles, we resolve handles)`` for a peer that may not use torch_shm.
NO_SHM: Final = (0, False, False)


class WelcomeShm:
    """The torch_shm fields of a WELCOME (see `TransportPolicy.welcome_fields`)."""

    __slots__ = ("challenge", "probe", "proof", "transports")

    def __init__(
        self, transports: tuple[str, ...], probe: bytes, challenge: bytes, proof: bytes
    ) -> None:
        #: Transports the client offers.
        self.transports = transports
        #: The client's probe handle.
        self.probe = probe
        #: The client's challenge for the engine (empty: expect no PROOF).
        self.challenge = challenge
        #: The client's answer to the HELLO's challenge.
        self.proof = proof


@dataclass(frozen=True, slots=True)
class TransportCounters:
    """Tensors and bytes one transport moved (out-of-band tensors only; inline ones are not
    counted)."""

    #: Tensors sent by this transport.
    tensors_sent: int = 0
    #: Bytes of those tensors.
    bytes_sent: int = 0
    #: Tensors received by this transport.
    tensors_received: int = 0
    #: Bytes of those tensors.
    bytes_received: int = 0
    #: Tensors meant for this transport that went as frames instead.
    fallbacks: int = 0


@dataclass(frozen=True, slots=True)
class TransportStatistics:
    """Per-transport counters of one client or engine (``statistics().transports``)."""

    #: ZMQ frames (out-of-band, zero-copy).
    frames: TransportCounters = TransportCounters()
    #: Shared memory by handle.
    torch_shm: TransportCounters = TransportCounters()
    #: Pool and lease gauges of the torch_shm transport; None when it is disabled.
    torch_shm_detail: TorchShmStatistics | None = None


class PolicyPlacer:
    """The codec's placer for one message: applies the policy, delegates to torch_shm.

    Made by `TransportPolicy.placer`; `lease` is the torch_shm lease to
    release when the peer confirms it attached (None: nothing went by handle). The
    torch_shm placer behind it is made on the first tensor that goes by handle, so a
    message without one costs the transport nothing.
    """

    __slots__ = (
        "_cuda_only",
        "_peer",
        "_policy",
        "_shm",
        "_threshold",
        "_to_shm",
        "placed",
        "placed_bytes",
    )

    def __init__(
        self,
        policy: TransportPolicy,
        peer: Hashable,
        threshold: int,
        *,
        to_shm: bool,
        cuda_only: bool,
    ) -> None:
        self._policy = policy
        self._peer = peer
        #: Whether tensors may go by torch_shm (False: frames only, the peer cannot attach).
        self._to_shm = to_shm
        self._shm: ShmPlacer | None = None
        self._threshold = threshold
        self._cuda_only = cuda_only
        #: Tensors (and their bytes) sent by handle through this placer.
        self.placed = 0
        self.placed_bytes = 0

    @property
    def lease(self) -> int | None:
        """The torch_shm lease of this message, or None when nothing went by handle."""
        return None if self._shm is None else self._shm.lease

    def outcome(self) -> tuple[int | None, tuple[int, int]]:
        """``(lease, (tensors, bytes))`` that went by handle through this placer."""
        return self.lease, (self.placed, self.placed_bytes)

    def place(self, tensor: torch.Tensor) -> tuple[str, bytes] | None:
        """Send ``tensor`` by torch_shm handle when the policy says so, else decline."""
        if not self._to_shm:
            if not self._cuda_only:
                self._policy._fallbacks += 1  # torch_shm was asked for, the peer cannot
            return None
        nbytes = tensor.nbytes
        if not tensor.is_cuda and (self._cuda_only or nbytes < self._threshold):
            return None
        shm = self._shm
        if shm is None:
            try:
                shm = self._shm = self._policy._shm_placer(self._peer)
            except TensorTransportError:  # closed: frames only, as without a placer
                self._to_shm = False
                self._cuda_only = True
                return None
        try:
            placed = shm.place(tensor)
        except TensorTransportError as exc:  # closed meanwhile: frames still work
            logger.debug("torch_shm declined a tensor: %s", exc)
            self._policy._fallbacks += 1
            return None
        if placed is not None:
            self.placed += 1
            self.placed_bytes += nbytes
        return placed

    def abort(self) -> None:
        """The message will not be sent: release what was placed."""
        if self._shm is not None:
            self._shm.abort()


class LazyResolver:
    """The codec's resolver for one message: the torch_shm resolver is made on the
    first handle, so a message without one costs the transport nothing.

    Made by `TransportPolicy.lazy_resolver`; `inner` is the resolver once made (the
    caller closes, releases or detaches what it resolved only then).
    """

    __slots__ = ("_hold", "_keep", "_peer_pid", "_policy", "inner")

    def __init__(
        self, policy: TransportPolicy, peer_pid: int, hold: Hashable, keep: Hashable
    ) -> None:
        self._policy = policy
        self._peer_pid = peer_pid
        self._hold = hold
        self._keep = keep
        #: The resolver made for the first handle (None: no handle so far).
        self.inner: ShmResolver | None = None

    def resolve(
        self, transport: str, handle: bytes, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """Resolve a handle with the message's resolver (made now if this is the first)."""
        inner = self.inner
        if inner is None:
            made = self._policy.resolver(self._peer_pid, hold=self._hold, keep=self._keep)
            assert made is not None  # made only while torch_shm is on (it stays on)
            inner = self.inner = made
        return inner.resolve(transport, handle, dtype, shape)


class LeaseCollector:
    """A resolver that only reads the lease ids of torch_shm handles, attaching nothing.

    For replies nobody will read (their call was cancelled or timed out): decoding them
    with this collector tells which leases to RELEASE, so the sender need not wait for its
    sweep. Every tensor comes back as a zero-filled stand-in.
    """

    __slots__ = ("leases",)

    def __init__(self) -> None:
        #: Lease ids seen, in order.
        self.leases: list[int] = []

    def resolve(
        self, transport: str, handle: bytes, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """Record the handle's lease id; return a stand-in of the right dtype and shape."""
        if transport == TRANSPORT_NAME:
            with contextlib.suppress(TensorTransportError):  # forged: nothing to release
                self.leases.append(_unpack(handle).lease)
        return torch.zeros((), dtype=dtype).expand(shape)


class TransportPolicy:
    """The tensor transports of one endpoint (client or engine).

    Args:
        torch_shm: Enable the torch_shm transport (ignored where the platform lacks it).
        shm_threshold: ``auto`` sends CPU tensors of at least this many bytes by torch_shm.
    """

    def __init__(self, *, torch_shm: bool = True, shm_threshold: int = DEFAULT_SHM_THRESHOLD):
        if shm_threshold < 0:
            raise ValueError("shm_threshold must not be negative")
        self.shm: TorchShmTransport | None = None
        if torch_shm and TorchShmTransport.available():
            self.shm = TorchShmTransport()
        self.shm_threshold = shm_threshold
        #: The leases our received tensors hold (``holds.ready``: some are releasable);
        #: None without torch_shm.
        self.holds: Holds | None = self.shm.holds if self.shm is not None else None
        self._probe: bytes | None = None
        self._links: dict[Hashable, ShmLink] = {}
        self._frames = [0, 0, 0, 0]
        self._fallbacks = 0

    # -- handshake -------------------------------------------------------------------------

    def offered(self) -> tuple[str, ...]:
        """Transports this endpoint can receive (for HELLO / WELCOME)."""
        return ("frames", TRANSPORT_NAME) if self.probe() else ("frames",)

    def probe(self) -> bytes:
        """Our torch_shm probe handle, or ``b""`` when torch_shm is off or failed."""
        if self._probe is None:
            self._probe = b""
            if self.shm is not None:
                try:
                    self._probe = self.shm.probe_handle()
                except TensorTransportError as exc:
                    logger.warning("torch_shm disabled: %s", exc)
        return self._probe

    def _link(self, peer: Hashable) -> ShmLink:
        links = self._links
        link = links.get(peer)
        if link is None:
            while len(links) >= MAX_LINKS:
                del links[next(iter(links))]  # the oldest handshake state goes first
            link = links[peer] = ShmLink(new_challenge())
        return link

    def _enabled(self) -> bool:
        return self.shm is not None and bool(self.probe())

    def _decide(
        self,
        link: ShmLink,
        *,
        our_host: str,
        claim: tuple[int, str, tuple[str, ...], bytes],
        proof: bytes,
        role: Role,
    ) -> tuple[int, bool, bool]:
        shm = self.shm
        pid, host, offers, probe = claim
        decide(
            link,
            enabled=shm is not None and self._enabled(),
            our_pid=os.getpid(),
            our_host=our_host,
            peer_pid=pid,
            peer_host=host,
            peer_offers=offers,
            probe=probe,
            proof=proof,
            peer_role=role,
            read_secret=shm.read_peer_secret if shm is not None else lambda _h: None,
        )
        return (link.pid, link.send, link.receive)

    def challenge(self, peer: Hashable) -> bytes:
        """Engine: the challenge for this client's HELLO (kept until the peer is gone)."""
        if not self._enabled():
            return b""
        return self._link(peer).challenge

    def welcome_fields(self, peer: Hashable, hello: Hello, *, our_host: str) -> WelcomeShm:
        """Client: the torch_shm fields of the WELCOME answering ``hello``.

        The proof is only computed for an engine on the same host that offers torch_shm
        with a challenge of the right size and a pid other than ours. Until
        `on_proof` the engine gets no handle and its handles are refused.
        """
        none = WelcomeShm(("frames",), b"", b"", b"")
        shm = self.shm
        if shm is None or not self._enabled():
            return none
        if (
            hello.host_id != our_host
            or TRANSPORT_NAME not in hello.transports
            or len(hello.challenge) != CHALLENGE_BYTES
            or not hello.probe
            or hello.pid in (0, os.getpid())
        ):
            return none
        link = self._links.get(peer)
        if link is None or link.peer_challenge != hello.challenge:
            self._links.pop(peer, None)
            link = self._link(peer)
            link.peer_challenge = hello.challenge
            link.claim = (hello.pid, hello.host_id, tuple(hello.transports), hello.probe)
        try:
            proof = shm.prove(Role.CLIENT, verifier_pid=hello.pid, challenge=hello.challenge)
        except TensorTransportError:
            return none
        return WelcomeShm(self.offered(), self.probe(), link.challenge, proof)

    def settled(self, peer: Hashable) -> tuple[int, bool, bool] | None:
        """Client: the engine's torch_shm state once its PROOF came, None while pending."""
        link = self._links.get(peer)
        if link is None or not link.settled:
            return None
        return (link.pid, link.send, link.receive)

    def on_welcome(
        self, peer: Hashable, welcome: Welcome, *, our_host: str, challenge: bytes | None = None
    ) -> tuple[tuple[int, bool, bool], Proof | None]:
        """Engine: decide torch_shm with a client from its WELCOME.

        ``challenge`` is the one our HELLO to this client carried (default: the one
        `challenge` made for ``peer``).

        Returns:
            ``((pid, send, receive), proof)``: the client's proven pid (0: not proven)
            and whether we send it handles and resolve its handles; the PROOF to send
            back (None when the WELCOME carried no challenge). The PROOF is empty unless
            the client's own proof verified.
        """
        link = self._link(peer)
        if challenge is not None:
            link.challenge = challenge
        claim = (welcome.pid, welcome.host_id, tuple(welcome.transports), welcome.probe)
        state = self._decide(
            link, our_host=our_host, claim=claim, proof=welcome.proof, role=Role.CLIENT
        )
        if not welcome.challenge:
            return state, None
        proof = b""
        shm = self.shm
        if link.proven and shm is not None and len(welcome.challenge) == CHALLENGE_BYTES:
            try:
                proof = shm.prove(Role.ENGINE, verifier_pid=link.pid, challenge=welcome.challenge)
            except TensorTransportError:
                proof = b""
        if not proof:
            link.pid = 0
            link.send = link.receive = False
            state = NO_SHM
        return state, Proof(proof)

    def on_proof(self, peer: Hashable, body: Proof, *, our_host: str) -> tuple[int, bool, bool]:
        """Client: decide torch_shm with an engine from its PROOF (answer to our WELCOME)."""
        link = self._links.get(peer)
        if link is None or link.claim is None or link.settled:
            return NO_SHM if link is None else (link.pid, link.send, link.receive)
        return self._decide(
            link, our_host=our_host, claim=link.claim, proof=body.proof, role=Role.ENGINE
        )

    # -- per message -----------------------------------------------------------------------

    def placer(self, mode: str, peer: Hashable, *, peer_receives: bool) -> PolicyPlacer | None:
        """The placer for one outgoing message, or None for frames only.

        Args:
            mode: ``"auto"``, ``"frames"`` or ``"torch_shm"``.
            peer: Who the message goes to (the torch_shm lease is made for this peer).
            peer_receives: The peer can attach to our torch_shm handles.
        """
        shm = self.shm
        if mode == "frames" or (mode == "auto" and shm is None):
            return None
        if shm is None or not peer_receives or not self._probe:
            # frames; an explicit torch_shm request counts each tensor as a fallback
            return PolicyPlacer(self, peer, 0, to_shm=False, cuda_only=mode != TRANSPORT_NAME)
        threshold = 0 if mode == TRANSPORT_NAME else self.shm_threshold
        return PolicyPlacer(self, peer, threshold, to_shm=True, cuda_only=False)

    def _shm_placer(self, peer: Hashable) -> ShmPlacer:
        """The torch_shm placer of a `PolicyPlacer` (made on its first tensor).

        Raises:
            TensorTransportError: the transport is closed.
        """
        shm = self.shm
        assert shm is not None  # a PolicyPlacer with a peer is made only with torch_shm
        return shm.placer(peer)

    def resolver(
        self, peer_pid: int, *, hold: Hashable = None, keep: Hashable = None
    ) -> ShmResolver | None:
        """A resolver for handles from the *proven* process ``peer_pid``.

        With ``hold`` (the peer's key) pool tensors are built on the peer's regions (one
        copy in all) and their leases go back once the tensors die: RELEASE what
        `releasable` returns. With ``keep`` (a message's key, a tuple starting with the
        peer's key) they are built on the regions too, and `detach` must run before the
        peer may reuse them (an engine: before its first reply to the call).

        Returns:
            None when torch_shm is off here; a resolver that refuses every handle (a
            ``TensorTransportError`` naming no file) when ``peer_pid`` is 0 (not proven)
            or our own pid.
        """
        shm = self.shm
        if shm is None:
            return None
        if peer_pid <= 0 or peer_pid == current_pid():  # (cached: no system call per message)
            return shm.refusing_resolver()
        try:
            return shm.resolver(peer_pid, hold=hold, keep=keep)
        except TensorTransportError:
            return shm.refusing_resolver()

    def lazy_resolver(
        self, peer_pid: int, *, hold: Hashable = None, keep: Hashable = None
    ) -> LazyResolver | None:
        """As `resolver`, made on the message's first handle (None: torch_shm is off)."""
        if self.shm is None:
            return None
        return LazyResolver(self, peer_pid, hold, keep)

    def releasable(self, peer: Hashable, resolver: ShmResolver | None = None) -> tuple[int, ...]:
        """Lease ids to RELEASE to ``peer`` now (``resolver``: a message just decoded).

        The leases of the tensors of ``peer`` that died since the last call, and those of
        ``resolver``'s message whose tensors are gone already, each once.
        """
        done = resolver.close() if resolver is not None else ()
        shm = self.shm
        more = shm.releasable(peer) if shm is not None else ()
        return tuple(dict.fromkeys(done + more)) if more else done

    def releasable_peers(self) -> list[Hashable]:
        """Peers (``hold`` keys) with leases to RELEASE: their tensors died since."""
        return self.shm.releasable_peers() if self.shm is not None else []

    def detach(self, keep: Hashable) -> None:
        """The peer takes back the regions of message ``keep``: copy what still uses them."""
        shm = self.shm
        if shm is not None:
            try:
                shm.detach(keep)
            except TensorTransportError as exc:  # pragma: no cover - out of memory
                logger.error("torch_shm: %s", exc)

    def sent_frames(self, buffers: Sequence[memoryview]) -> None:
        """Count the out-of-band frames of one sent message."""
        if buffers:
            counts = self._frames
            counts[0] += len(buffers)
            for buffer in buffers:
                counts[1] += buffer.nbytes

    def received_frames(self, buffers: Sequence[Buffer]) -> None:
        """Count the out-of-band frames of one received message."""
        if buffers:
            counts = self._frames
            counts[2] += len(buffers)
            for buffer in buffers:
                counts[3] += memoryview(buffer).nbytes

    def record_fallback(self, tensors: int, nbytes: int = 0) -> None:
        """Count tensors resent as frames after the peer could not attach to them."""
        if self.shm is not None:
            self.shm.record_fallback(tensors, nbytes)
        else:
            self._fallbacks += tensors

    # -- peers and housekeeping ------------------------------------------------------------

    def release(self, leases: Sequence[int], peer: Hashable) -> None:
        """The peer attached to the tensors of these leases: let their memory go."""
        shm = self.shm
        if shm is not None:
            for lease in leases:
                shm.release(lease, peer=peer)

    def release_one(self, lease: int | None) -> None:
        """Release one of our own leases (an argument lease the protocol says is done)."""
        if lease is not None and self.shm is not None:
            self.shm.release(lease)

    def refuse_release(self, count: int) -> None:
        """Count lease ids of a peer's RELEASE the protocol refused (``releases_refused``)."""
        if self.shm is not None:
            self.shm.refuse_release(count)

    def peer_gone(self, peer: Hashable, pid: int) -> None:
        """The peer died or left: drop its leases and unmap its segments."""
        self._links.pop(peer, None)
        shm = self.shm
        if shm is not None:
            shm.release_peer(peer)
            try:
                shm.forget_holds(peer)
            except TensorTransportError as exc:  # pragma: no cover - out of memory
                logger.error("torch_shm: %s", exc)
            if pid > 0:
                shm.forget_peer(pid)

    def disable_peer(self, peer: Hashable) -> None:
        """Stop sending torch_shm handles to ``peer`` (it failed to attach to one)."""
        if self.shm is not None:
            self.shm.disable_peer(peer)

    def sweep(self) -> None:
        """Drop leases older than the transport's lease timeout (a backstop)."""
        shm = self.shm
        if shm is not None:
            shm.sweep()

    def statistics(self) -> TransportStatistics:
        """A snapshot of the per-transport counters."""
        f = self._frames
        frames = TransportCounters(f[0], f[1], f[2], f[3], 0)
        detail = self.shm.statistics() if self.shm is not None else None
        if detail is None:
            shm = TransportCounters(fallbacks=self._fallbacks)
        else:
            shm = TransportCounters(
                detail.tensors_sent,
                detail.bytes_sent,
                detail.tensors_received,
                detail.bytes_received,
                detail.fallbacks + self._fallbacks,
            )
        return TransportStatistics(frames, shm, detail)

    def close(self) -> None:
        """Close the torch_shm transport (received tensors stay valid). Idempotent."""
        if self.shm is not None:
            self.shm.close()
