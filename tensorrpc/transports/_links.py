"""Which process each peer is, as its handshake decided, and resolvers bound to it.

One `PeerLinks` per endpoint (owned by `TransportPolicy` as ``policy.peers``): the
shell gathers `PeerFacts` for a handshake message (`facts`), a machine or `attest`
decides the `ShmTerms` (`tensorrpc.transports._peer.shm_terms`), and `link` records
them. From then on the peer's handles resolve only against that process (`resolver`),
and only from messages that came on the attested connection (their ``Peer-Address``);
any other handle is refused without a word about files or descriptors. A pidfd is owned
here from `facts` on: kept by a link, closed by `settle` when no link took it, by `drop`
when the peer goes.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final

from tensorrpc._exceptions import TensorTransportError
from tensorrpc.transports._peer import (
    AliasSetting,
    KernelPeer,
    PeerFacts,
    ShmTerms,
    alias_gate,
    shm_terms,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Sequence

    import torch

    from tensorrpc.transports.torch_shm import ShmResolver, TorchShmTransport

__all__ = ["MAX_LINKS", "NO_SHM", "LazyResolver", "PeerLinks"]

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


class PeerLinks:
    """The attested process behind each peer of one endpoint, and its resolvers.

    Args:
        shm: The endpoint's torch_shm transport (None: torch_shm is off here).
        alias_unsealed: ``shm_alias_unsealed``: whether the unsealed-alias gate is read.
        trust_unattested: ``shm_trust_unattested`` (docs/security.md).
        message_address: Reads a received frame's ``Peer-Address`` ("" when none).
    """

    def __init__(
        self,
        shm: TorchShmTransport | None,
        *,
        alias_unsealed: AliasSetting,
        trust_unattested: bool,
        message_address: Callable[[object], str] | None,
    ) -> None:
        self.shm = shm
        self.alias_unsealed: AliasSetting = alias_unsealed
        self.trust_unattested = trust_unattested
        self._message_address = message_address or _no_address
        self._links: dict[Hashable, _Link] = {}

    def facts(self, kernel: KernelPeer | None) -> PeerFacts:
        """What we know of the sender of a handshake message, for `shm_terms`: the shell
        passes what the kernel says sent it (``peer_credentials``; None: it cannot say,
        tcp); this reads the unsealed-alias gate from ``/proc``.

        The pidfd in ``kernel`` is ours from here on: `link` keeps it, `settle` closes it
        when no link took it.

        Returns:
            Facts that are not ``usable`` when torch_shm is off here, or the message came
            from ourselves.
        """
        if self.shm is None or (kernel is not None and kernel.pid == os.getpid()):
            if kernel is not None:
                kernel.close()
            return PeerFacts(None, os.getpid(), usable=False)
        if kernel is None:
            return PeerFacts(None, os.getpid())
        gate = alias_gate(kernel) if self.alias_unsealed == "same-user" else (False, False)
        return PeerFacts(kernel, os.getpid(), gate, kernel.uid in (0, os.geteuid()))

    def link(self, peer: Hashable, terms: ShmTerms | None) -> None:
        """torch_shm with ``peer`` is what its handshake decided (None: off): its handles
        resolve against ``terms.kernel`` from now on, and only from messages on that
        connection."""
        self.drop(peer)
        shm = self.shm
        if shm is None or terms is None:
            return
        kernel = terms.kernel
        links = self._links
        while len(links) >= MAX_LINKS:
            self.drop(next(iter(links)))  # the oldest handshake state goes first
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

    def drop(self, peer: Hashable) -> int:
        """Forget ``peer``'s link (it went, or handshakes again) and close its pidfd.

        Returns:
            The pid it had (0: it had no link), for the mappings to forget.
        """
        link = self._links.pop(peer, None)
        if link is None:
            return 0
        link.kernel.close()
        return link.kernel.pid

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

    def close(self) -> None:
        """Forget every link (their pidfds are closed). Idempotent."""
        for peer in list(self._links):
            self.drop(peer)


class LazyResolver:
    """The codec's resolver for one message: the torch_shm resolver is made on the
    first handle, so a message without one costs the transport nothing.

    Made by `PeerLinks.lazy_resolver`; `inner` is the resolver once made (the
    caller closes, releases or detaches what it resolved only then).
    """

    __slots__ = ("_frame", "_hold", "_keep", "_links", "_peer", "inner")

    def __init__(
        self, links: PeerLinks, peer: Hashable, frame: object, hold: Hashable, keep: Hashable
    ) -> None:
        self._links = links
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
            made = self._links.resolver(
                self._peer, frame=self._frame, hold=self._hold, keep=self._keep
            )
            assert made is not None  # made only while torch_shm is on (it stays on)
            inner = self.inner = made
        return inner.resolve(transport, handle, dtype, shape)
