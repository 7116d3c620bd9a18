"""torch_shm in a forked child: it sends nothing of its parent (a process test)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import pytest
import torch

from tensorrpc.transports._shared import lookup, share
from tensorrpc.transports._shm_copy import SPLIT_BYTES, Copier
from tensorrpc.transports._shm_handle import HandleKind, unpack
from tensorrpc.transports._shm_pool import pid as current_pid
from tensorrpc.transports.torch_shm import TorchShmTransport

pytestmark = pytest.mark.skipif(
    not TorchShmTransport.available(), reason="torch_shm needs Linux memfd and /proc"
)


def in_child(check: Callable[[], bool]) -> None:
    """Run ``check`` in a forked child; it must answer True and the child exit 0."""
    rfd, wfd = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(rfd)
            os.write(wfd, b"ok" if check() else b"no")
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        answer = r.read()
    _, status = os.waitpid(child, 0)
    assert (answer, os.waitstatus_to_exitcode(status)) == (b"ok", 0)


def test_a_forked_child_sends_nothing_of_its_parent() -> None:
    """The transport knows its pid without a system call per tensor (``_shm_pool.pid``,
    refreshed at fork): a child neither sends its parent's shared blocks by alias nor
    names its parent's pid in handles."""
    parent_block = share(torch.arange(1024, dtype=torch.float32))
    with TorchShmTransport() as shm:
        shm.placer("warm-up")  # the parent has used it

        def check() -> bool:
            placed = shm.placer("x").place(parent_block)
            h = None if placed is None else unpack(placed[1])
            return (
                current_pid() == os.getpid()
                and lookup(parent_block.untyped_storage()) is None
                and h is not None
                and h.pid == os.getpid()
                and h.kind == HandleKind.POOL
            )

        in_child(check)
    assert current_pid() == os.getpid()
    assert lookup(parent_block.untyped_storage()) is not None


def test_a_forked_child_copies_with_helpers_of_its_own() -> None:
    """The parent's copy helpers do not exist in a forked child: the child's large copies
    start helpers of their own (and would finish on the caller's thread without them).
    (No torch operation in the child: torch's OpenMP pool does not survive a fork.)"""
    nbytes = 2 * SPLIT_BYTES
    src = bytearray(os.urandom(nbytes))
    dst = bytearray(nbytes)
    src_at = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst_at = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    copier = Copier(2)
    try:
        copier.copy(dst_at, src_at, nbytes)  # the parent's helper starts
        parents = list(copier._helpers)

        def check() -> bool:
            ctypes.memset(dst_at, 0, nbytes)
            copier.copy(dst_at, src_at, nbytes)
            ours = copier._helpers
            return (
                dst == src and len(ours) == 1 and ours[0] is not parents[0] and ours[0].is_alive()
            )

        in_child(check)
    finally:
        copier.close()
    assert dst == src
