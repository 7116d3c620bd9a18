"""One torch_shm transfer between two transports of this process, for unit tests."""

from __future__ import annotations

import torch

from tensorrpc import _codec
from tensorrpc.transports.torch_shm import TorchShmTransport

CONFIG = _codec.CodecConfig()


def send_local(
    sender: TorchShmTransport, receiver: TorchShmTransport, t: torch.Tensor
) -> torch.Tensor:
    """Encode ``t`` with ``sender``'s placer, decode it with ``receiver`` (kept handles),
    release the sender's lease, and return the received tensor."""
    placer = sender.placer("client")
    encoded = _codec.encode(t, CONFIG, placer=placer)
    resolver = receiver.resolver(None, keep=("client", 1))
    got = _codec.decode(encoded.payload, encoded.buffers, CONFIG, resolver=resolver)
    assert isinstance(got, torch.Tensor)
    assert placer.lease is not None
    sender.release(placer.lease)
    return got
