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

Whether the peer "can take it" is decided at the handshake from what the *kernel* says
about the connection, never from what a message claims (docs/security.md): the shell
passes the `KernelPeer` of the handshake message (``ipc://``: the connection's
credentials, pinned by a pidfd) to `TransportPolicy.attest`. Only an attested peer gets
tensors by handle or a resolver, and a message's handles are resolved only when the
message came on the attested connection (its ``Peer-Address``); any other handle is
refused without a word about files or descriptors. Over tcp (loopback too) the kernel
attests nothing: torch_shm is off unless ``trust_unattested`` is set here (and on the
peer), which takes the peer's claimed pid on trust.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

from tensorrpc._exceptions import TensorTransportError
from tensorrpc._lazy import LazyModule
from tensorrpc.transports._peer import (
    ALIAS_SETTINGS,
    UNSEALED_OFFER,
    AliasSetting,
    KernelPeer,
    PeerFacts,
    ShmTerms,
    alias_gate,
    shm_terms,
)
from tensorrpc.transports.torch_shm import (
    TRANSPORT_NAME,
    ShmPlacer,
    ShmResolver,
    TorchShmStatistics,
    TorchShmTransport,
    _unpack,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Sequence

    import torch
    from typing_extensions import Buffer

    from tensorrpc.transports._shm_holds import Holds
else:
    torch = LazyModule("torch", globals())

__all__ = [
    "DEFAULT_SHM_THRESHOLD",
    "TRANSPORTS",
    "UNSEALED_OFFER",
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


class _Link:
    """torch_shm with one attested peer: who the kernel says it is, what we map of it."""

    __slots__ = ("kernel", "unsealed")

    def __init__(self, kernel: KernelPeer, unsealed: bool) -> None:
        self.kernel = kernel
        self.unsealed = unsealed


def _no_address(_frame: object) -> str:
    return ""


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

    __slots__ = ("_frame", "_hold", "_keep", "_peer", "_policy", "inner")

    def __init__(
        self, policy: TransportPolicy, peer: Hashable, frame: object, hold: Hashable, keep: Hashable
    ) -> None:
        self._policy = policy
        self._peer = peer
        self._frame = frame
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
            made = self._policy.resolver(
                self._peer, frame=self._frame, hold=self._hold, keep=self._keep
            )
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
        alias_unsealed: ``"same-user"``: tensors in torch's own shared memory go by alias
            to and from a peer that passes the unsealed-alias gate (`alias_gate`);
            ``"never"``: they are always copied through the sealed pool.
        trust_unattested: Use torch_shm with peers the kernel cannot attest (tcp://,
            loopback included), taking the pid they claim on trust. Off by default; see
            docs/security.md before turning it on.
        message_address: Reads a received frame's ``Peer-Address`` (the shell's; "" when
            none). Handles are resolved only from messages on the attested connection.
    """

    def __init__(
        self,
        *,
        torch_shm: bool = True,
        shm_threshold: int = DEFAULT_SHM_THRESHOLD,
        alias_unsealed: AliasSetting = "same-user",
        trust_unattested: bool = False,
        message_address: Callable[[object], str] | None = None,
    ):
        if shm_threshold < 0:
            raise ValueError("shm_threshold must not be negative")
        if alias_unsealed not in ALIAS_SETTINGS:
            raise ValueError(f"shm_alias_unsealed must be one of {sorted(ALIAS_SETTINGS)}")
        self.alias_unsealed: AliasSetting = alias_unsealed
        self.trust_unattested = trust_unattested
        self._message_address = message_address or _no_address
        self.shm: TorchShmTransport | None = None
        if torch_shm and TorchShmTransport.available():
            self.shm = TorchShmTransport()
        self.shm_threshold = shm_threshold
        #: The leases our received tensors hold (``holds.ready``: some are releasable);
        #: None without torch_shm.
        self.holds: Holds | None = self.shm.holds if self.shm is not None else None
        self._links: dict[Hashable, _Link] = {}
        self._frames = [0, 0, 0, 0]
        self._fallbacks = 0

    # -- handshake -------------------------------------------------------------------------

    def offered(self) -> tuple[str, ...]:
        """Transports this endpoint can receive (for HELLO / WELCOME)."""
        if self.shm is None:
            return ("frames",)
        if self.alias_unsealed == "never":
            return ("frames", TRANSPORT_NAME)
        return ("frames", TRANSPORT_NAME, UNSEALED_OFFER)

    def facts(self, kernel: KernelPeer | None) -> PeerFacts | None:
        """What we know of the sender of a handshake message, for `shm_terms`: the shell
        passes what the kernel says sent it (``peer_credentials``; None: it cannot say,
        tcp); this reads the unsealed-alias gate from ``/proc``.

        The pidfd in ``kernel`` is ours from here on: `link` keeps it, `settle` closes it
        when no link took it.

        Returns:
            None when torch_shm is off here, or the message came from ourselves.
        """
        if self.shm is None or (kernel is not None and kernel.pid == os.getpid()):
            if kernel is not None:
                kernel.close()
            return None
        if kernel is None:
            return PeerFacts(None, os.getpid())
        gate = alias_gate(kernel) if self.alias_unsealed == "same-user" else (False, False)
        return PeerFacts(kernel, os.getpid(), gate, kernel.uid in (0, os.geteuid()))

    def link(self, peer: Hashable, terms: ShmTerms | None) -> None:
        """torch_shm with ``peer`` is what its handshake decided (None: off): its handles
        resolve against ``terms.kernel`` from now on, and only from messages on that
        connection."""
        self._drop_link(peer)
        shm = self.shm
        if shm is None or terms is None:
            return
        kernel = terms.kernel
        links = self._links
        while len(links) >= MAX_LINKS:
            self._drop_link(next(iter(links)))  # the oldest handshake state goes first
        if not any(link.kernel.key == kernel.key for link in links.values()):
            # A process new to us under this pid: mappings kept for an earlier process
            # with the same pid must not serve its handles.
            shm.forget_peer(kernel.pid)
        links[peer] = _Link(kernel, terms.unsealed_in)
        shm.set_peer(peer, process=kernel.key, alias_unsealed=terms.unsealed_out)

    def settle(self, peer: Hashable, facts: PeerFacts | None) -> None:
        """The handshake message ``facts`` came with is handled: close its pidfd unless
        ``peer``'s link took it."""
        kernel = facts.kernel if facts is not None else None
        if kernel is not None:
            link = self._links.get(peer)
            if link is None or link.kernel is not kernel:
                kernel.close()

    def attest(
        self,
        peer: Hashable,
        kernel: KernelPeer | None,
        *,
        offers: Sequence[str],
        claimed_pid: int = 0,
        same_host: bool = False,
    ) -> tuple[int, bool, bool]:
        """Decide torch_shm with ``peer`` from its handshake message and link it (`facts`,
        `shm_terms`, `link`, `settle` in one; for a shell whose machine asks after the
        handshake: the engine's).

        Returns:
            ``(pid, we send handles, we resolve handles)``: the peer's pid as the kernel
            says (or, trusted, as it claims); `NO_SHM` when torch_shm is off with it.
        """
        facts = self.facts(kernel)
        terms = shm_terms(
            facts, offers, claimed_pid, same_host, trust_unattested=self.trust_unattested
        )
        self.link(peer, terms)
        self.settle(peer, facts)
        return NO_SHM if terms is None else (terms.pid, terms.send, True)

    def _drop_link(self, peer: Hashable) -> None:
        link = self._links.pop(peer, None)
        if link is not None:
            link.kernel.close()

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
        if shm is None or not peer_receives:
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
        self,
        peer: Hashable,
        *,
        frame: object = None,
        hold: Hashable = None,
        keep: Hashable = None,
    ) -> ShmResolver | None:
        """A resolver for handles in a message from ``peer``, resolved against the
        process the kernel attested for it at the handshake.

        ``frame`` is a frame of the message: unless the peer was trusted unattested, its
        ``Peer-Address`` must be the attested connection's (a connection that took over
        the peer's routing id does not inherit the attestation).

        With ``hold`` (the peer's key) pool tensors are built on the peer's regions (one
        copy in all) and their leases go back once the tensors die: RELEASE what
        `releasable` returns. With ``keep`` (a message's key, a tuple starting with the
        peer's key) they are built on the regions too, and `detach` must run before the
        peer may reuse them (an engine: before its first reply to the call).

        Returns:
            None when torch_shm is off here; a resolver that refuses every handle (a
            ``TensorTransportError`` naming no file) when the peer is not attested or
            the message came on another connection.
        """
        shm = self.shm
        if shm is None:
            return None
        link = self._links.get(peer)
        if link is None:
            return shm.refusing_resolver()
        kernel = link.kernel
        if kernel.attested and self._message_address(frame) != kernel.address:
            return shm.refusing_resolver()
        try:
            return shm.resolver(
                kernel.pid,
                hold=hold,
                keep=keep,
                peer=kernel if kernel.attested else None,
                unsealed=link.unsealed,
            )
        except TensorTransportError:
            return shm.refusing_resolver()

    def lazy_resolver(
        self, peer: Hashable, *, frame: object = None, hold: Hashable = None, keep: Hashable = None
    ) -> LazyResolver | None:
        """As `resolver`, made on the message's first handle (None: torch_shm is off)."""
        if self.shm is None:
            return None
        return LazyResolver(self, peer, frame, hold, keep)

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

    def peer_gone(self, peer: Hashable, pid: int = 0) -> None:
        """The peer died or left: drop its leases and unmap its segments (``pid``: the
        pid it had; default: the attested one)."""
        link = self._links.get(peer)
        if link is not None and pid <= 0:
            pid = link.kernel.pid
        self._drop_link(peer)
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
        for peer in list(self._links):
            self._drop_link(peer)
        if self.shm is not None:
            self.shm.close()
