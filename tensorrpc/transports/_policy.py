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

Whether the peer "can take it" is decided at handshake: same host id, the peer offers
``torch_shm``, and the peer's probe handle opens here (so a peer whose ``/proc`` fds we
cannot open is detected, not assumed).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

import torch

from tensorrpc._exceptions import TensorTransportError
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

    from typing_extensions import Buffer

__all__ = [
    "DEFAULT_SHM_THRESHOLD",
    "TRANSPORTS",
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
    release when the peer confirms it attached (None: nothing went by handle).
    """

    __slots__ = ("_cuda_only", "_policy", "_shm", "_threshold", "placed", "placed_bytes")

    def __init__(
        self, policy: TransportPolicy, shm: ShmPlacer | None, threshold: int, *, cuda_only: bool
    ) -> None:
        self._policy = policy
        self._shm = shm
        self._threshold = threshold
        self._cuda_only = cuda_only
        #: Tensors (and their bytes) sent by handle through this placer.
        self.placed = 0
        self.placed_bytes = 0

    @property
    def lease(self) -> int | None:
        """The torch_shm lease of this message, or None when nothing went by handle."""
        return None if self._shm is None else self._shm.lease

    def place(self, tensor: torch.Tensor) -> tuple[str, bytes] | None:
        """Send ``tensor`` by torch_shm handle when the policy says so, else decline."""
        shm = self._shm
        if shm is None:
            if not self._cuda_only:
                self._policy._fallbacks += 1  # torch_shm was asked for, the peer cannot
            return None
        if not tensor.is_cuda:
            if self._cuda_only:
                return None
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes < self._threshold:
                return None
        else:
            nbytes = tensor.numel() * tensor.element_size()
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
        self._probe: bytes | None = None
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

    def can_receive_from(
        self, *, our_host: str, peer_host: str, offered: Sequence[str], probe: bytes, pid: int
    ) -> bool:
        """Whether we can attach to the peer's torch_shm handles.

        True when torch_shm is on here, the host ids match, the peer offers torch_shm and
        its probe handle opens here and holds the expected pattern.
        """
        shm = self.shm
        if shm is None or not self.probe() or peer_host != our_host:
            return False
        if TRANSPORT_NAME not in offered or not probe or pid <= 0:
            return False
        return shm.check_probe(probe, pid)

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
            return PolicyPlacer(self, None, 0, cuda_only=mode != TRANSPORT_NAME)
        try:
            inner = shm.placer(peer)
        except TensorTransportError:
            return None
        threshold = 0 if mode == TRANSPORT_NAME else self.shm_threshold
        return PolicyPlacer(self, inner, threshold, cuda_only=False)

    def resolver(self, peer_pid: int) -> ShmResolver | None:
        """A resolver for handles from the process ``peer_pid`` (None: torch_shm is off)."""
        shm = self.shm
        if shm is None or peer_pid <= 0:
            return None
        try:
            return shm.resolver(peer_pid)
        except TensorTransportError:
            return None

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
        """Release one of our own leases (an argument lease, on the reply)."""
        if lease is not None and self.shm is not None:
            self.shm.release(lease)

    def peer_gone(self, peer: Hashable, pid: int) -> None:
        """The peer died or left: drop its leases and unmap its segments."""
        shm = self.shm
        if shm is not None:
            shm.release_peer(peer)
            if pid > 0:
                shm.forget_peer(pid)

    def disable_peer(self, peer: Hashable) -> None:
        """Stop sending torch_shm handles to ``peer`` (it failed to attach to one)."""
        if self.shm is not None:
            self.shm.disable_peer(peer)

    def sweep(self) -> None:
        """Drop leases older than the transport's lease timeout (a backstop)."""
        if self.shm is not None:
            self.shm.sweep()

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
