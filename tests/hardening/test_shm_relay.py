"""The relay attack of issue 20: a third process gains nothing by passing handshakes through.

The attacker (``_relay.py``) runs as uid 65534, which cannot open any of our
``/proc/<pid>/fd``. It dials into a victim client that lets engines dial in and into a
real engine, relays the handshake between them untouched, and then sends the engine two
CALLs carrying a valid handle to the victim's memory (a ``tensorrpc.share()`` tensor
holding a secret): ``digest`` (a read) and ``fill`` (a write). Before identity came from
the kernel, the engine took the relayed WELCOME's proof for the attacker's, mapped the
victim's memory, returned its digest and wrote into it. Now the engine resolves handles
only against the process the kernel says is on that connection (the attacker): both
CALLs get the one fixed TENSOR_TRANSPORT error, naming no file, and the victim's tensor
is untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import torch

import tensorrpc
from tensorrpc import _codec
from tensorrpc._client import Client
from tensorrpc._exceptions import ErrorCode
from tensorrpc._protocol import (
    ErrorInfo,
    MessageKind,
    decode_control,
    encode_control,
    pack_call_header,
    split_frames,
)
from tensorrpc._service import describe
from tensorrpc.transports._shm_handle import unpack
from tensorrpc.transports.torch_shm import TRANSPORT_NAME, HandleKind, TorchShmTransport
from tests.engine_proc import ROOT, EngineProcess
from tests.transports._engine import TensorService, digest

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not TorchShmTransport.available(), reason="torch_shm needs Linux"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to become a second uid)"),
]

SPEC = describe(TensorService)
NOBODY = "65534"
NO_ATTACH = "cannot attach to the handle"


class _Placer:
    def __init__(self, handle: bytes) -> None:
        self.handle = handle

    def place(self, tensor: torch.Tensor) -> tuple[str, bytes]:
        del tensor
        return TRANSPORT_NAME, self.handle


def _call(call_id: int, method: str, args: tuple[object, ...], handle: bytes) -> list[str]:
    wire = SPEC.methods[method].encode_args(args, {})
    encoded = _codec.encode(wire, placer=_Placer(handle))
    frames = [pack_call_header(call_id, method), encoded.payload, *encoded.buffers]
    return [bytes(f).hex() for f in frames]


def _run_relay(job: dict[str, object]) -> tuple[int, bytes, bytes]:
    """Run the attacker as uid 65534 to its end (bounded), reaped."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("_relay.py")), NOBODY],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = proc.communicate(json.dumps(job).encode(), timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    return proc.returncode, out, err


def _open_to_all(path: str) -> None:
    os.chmod(path, stat.S_IRWXU | stat.S_IRWXG | stat.S_IRWXO)


async def test_a_relay_of_the_handshake_gains_the_relay_nothing(anyio_backend: str) -> None:
    # A directory the attacker may reach (pytest's tmp_path is private to root).
    work = Path(tempfile.mkdtemp(prefix="tensorrpc-relay-"))
    try:
        _open_to_all(str(work))
        with EngineProcess(
            "tensor-engine", workdir=work, bind=f"ipc://{work}/engine.sock", service="tensor"
        ) as engine:
            engine_address = engine.address()
            _open_to_all(str(work / "engine.sock"))
            client_address = f"ipc://{work}/client.sock"
            async with Client(TensorService, bind=client_address, heartbeat_interval=0.2) as client:
                _open_to_all(str(work / "client.sock"))
                secret = tensorrpc.share(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8))
                before = digest(secret)
                # The victim's own handle to its secret, as it would send it by alias.
                shm = client._io.policy.shm
                assert shm is not None
                placed = shm.placer("anyone").place(secret)
                assert placed is not None
                handle = placed[1]
                assert unpack(handle).kind == HandleKind.SHARED
                job = {
                    "client": client_address,
                    "engine": engine_address,
                    "routing_id": "tensor-engine",
                    "ping": [f.hex() for f in encode_control(MessageKind.PING, None, 0)],
                    "calls": [
                        _call(
                            900_001, "digest", (torch.zeros(1 << 20, dtype=torch.uint8),), handle
                        ),
                        _call(
                            900_002, "fill", (torch.zeros(1 << 20, dtype=torch.uint8), 7.0), handle
                        ),
                    ],
                    "deadline": 60,
                }
                # In a thread: the client must keep answering while the relay runs.
                returncode, out, err = await anyio.to_thread.run_sync(_run_relay, job)
                assert returncode == 0, err.decode(errors="replace")
                result = json.loads(out)
                assert result["attacked"], "the relay never saw the client's WELCOME"
                replies = [[bytes.fromhex(f) for f in r] for r in result["replies"]]
                assert len(replies) == 2, result
                for frames in replies:
                    header, payload, _buffers = split_frames(frames)
                    if header.kind is MessageKind.RESULT:
                        pytest.fail(
                            f"the engine resolved the relayed handle (call {header.call_id})"
                        )
                    assert header.kind is MessageKind.ERROR
                    error = decode_control(header, payload)
                    assert isinstance(error, ErrorInfo)
                    assert error.code == ErrorCode.TENSOR_TRANSPORT
                    assert NO_ATTACH in error.message
                    for leak in ("/proc", "memfd", "/dev/shm", str(os.getpid())):
                        assert leak not in error.message
                # Nothing was read or written through the relay.
                assert digest(secret) == before
            # The engine still serves a real client.
            async with Client(TensorService, connect=engine_address) as other:
                await other.wait_for_engines(1, timeout=60)
                assert await other.stub().digest(torch.zeros(4)) == digest(torch.zeros(4))
            assert engine.stop() == 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
