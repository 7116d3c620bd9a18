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

Whether the peer "can take it" was decided at its handshake from what the *kernel* says
about the connection (``policy.peers``, `tensorrpc.transports._links.PeerLinks`;
docs/security.md); what becomes of leases and mappings afterwards is ``policy.memory``
(`tensorrpc.transports._shm_memory.ShmMemory`). The policy itself only chooses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

from tensorrpc._exceptions import TensorTransportError
from tensorrpc.transports._links import PeerLinks
from tensorrpc.transports._peer import ALIAS_SETTINGS, UNSEALED_OFFER, AliasSetting
from tensorrpc.transports._shm_memory import ShmMemory
from tensorrpc.transports.torch_shm import (
    TRANSPORT_NAME,
    ShmPlacer,
    TorchShmStatistics,
    TorchShmTransport,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Sequence

    import torch
    from typing_extensions import Buffer

__all__ = [
    "DEFAULT_SHM_THRESHOLD",
    "TRANSPORTS",
    "UNSEALED_OFFER",
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
        self.shm: TorchShmTransport | None = None
        if torch_shm and TorchShmTransport.available():
            self.shm = TorchShmTransport()
        self.shm_threshold = shm_threshold
        #: Which process each peer is (its handshake's terms) and resolvers bound to it.
        self.peers = PeerLinks(
            self.shm,
            alias_unsealed=alias_unsealed,
            trust_unattested=trust_unattested,
            message_address=message_address,
        )
        #: Leases ending, peers going, sweeps: the transport's memory operations.
        self.memory = ShmMemory(self.shm)
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
        self.peers.close()
        if self.shm is not None:
            self.shm.close()
