"""Hosts as network namespaces: a client and two engine "hosts" joined by a bridge.

Each host is a network namespace with its own address in 198.18.0.0/15 (the benchmarking
test range; the addresses exist only inside these namespaces), joined to a bridge by a veth
pair. Engines also run in their own PID and mount namespaces (``unshare``), so they share
nothing with the client but the network. Over tcp:// with CURVE: calls, a stream and a
tensor work; ``auto`` sends the tensor as frames because torch_shm needs a peer the kernel
attests (ipc://); deleting a host's link fails its call with EngineDeadError within
dead_after while the other host keeps serving; restoring the link brings the engine back.
Needs Linux, root, ``ip`` and ``unshare``; skipped elsewhere with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tensorrpc

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "198.18.77"
TAG = f"{os.getpid() % 100000}"
HOSTS = {"c": 1, "a": 2, "b": 3}

pytestmark = pytest.mark.timeout(120)


def _why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is not installed"
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


@dataclass
class Net:
    """The namespaces and the bridge; ``link(name)`` (re)creates a host's veth pair."""

    bridge: str
    ns: dict[str, str]

    def veth(self, host: str) -> str:
        return f"tv{TAG}{host}"

    def link(self, host: str) -> None:
        outer, inner, ns = self.veth(host), f"tp{TAG}{host}", self.ns[host]
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("addr", "add", f"{PREFIX}.{HOSTS[host]}/24", "dev", inner, ns=ns)
        _ip("link", "set", inner, "up", ns=ns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")

    def unlink(self, host: str) -> None:
        _ip("link", "del", self.veth(host))  # deletes both ends: the host vanishes


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    why = _why_not()
    if why:
        pytest.skip(why)
    n = Net(bridge=f"tb{TAG}", ns={h: f"trpc{TAG}{h}" for h in HOSTS})
    try:
        try:
            for ns in n.ns.values():
                _ip("netns", "add", ns)
                _ip("link", "set", "lo", "up", ns=ns)
            _ip("link", "add", n.bridge, "type", "bridge")
            _ip("link", "set", n.bridge, "up")
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create network namespaces here: {exc.stderr!r}")
        for host in HOSTS:
            n.link(host)
        yield n
    finally:
        for host in HOSTS:
            with contextlib.suppress(subprocess.SubprocessError):
                _ip("link", "del", n.veth(host))
        with contextlib.suppress(subprocess.SubprocessError):
            _ip("link", "del", n.bridge)
        for ns in n.ns.values():
            with contextlib.suppress(subprocess.SubprocessError):
                _ip("netns", "del", ns)


def _spawn(ns: str, *args: str, isolate: bool, env: dict[str, str]) -> subprocess.Popen[str]:
    cmd = ["ip", "netns", "exec", ns]
    if isolate:
        cmd += ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "--kill-child", "--"]
    cmd += [sys.executable, "-m", "tests.netns.host_peer", *args]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _read(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded by the test's timeout; the client has its own
    assert line, f"the client exited ({proc.poll()})"
    result: dict[str, Any] = json.loads(line)
    return result


def _tell(proc: subprocess.Popen[str], what: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(what + "\n")
    proc.stdin.flush()


def test_engines_on_other_hosts_over_tcp_with_curve(net: Net) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("CLIENT", "A", "B"):
        keys = tensorrpc.generate_keypair()
        env[f"TRPC_{name}_PUB"] = keys.public_key.decode()
        env[f"TRPC_{name}_SEC"] = keys.secret_key.decode()
    procs: list[subprocess.Popen[str]] = []
    try:
        client = _spawn(net.ns["c"], "client", f"{PREFIX}.1", isolate=False, env=env)
        procs.append(client)
        address = _read(client)["address"]
        assert address.startswith(f"tcp://{PREFIX}.1:")
        for host in ("a", "b"):
            procs.append(_spawn(net.ns[host], "engine", address, host, isolate=True, env=env))

        calls = _read(client)
        assert calls["step"] == "calls"
        assert calls["who"] == {"a": "a", "b": "b"}
        assert calls["tensor_ok"]
        assert calls["stream"] == [0, 1, 2, 3, 4]
        # torch_shm was offered, but over tcp the kernel attests no peer (and nobody here
        # trusts unattested peers): the 1 MiB tensor went as frames
        assert "torch_shm" in calls["offered"]["a"]
        assert calls["frames_sent"] >= 1
        assert calls["shm_sent"] == 0

        assert _read(client)["step"] == "in_flight"
        net.unlink("a")
        _tell(client, "cut")
        cut = _read(client)
        assert cut["a"] == "EngineDeadError"
        assert cut["b"] == "b"  # the other host keeps serving
        assert cut["live"] == ["b"]
        assert cut["failed_after_cut_s"] < cut["dead_after"] * 3  # liveness, not a hang

        net.link("a")
        _tell(client, "restored")
        back = _read(client)
        assert back["who"] == "a"
        assert back["live"] == ["a", "b"]
        _tell(client, "bye")
        assert client.wait(timeout=30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
