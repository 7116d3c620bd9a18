"""What strangers cost (issue 9 item 6): HELLO floods to a client, PING floods to an engine.

Run from a checkout::

    python -m bench.strangers                 # both attacks
    python -m bench.strangers hellos          # 50,000 HELLOs to a binding client
    python -m bench.strangers pings           # 40 connections x 10,000 PINGs to an engine

``hellos``: a binding client (this process) receives ``--hellos`` HELLOs, each with a
distinct 1,000-character engine id and a wrong fingerprint, from one DEALER (a
subprocess, so its CPU is not counted); each is answered by a REJECT. Printed: the
client's RSS growth (now and peak), its CPU seconds, how many refusals it remembers and
the length of ``wait_for_engines``'s error message.

``pings``: a listening engine (``tensorrpc serve --bind``, a subprocess) is sent
``--pings`` PINGs on each of ``--connections`` connections (a subprocess) that never
read the answers. Printed: the engine's RSS growth (peak, and after the attack once its
CPU is idle) and CPU seconds, from /proc.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from bench._measure import proc_stats

__all__ = ["main"]

MiB = 1 << 20
_ROOT = str(Path(__file__).resolve().parent.parent)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_ROOT, *sys.path])
    return env


def _attacker(*args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "bench.strangers", "--attacker", *args]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# -- the attackers (run in a subprocess, plain pyzmq) ------------------------------------------


def attack_hellos(address: str, count: int) -> None:
    """Send ``count`` HELLOs with distinct long ids and a bad fingerprint; read the answers."""
    import zmq

    from tensorrpc._protocol import PROTOCOL_VERSION, Hello, MessageKind, encode_control

    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"stranger")
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    for i in range(count):
        hello = Hello(
            engine_id=f"{i}-" + "x" * 1000,
            service="Echo",
            fingerprint="wrong",
            protocol_version=PROTOCOL_VERSION,
            host_id="elsewhere",
            pid=1,
        )
        sock.send_multipart(encode_control(MessageKind.HELLO, hello))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    answered = 0
    while answered < count and poller.poll(30_000):
        sock.recv_multipart()
        answered += 1
    print(f"{answered} of {count} HELLOs answered", flush=True)
    sock.close(linger=0)


def attack_pings(address: str, connections: int, count: int) -> None:
    """``connections`` DEALERs each send ``count`` PINGs and never read the answers."""
    import zmq

    from tensorrpc._protocol import MessageKind, encode_control

    ping = encode_control(MessageKind.PING, None, 0)
    socks: list[zmq.Socket[bytes]] = []
    for i in range(connections):
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, f"stranger-{i}".encode())
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.connect(address)
        socks.append(sock)
    for sock in socks:
        for _ in range(count):
            sock.send_multipart(ping)
    print("sent", flush=True)
    time.sleep(3600)  # hold the connections open, unread, until terminated


# -- the victims ---------------------------------------------------------------------------------


async def hellos(workdir: Path, count: int) -> str:
    """A binding client under a HELLO flood: its memory, CPU and error size."""
    from tensorrpc import Client
    from tensorrpc._exceptions import EnginesUnavailableError

    from .careless import Echo

    pid = os.getpid()
    async with Client(Echo, bind=f"ipc://{workdir}/client.sock") as client:
        rss0, hwm0, cpu0 = proc_stats(pid)
        blocks0 = sys.getallocatedblocks()
        proc = _attacker("hellos", client.addresses[0], str(count))
        try:
            with anyio.fail_after(600):
                while client.statistics().rejected_total < count:
                    await anyio.sleep(0.1)
                    if proc.poll() not in (None, 0):
                        raise RuntimeError("the attacker failed")
        finally:
            _reap(proc)
        rss1, hwm1, cpu1 = proc_stats(pid)
        await anyio.sleep(2.0)  # the attacker is gone: what is given back
        rss2, _, _ = proc_stats(pid)
        blocks = sys.getallocatedblocks() - blocks0
        try:
            await client.wait_for_engines(1, timeout=0.01)
            text = ""
        except EnginesUnavailableError as exc:
            text = str(exc)
        remembered = len(client.rejected)
    return (
        f"{count:,} HELLOs (distinct 1,000-char ids, wrong fingerprint) to a binding client: "
        f"RSS {rss0 / MiB:.0f} -> {rss1 / MiB:.0f} MB (+{(rss1 - rss0) / MiB:.1f} MB; peak "
        f"+{(max(hwm1, rss1) - max(hwm0, rss0)) / MiB:.1f} MB; {rss2 / MiB:.0f} MB 2 s after "
        f"the attacker left; Python heap {blocks:+,} blocks), CPU {cpu1 - cpu0:.2f} s; "
        f"{remembered} refusals remembered; wait_for_engines error: {len(text):,} characters"
    )


def pings(workdir: Path, connections: int, count: int) -> str:
    """A listening engine under unread PING floods: its memory and CPU."""
    from .careless import engine_process

    address = f"ipc://{workdir}/engine.sock"
    with engine_process(address, "victim") as engine:
        deadline = time.monotonic() + 60
        while not (workdir / "engine.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # imports done, loop idle
        rss0, hwm0, cpu0 = proc_stats(engine.pid)
        proc = _attacker("pings", address, str(connections), str(count))
        try:
            assert proc.stdout is not None
            if proc.stdout.readline() != b"sent\n":
                raise RuntimeError("the attacker failed")
            last, idle = -1.0, 0
            deadline = time.monotonic() + 600
            while idle < 2 and time.monotonic() < deadline:  # CPU idle for two samples
                time.sleep(0.5)
                _, _, cpu = proc_stats(engine.pid)
                idle = idle + 1 if cpu - last < 0.02 else 0
                last = cpu
            rss1, hwm1, cpu1 = proc_stats(engine.pid)
        finally:
            _reap(proc)
    return (
        f"{connections} connections x {count:,} unread PINGs to a listening engine: RSS "
        f"{rss0 / MiB:.0f} MB -> peak {max(hwm1, rss1) / MiB:.0f} MB "
        f"(+{(max(hwm1, rss1) - max(hwm0, rss0)) / MiB:.1f} MB), "
        f"{rss1 / MiB:.0f} MB when idle after it; CPU {cpu1 - cpu0:.2f} s"
    )


def _victims(which: list[str], args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if "hellos" in which:
            print(anyio.run(hellos, workdir, args.hellos), flush=True)
        if "pings" in which:
            print(pings(workdir, args.connections, args.pings), flush=True)


def main(argv: list[str] | None = None) -> None:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("which", nargs="*", default=["hellos", "pings"])
    parser.add_argument("--hellos", type=int, default=50_000)
    parser.add_argument("--connections", type=int, default=40)
    parser.add_argument("--pings", type=int, default=10_000)
    parser.add_argument("--attacker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.attacker:
        kind, address, *numbers = args.which
        if kind == "hellos":
            attack_hellos(address, int(numbers[0]))
        else:
            attack_pings(address, int(numbers[0]), int(numbers[1]))
        return
    _victims(args.which, args)


if __name__ == "__main__":
    main()
