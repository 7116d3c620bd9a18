"""The guard of tests/unit (its conftest.py) refuses what a unit test must not do."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import zmq


def test_a_child_process_is_refused() -> None:
    with pytest.raises(AssertionError, match="a child process: tests/unit is in-process"):
        subprocess.run([sys.executable, "-c", "pass"], check=False, timeout=60)


def test_a_fork_is_refused() -> None:
    with pytest.raises(AssertionError, match="a fork"):
        os.fork()


def test_sockets_are_refused() -> None:
    with pytest.raises(AssertionError, match="a socket"):
        socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with pytest.raises(AssertionError, match="a ZMQ socket"):
        zmq.Context.instance().socket(zmq.DEALER)
