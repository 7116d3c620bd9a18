"""Coverage-guided fuzzing of the decoders with atheris (libFuzzer), outside the unit suite.

Run::

    .venv/bin/python -m bench.fuzz_atheris -atheris_runs=1000000
    .venv/bin/python -m bench.fuzz_atheris -max_total_time=60 bench/results/fuzz_corpus

Any libFuzzer flag may be given (``-max_total_time``, ``-jobs``, ``-dict`` ...). Without a
corpus directory the harness seeds ``bench/results/fuzz_corpus`` with valid messages of
every kind and fuzzes from there (new inputs are saved in it, so a later run continues).

The targets are what a peer's bytes reach first: :func:`tensorrpc._protocol.split_frames`
and :func:`~tensorrpc._protocol.decode_control` for every message, and
:func:`tensorrpc._codec.decode` for the payload and tensor frames of CALL, RESULT and
STREAM_ITEM. The property checked: whatever the bytes, only ``RemoteProtocolError`` or
``DecodeError`` escapes (a crash, a hang or any other exception is a finding, and
libFuzzer writes the input to ``crash-*``).

Input format (easy to mutate, easy to seed): byte 0 chooses the target (low 7 bits) and
whether buffer frames are writable (bit 7: decoded without a copy); byte 1 the frame
count; then each frame is a little-endian ``u16`` length and that many bytes (the last
one takes what is left when the input is short).
"""

from __future__ import annotations

import contextlib
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["tensorrpc"]):
    import torch

    from tensorrpc import _codec, _protocol
    from tensorrpc._exceptions import DecodeError, RemoteProtocolError, ValidationError

# Small limits keep every input's memory bounded (a forged 16 GiB descriptor is refused
# by the limit check, which is what is being fuzzed, rather than allocated).
CONFIG = _codec.CodecConfig(
    max_tensor_bytes=1 << 20, max_tensors=16, max_payload_bytes=1 << 20, inline_threshold=64
)
_VALUE_KINDS = (
    _protocol.MessageKind.CALL,
    _protocol.MessageKind.RESULT,
    _protocol.MessageKind.STREAM_ITEM,
)
_MAX_FRAMES = 8
_EXPECTED = (RemoteProtocolError, DecodeError, ValidationError)
DEFAULT_CORPUS = Path(__file__).parent / "results" / "fuzz_corpus"


def split_input(data: bytes) -> tuple[int, list[bytes]]:
    """The target selector and the frames encoded in one fuzz input."""
    if len(data) < 2:
        return 0, [data]
    mode, count = data[0], data[1] % (_MAX_FRAMES + 1)
    rest = memoryview(data)[2:]
    frames: list[bytes] = []
    for _ in range(count):
        if len(rest) < 2:
            frames.append(bytes(rest))
            rest = rest[len(rest) :]
            continue
        (size,) = struct.unpack_from("<H", rest)
        frames.append(bytes(rest[2 : 2 + size]))
        rest = rest[2 + size :]
    return mode, frames


def join_input(mode: int, frames: list[bytes]) -> bytes:
    """The fuzz input that :func:`split_input` turns into ``mode, frames`` (for seeds)."""
    out = bytearray([mode, len(frames)])
    for frame in frames:
        out += struct.pack("<H", len(frame)) + frame
    return bytes(out)


def _decode_message(frames: list[bytes], writable: bool) -> None:
    header, payload, buffers = _protocol.split_frames(frames, max_buffers=_MAX_FRAMES)
    if header.kind in _VALUE_KINDS:
        oob = [bytearray(b) for b in buffers] if writable else list(buffers)
        _codec.decode(payload, oob, CONFIG)
    else:
        _protocol.decode_control(header, payload)


def _decode_payload(frames: list[bytes], writable: bool) -> None:
    if not frames:
        return
    oob = [bytearray(b) for b in frames[1:]] if writable else frames[1:]
    _codec.decode(frames[0], oob, CONFIG)


