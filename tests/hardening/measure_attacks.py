"""Measure what the decode-bomb attacks cost an engine and a client (docs/security.md).

Run from a checkout: ``python -m tests.hardening.measure_attacks``. It prints one line per
attack: peak RSS growth and CPU seconds of the process under attack, and how many of the
legitimate calls made meanwhile failed. The engine runs in a subprocess (the victim's
numbers come from /proc); the client under attack is this process. The attacker uses
only the public wire format, so the same script measures an older checkout too
(``PYTHONPATH=/path/to/old python -m tests.hardening.measure_attacks``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import struct
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import zmq

from bench._measure import proc_stats
from tensorrpc._client import Client
from tensorrpc._protocol import (
    MessageKind,
    Welcome,
    encode_control,
    pack_call_header,
    pack_reply_header,
    split_frames,
)
from tensorrpc._zmq import AsyncSocket, create_socket
from tests.engine_proc import EngineProcess
from tests.integration.fake_engine import FakeEngine
from tests.integration.services import Calculator

MiB = 1 << 20


def empty_arrays(nbytes: int) -> bytes:
    """A msgpack array of ``nbytes - 5`` empty arrays."""
    return b"\xdd" + struct.pack(">I", nbytes - 5) + b"\x90" * (nbytes - 5)


def bomb_map(nbytes: int) -> bytes:
    """A control body: a one-key map whose value is an array of empty arrays."""
    return b"\x81\xa4junk" + empty_arrays(nbytes - 6)


class Legit:
    """A client that calls ``add`` every 10 ms during an attack, counting failures."""

    def __init__(self, client: Client[Calculator], engine: str | None = None) -> None:
        self.client = client
        self.engine = engine
        self.ok = 0
        self.failed = 0
        self.worst = 0.0

    async def run(self) -> None:
        stub = self.client.with_options(engine=self.engine).stub()
        while True:
            start = time.monotonic()
            try:
                with anyio.fail_after(2.0):
                    assert await stub.add(1, 2) == 3
                self.ok += 1
            except Exception:
                self.failed += 1
            self.worst = max(self.worst, time.monotonic() - start)
            await anyio.sleep(0.01)


async def _handshake(sock: AsyncSocket) -> bytes:
    """Dial a listening engine as a client: PING, HELLO, WELCOME; the engine's route."""
    route = b"engine"
    with anyio.fail_after(20):
        while True:
            with contextlib.suppress(Exception):
                sock.send_nowait([route, *encode_control(MessageKind.PING, None, 0)])
            with anyio.move_on_after(0.05):
                frames = await sock.recv()
                header, _, _ = split_frames([f.buffer for f in frames[1:]])
                if header.kind is MessageKind.HELLO:
                    break
    welcome = Welcome("attacker", "elsewhere", ("frames",), 1000, 16)
    await sock.send([route, *encode_control(MessageKind.WELCOME, welcome)])
    return route


@contextlib.asynccontextmanager
async def attacker_of(address: str) -> AsyncIterator[tuple[AsyncSocket, bytes]]:
    sock = create_socket(zmq.ROUTER)
    sock.socket.setsockopt(zmq.CONNECT_ROUTING_ID, b"engine")
    sock.connect(address)
    try:
        yield sock, await _handshake(sock)
    finally:
        await sock.aclose()


