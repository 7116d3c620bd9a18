"""Plug points between the codec and the tensor transports.

The codec (`_codec`) decides *that* a tensor is large enough to travel out of
band; a tensor transport decides *where* its bytes live. The codec only ever sees a
transport's name and an opaque handle (``bytes``); what the handle means (a shared-memory
segment name, a CUDA IPC handle, ...) is the transport's business.

Both plug points are `typing.Protocol` classes, so a transport needs no base class:
any object with the right method fits.

On the wire a placed tensor is the descriptor ``[dtype, shape, Location.HANDLE,
[transport, handle]]`` (see docs/internals.md and docs/protocol.md). A tensor that no placer
takes travels in a frame of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["TensorPlacer", "TensorResolver"]


class TensorPlacer(Protocol):
    """Decides, per message, where a large tensor's bytes go (sending side).

    A placer is used for one `_codec.encode` call (one message). The codec
    calls `place` for every tensor of at least ``CodecConfig.inline_threshold`` bytes,
    in the order the tensors appear in the value; smaller tensors always ride inline.
    Writable numpy arrays are offered as the C-contiguous ``torch.Tensor`` that shares
    their memory (``torch.from_numpy``); read-only arrays are not offered.
    """

    def place(self, tensor: torch.Tensor) -> tuple[str, bytes] | None:
        """Place ``tensor`` with this transport, or decline.

        The tensor is detached (no autograd history), has a supported dtype and a strided
        layout, but may be non-contiguous and may live on any device (the codec has not
        copied it to the host). The placer must not modify it. The placer owns the
        lifetime of whatever it creates: it keeps the bytes alive until the receiver has
        attached to them.

        Args:
            tensor: The tensor to send.

        Returns:
            ``(transport name, handle)`` to send the tensor by handle, or ``None`` to let
            the codec send it in a frame of its own.

        Raises:
            TensorTransportError: The transport should have taken the tensor but failed.
        """
        ...


class TensorResolver(Protocol):
    """Turns a handle received on the wire back into a tensor (receiving side)."""

    def resolve(
        self, transport: str, handle: bytes, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """Return the tensor that ``handle`` names.

        ``transport`` and ``handle`` come from the wire: they are untrusted. The codec has
        checked that ``transport`` is a short string, ``handle`` is a bounded ``bytes``
        value, ``dtype`` is allowlisted and ``shape`` is sane and within the size limits;
        the resolver must validate the handle itself (format, that it names one of its
        own segments and nothing else) before touching any memory.

        Args:
            transport: The transport name the sender's placer returned.
            handle: The opaque handle the sender's placer returned.
            dtype: The tensor's dtype, from the descriptor.
            shape: The tensor's shape, from the descriptor.

        Returns:
            A tensor of exactly ``dtype`` and ``shape`` (the codec checks this).

        Raises:
            TensorTransportError: The transport is unknown, the handle is malformed or
                forged, or the memory cannot be attached.
        """
        ...
