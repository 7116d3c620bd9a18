"""A stand-alone torch_shm peer process for the tests (not a test module).

Started with ``python tests/transports/_shm_peer.py``; reads one JSON command per line on
stdin and answers one JSON line on stdout. Two of these, started independently by the test
process, exchange handles through it: neither is the other's parent and they share no
torch.multiprocessing queue. The torch sharing strategy is only ever changed here, in the
child, around the creation of one tensor.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import sys
from typing import Any

import torch
import torch.multiprocessing as tmp

from tensorrpc._exceptions import TensorTransportError
from tensorrpc.transports._shared import share
from tensorrpc.transports.torch_shm import TorchShmTransport


def make_tensor(spec: dict[str, Any]) -> torch.Tensor:
    """Build the tensor a spec describes, deterministically from its seed."""
    dtype = getattr(torch, spec["dtype"])
    shape = list(spec["shape"])
    layout = spec.get("layout", "contig")
    if layout == "strided" and shape:
        base_shape = [*shape[:-1], 2 * shape[-1]]
    elif layout == "transposed" and len(shape) == 2:
        base_shape = [shape[1], shape[0]]
    elif layout == "offset":
        base_shape = [max(1, _numel(shape)) + 3]
    else:
        base_shape = shape
    itemsize = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(int(spec.get("seed", 0)))
    raw = torch.randint(0, 256, (_numel(base_shape) * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    base = raw.view(dtype).reshape(base_shape)
    strategy = spec.get("shared")
    if strategy == "tensorrpc":
        base = share(base)
    elif strategy:
        before = tmp.get_sharing_strategy()  # type: ignore[no-untyped-call]
        tmp.set_sharing_strategy(strategy)  # type: ignore[no-untyped-call]
        try:
            base.share_memory_()  # type: ignore[no-untyped-call]
        finally:
            tmp.set_sharing_strategy(before)  # type: ignore[no-untyped-call]
    if layout == "strided" and shape:
        return base[..., ::2]
    if layout == "transposed" and len(shape) == 2:
        return base.t()
    if layout == "offset":
        return base[3 : 3 + _numel(shape)].view(shape)
    return base


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def digest(t: torch.Tensor) -> str:
    """sha256 over dtype, shape and the C-contiguous bytes."""
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fd_count() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def fd_targets() -> list[str]:
    """What each open file descriptor points at (sorted)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor listdir itself used
            out.append(os.readlink(f"/proc/self/fd/{name}"))
    return sorted(out)


def main() -> None:
    """Serve commands until ``exit`` or end of input."""
    transport = TorchShmTransport()
    kept: dict[str, torch.Tensor] = {}
    # torch's file_system strategy opens one connection to its shm manager for the life of
    # the process: open it before taking the baseline so that it is not counted as a leak.
    make_tensor({"dtype": "uint8", "shape": [1], "shared": "file_system"})
    gc.collect()
    baseline = fd_count()
    baseline_targets = fd_targets()
    out = sys.stdout
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        reply: dict[str, Any] = {"ok": True}
        if op == "place":
            placer = transport.placer(cmd.get("peer"))
            handles: list[str | None] = []
            digests: list[str | None] = []
            for spec in cmd["specs"]:
                t = make_tensor(spec)
                placed = placer.place(t)
                handles.append(None if placed is None else placed[1].hex())
                digests.append(digest(t))
                if spec.get("keep"):
                    kept[spec["keep"]] = t
                del t
            reply.update(handles=handles, digests=digests, lease=placer.lease)
        elif op == "resolve":
            resolver = transport.resolver(cmd.get("peer_pid"), hold=cmd.get("hold"))
            digests = []
            errors: list[str] = []
            for item in cmd["items"]:
                try:
                    t = resolver.resolve(
                        "torch_shm",
                        bytes.fromhex(item["handle"]),
                        getattr(torch, item["dtype"]),
                        tuple(item["shape"]),
                    )
                except TensorTransportError as exc:
                    digests.append(None)
                    errors.append(str(exc))
                    continue
                digests.append(digest(t))
                if item.get("keep"):
                    kept[item["keep"]] = t
                del t
            reply.update(digests=digests, errors=errors, leases=list(resolver.leases))
        elif op == "release":
            reply.update(released=[transport.release(lease) for lease in cmd["leases"]])
        elif op == "release_peer":
            reply.update(released=transport.release_peer(cmd.get("peer")))
        elif op == "forget_peer":
            reply.update(forgotten=transport.forget_peer(cmd["pid"]))
        elif op == "fill":
            kept[cmd["name"]].fill_(cmd["value"])
        elif op == "read":
            reply.update(digest=digest(kept[cmd["name"]]))
        elif op == "drop":
            for name in cmd["names"]:
                del kept[name]
            gc.collect()
        elif op == "open_file":
            reply.update(fd=os.open(cmd["path"], os.O_RDONLY | os.O_CLOEXEC))
        elif op == "fds":
            reply.update(fds=fd_count(), baseline=baseline)
        elif op == "stats":
            reply.update(stats=_stats(transport))
        elif op == "close":
            transport.close()
            kept.clear()
            gc.collect()
            reply.update(fds=fd_count(), baseline=baseline)
            reply.update(targets=fd_targets(), baseline_targets=baseline_targets)
        elif op == "exit":
            out.write(json.dumps(reply) + "\n")
            out.flush()
            break
        else:
            reply = {"ok": False, "error": f"unknown op {op!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def _stats(transport: TorchShmTransport) -> dict[str, int]:
    s = transport.statistics()
    return {name: getattr(s, name) for name in s.__dataclass_fields__}


if __name__ == "__main__":
    main()