def _decode_body(frames: list[bytes], writable: bool) -> None:
    # A header and a body, without split_frames' layout checks in front of decode_control.
    if len(frames) < 2:
        return
    header = _protocol.unpack_header(frames[0])
    if header.kind not in _VALUE_KINDS:
        _protocol.decode_control(header, frames[1])


_TARGETS: tuple[Callable[[list[bytes], bool], None], ...] = (
    _decode_message,
    _decode_payload,
    _decode_body,
)


def test_one_input(data: bytes) -> None:
    """libFuzzer's entry point: only the protocol's own errors may escape."""
    mode, frames = split_input(data)
    target = _TARGETS[(mode & 0x7F) % len(_TARGETS)]
    with contextlib.suppress(*_EXPECTED):
        target(frames, bool(mode & 0x80))


def seeds() -> list[bytes]:
    """Valid messages of every kind, as fuzz inputs for each target."""
    kinds = _protocol.MessageKind
    values: list[object] = [
        [1, 2.5, "x", None, True, b"raw", {"k": [1, 2]}],
        [torch.arange(8, dtype=torch.float32), torch.ones(2, 3, dtype=torch.int64)],
        {"t": torch.zeros(64, dtype=torch.uint8), "n": -1},
        [torch.tensor(3.0), torch.empty(0, 4)],
    ]
    messages: list[list[bytes]] = []
    for i, value in enumerate(values):
        encoded = _codec.encode(value, CONFIG)
        body = [bytes(encoded.payload), *(bytes(b) for b in encoded.buffers)]
        messages.append([_protocol.pack_call_header(i + 1, "scale", 0, 1000), *body])
        messages.append([_protocol.pack_reply_header(kinds.RESULT, i + 1), *body])
        messages.append([_protocol.pack_reply_header(kinds.STREAM_ITEM, i + 1), *body])
    controls: list[tuple[_protocol.MessageKind, _protocol.ControlBody | None, int]] = [
        (
            kinds.HELLO,
            _protocol.Hello(
                "engine-0",
                "Probe",
                "ab" * 32,
                _protocol.PROTOCOL_VERSION,
                "host",
                42,
                ("frames", "torch_shm"),
                4,
                1000,
                ("add", "count"),
                streaming=("count",),
                signatures=("add(a: int) -> int", "count(n: int) -> int"),
                max_message_bytes=1 << 20,
            ),
            0,
        ),
        (
            kinds.WELCOME,
            _protocol.Welcome("c", "host", ("frames",), 500, 16, 7, 1 << 32),
            0,
        ),
        (kinds.REJECT, _protocol.Reject("fingerprint", "differs"), 0),
        (kinds.BYE, _protocol.Bye("shutdown"), 0),
        (kinds.CREDIT, _protocol.Credit(8), 3),
        (kinds.RELEASE, _protocol.Release((1, 2, 3)), 0),
        (kinds.ERROR, _protocol.ErrorInfo(9, "ValueError", "boom", "Traceback"), 3),
        (kinds.CANCEL, None, 3),
        (kinds.STREAM_END, None, 3),
        (kinds.PING, None, 0),
        (kinds.PONG, None, 5),
    ]
    for kind, control, call_id in controls:
        messages.append(_protocol.encode_control(kind, control, call_id))
    out: list[bytes] = []
    for frames in messages:
        out.append(join_input(0, frames))  # the whole message
        out.append(join_input(0x80, frames))  # the same, buffers writable (zero-copy)
        out.append(join_input(1, frames[1:]))  # its payload and buffers
        out.append(join_input(0x81, frames[1:]))  # the same, buffers writable
        out.append(join_input(2, frames[:2]))  # header and body
    return out


def main(argv: list[str]) -> None:
    """Seed the default corpus when no corpus directory is given, then fuzz."""
    if not any(not arg.startswith("-") for arg in argv[1:]):
        DEFAULT_CORPUS.mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(seeds()):
            (DEFAULT_CORPUS / f"seed-{i:03d}").write_bytes(seed)
        argv = [*argv, str(DEFAULT_CORPUS)]
        print(f"corpus: {DEFAULT_CORPUS}", file=sys.stderr)
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