async def engine_attack(workdir: Path, name: str, frames: list[bytes], count: int) -> str:
    """Send ``count`` copies of ``frames`` to a listening engine; what it cost the engine."""
    with EngineProcess("victim", workdir=workdir, bind="tcp://127.0.0.1:0") as engine:
        address = engine.address()
        async with Client(Calculator, connect=address) as client:
            await client.wait_for_engines(1, timeout=30)
            legit = Legit(client)
            async with attacker_of(address) as (sock, route), anyio.create_task_group() as tg:
                rss0, _, cpu0 = proc_stats(engine.pid)
                tg.start_soon(legit.run)
                for _ in range(count):
                    await sock.send([route, *frames])
                # wait until the engine has worked through the attack: its CPU goes idle
                last = -1.0
                while True:
                    await anyio.sleep(0.5)
                    _, _, cpu = proc_stats(engine.pid)
                    if cpu - last < 0.05:
                        break
                    last = cpu
                rss1, hwm1, cpu1 = proc_stats(engine.pid)
                tg.cancel_scope.cancel()
    return (
        f"{name}: engine RSS {rss0 / MiB:.0f} MB -> peak {max(hwm1, rss1) / MiB:.0f} MB "
        f"(+{(max(hwm1, rss1) - rss0) / MiB:.0f} MB), CPU {cpu1 - cpu0:.2f} s; "
        f"legitimate calls: {legit.ok} ok, {legit.failed} failed, slowest {legit.worst:.2f} s"
    )


async def client_attack(workdir: Path, name: str, result: bool, count: int) -> str:
    """Strangers send HELLO bombs (or a fake engine a RESULT bomb) to a binding client."""
    pid = os.getpid()
    async with Client(Calculator, bind=f"ipc://{workdir}/client.sock") as client:
        address = client.addresses[0]
        with EngineProcess("real", workdir=workdir, connect=(address,)):
            await client.wait_for_engines(1, timeout=30)
            legit = Legit(client, "real")
            bomb = bomb_map(4 * MiB) if not result else empty_arrays(16 * MiB)
            _, hwm0, cpu0 = proc_stats(pid)
            async with anyio.create_task_group() as tg:
                tg.start_soon(legit.run)
                if result:
                    async with FakeEngine(address, "fake") as fake:
                        await fake.join()
                        stub = client.with_options(engine="fake").stub()
                        outcome: list[str] = []
                        answered = anyio.Event()

                        async def victim_call() -> None:
                            try:
                                await stub.add(1, 2)
                                outcome.append("decoded")
                            except Exception as exc:
                                outcome.append(type(exc).__name__)
                            answered.set()

                        tg.start_soon(victim_call)
                        for _ in range(count):
                            msg = await fake.next(MessageKind.CALL, wait=30)
                            header = pack_reply_header(MessageKind.RESULT, msg.call_id)
                            await fake.send([header, bomb])
                        with anyio.fail_after(120):
                            await answered.wait()
                else:
                    stranger = create_socket(zmq.DEALER, routing_id=b"stranger")
                    stranger.connect(address)
                    for _ in range(count):
                        await stranger.send([pack_reply_header(MessageKind.HELLO), bomb])
                    await anyio.sleep(1.0)
                    await stranger.aclose()
                await anyio.sleep(1.0)
                _, hwm1, cpu1 = proc_stats(pid)
                tg.cancel_scope.cancel()
    what = f"; the call: {outcome[0]}" if result else ""
    return (
        f"{name}: client peak RSS +{(hwm1 - hwm0) / MiB:.0f} MB over {hwm0 / MiB:.0f} MB, "
        f"CPU {cpu1 - cpu0:.2f} s; legitimate calls: {legit.ok} ok, {legit.failed} failed, "
        f"slowest {legit.worst:.2f} s{what}"
    )


async def main(which: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if "control" in which:
            welcome = [pack_reply_header(MessageKind.WELCOME), bomb_map(4 * MiB)]
            print(await engine_attack(workdir, "20 x 4 MiB WELCOME bombs", welcome, 20))
        if "call" in which:
            call = [pack_call_header(1, "add"), empty_arrays(16 * MiB)]
            print(await engine_attack(workdir, "16 MiB CALL bomb", call, 1))
        if "hello" in which:
            print(await client_attack(workdir, "20 x 4 MiB HELLO bombs", False, 20))
        if "result" in which:
            print(await client_attack(workdir, "16 MiB RESULT bomb", True, 1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "which", nargs="*", default=["control", "call", "hello", "result"], help="attacks"
    )
    anyio.run(main, parser.parse_args().which)
