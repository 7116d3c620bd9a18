"""The torch_shm memory operations of one endpoint: leases ending, peers going, sweeps.

One `ShmMemory` per endpoint (owned by `TransportPolicy` as ``policy.memory``). Which
lease ends when is the protocol machines' lease table; this is where the shells carry it
out on the transport: a RELEASE from the peer frees our regions (`release`), a call's
own argument lease ends (`release_one`), the peer's tensors that died make its leases
releasable (`releasable`), a call's argument tensors get pages of their own before the
peer takes its regions back (`detach`), a gone peer's leases and mappings go
(`peer_gone`), and a periodic `sweep` drops what outlived its bound. Every operation is
a no-op without torch_shm.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from tensorrpc._exceptions import TensorTransportError
from tensorrpc._lazy import LazyModule
from tensorrpc.transports._shm_handle import unpack
from tensorrpc.transports.torch_shm import TRANSPORT_NAME

if TYPE_CHECKING:
    from collections.abc import Hashable, Sequence

    import torch

    from tensorrpc.transports._shm_holds import Holds
    from tensorrpc.transports.torch_shm import ShmResolver, TorchShmTransport
else:
    torch = LazyModule("torch", globals())

__all__ = ["LeaseCollector", "ShmMemory"]

logger = logging.getLogger("tensorrpc.transports")


class ShmMemory:
    """What happens to torch_shm leases and mappings as peers come and go.

    Args:
        shm: The endpoint's torch_shm transport (None: torch_shm is off here).
    """

    def __init__(self, shm: TorchShmTransport | None) -> None:
        self.shm = shm
        #: The leases our received tensors hold (``holds.ready``: some are releasable);
        #: None without torch_shm.
        self.holds: Holds | None = shm.holds if shm is not None else None

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

    def detach_bytes(self, keep: Hashable) -> int:
        """Bytes that `detach` of message ``keep`` would copy now (0: nothing alive)."""
        holds = self.holds
        return 0 if holds is None else holds.kept_bytes(keep)

    def detach(self, keep: Hashable) -> None:
        """The peer takes back the regions of message ``keep``: copy what still uses them."""
        shm = self.shm
        if shm is not None:
            try:
                shm.detach(keep)
            except TensorTransportError as exc:  # pragma: no cover - out of memory
                logger.error("torch_shm: %s", exc)

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
        """The peer died or left: drop its leases and unmap its segments (``pid``: the
        process it was, `PeerLinks.drop`'s answer; 0: none attested)."""
        shm = self.shm
        if shm is not None:
            shm.release_peer(peer)
            try:
                shm.forget_holds(peer)
            except TensorTransportError as exc:  # pragma: no cover - out of memory
                logger.error("torch_shm: %s", exc)
            if pid > 0:
                shm.forget_peer(pid)

    def sweep(self) -> None:
        """Drop leases older than the transport's lease timeout (a backstop)."""
        shm = self.shm
        if shm is not None:
            shm.sweep()


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
                self.leases.append(unpack(handle).lease)
        return torch.zeros((), dtype=dtype).expand(shape)
