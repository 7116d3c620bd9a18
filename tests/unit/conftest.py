"""tests/unit is in-process: no socket, no child process, no fresh interpreter.

Each test here runs with those refused, so that a check that needs one fails at once and
goes where such checks live (tests/integration, tests/transports, tests/hardening), and
``pytest tests/unit`` stays the quick loop (CONTRIBUTING.md, "Running the tests").
"""

from __future__ import annotations

import os
import socket
import subprocess
from typing import NoReturn

import pytest
import zmq

WHY = "tests/unit is in-process only (tests/unit/conftest.py): move this test to tests/integration"


def _refuse(what: str) -> object:
    def refused(*args: object, **kwargs: object) -> NoReturn:
        raise AssertionError(f"{what}: {WHY}")

    return refused


@pytest.fixture(autouse=True)
def _in_process_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket.socket, "__init__", _refuse("a socket"))
    monkeypatch.setattr(zmq.Context, "socket", _refuse("a ZMQ socket"))  # before it exists
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("a child process"))
    monkeypatch.setattr(os, "fork", _refuse("a fork"))
