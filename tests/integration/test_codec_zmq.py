"""The codec on frames that went through real ZMQ sockets (inproc, loopback tcp): zero-copy
decode, frames outliving their list, libzmq's unaligned small frames.

The codec without sockets: tests/unit/test_codec.py.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
import zmq

from tensorrpc._codec import decode, encode
from tests.unit.codec_helpers import assert_same_array, assert_same_tensor, random_tensor
from tests.unit.test_codec import address_range


@pytest.mark.parametrize("endpoint", ["inproc", "tcp"])
def test_zmq_frames_decode_zero_copy_and_outlive_the_frame_list(endpoint: str) -> None:
    ctx = zmq.Context()
    sender = ctx.socket(zmq.PAIR)
    receiver = ctx.socket(zmq.PAIR)
    try:
        sender.linger = 0
        receiver.linger = 0
        receiver.rcvtimeo = 10_000
        if endpoint == "inproc":
            sender.bind("inproc://codec-test")
            receiver.connect("inproc://codec-test")
        else:
            sender.bind("tcp://127.0.0.1:0")
            receiver.connect(sender.getsockopt_string(zmq.LAST_ENDPOINT))
        tensor = random_tensor(torch.bfloat16, (64, 256))
        array = np.arange(10_000, dtype=np.int64)
        encoded = encode({"t": tensor, "a": array, "small": torch.ones(3)})
        sender.send_multipart([encoded.payload, *encoded.buffers], copy=False)
        frames = receiver.recv_multipart(copy=False)
        assert len(frames) == 3
        got = decode(frames[0].buffer, [f.buffer for f in frames[1:]])
        lo, hi = address_range(frames[1].buffer)
        assert lo <= got["t"].data_ptr() < hi
        lo, hi = address_range(frames[2].buffer)
        assert lo <= got["a"].ctypes.data < hi
        frame_ref = weakref.ref(frames[1])
        del frames
        gc.collect()
        assert frame_ref() is not None
        assert_same_tensor(got["t"], tensor)
        assert_same_array(got["a"], array)
        got["t"].add_(1)
        del got
        gc.collect()
        assert frame_ref() is None
    finally:
        sender.close()
        receiver.close()
        ctx.term()


def test_misaligned_tcp_frames_decode_to_aligned_tensors() -> None:
    # libzmq slices messages under ~8 KB out of a shared receive buffer on tcp, so their
    # data is rarely aligned; the codec must copy those to aligned memory.
    ctx = zmq.Context()
    sender = ctx.socket(zmq.PAIR)
    receiver = ctx.socket(zmq.PAIR)
    try:
        sender.linger = 0
        receiver.linger = 0
        receiver.rcvtimeo = 10_000
        sender.bind("tcp://127.0.0.1:0")
        receiver.connect(sender.getsockopt_string(zmq.LAST_ENDPOINT))
        values = [torch.arange(n, dtype=torch.float64) * 1.5 for n in (70, 71, 90)]
        encoded = encode(values)
        assert len(encoded.buffers) == 3
        sender.send_multipart([encoded.payload, *encoded.buffers], copy=False)
        frames = receiver.recv_multipart(copy=False)
        got = decode(frames[0].buffer, [f.buffer for f in frames[1:]])
        for tensor, want in zip(got, values, strict=True):
            assert tensor.data_ptr() % 8 == 0
            assert_same_tensor(tensor, want)
    finally:
        sender.close()
        receiver.close()
        ctx.term()
