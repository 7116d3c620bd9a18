"""The relay attacker of tests/hardening/test_shm_relay.py (run as another uid; pyzmq only).

It dials into a victim client as if it were an engine, and into a real engine as if it
were a client, and passes the handshake through both ways untouched: the engine's HELLO
to the client, the client's answers (and anything else) to the engine, the engine's
(and anything else) back. Once the client's WELCOME is on its way to the engine it sends
the engine the CALLs it was given (they carry a handle to the victim's memory) and prints
every RESULT or ERROR the engine answers, as JSON, one line in all.

Input (stdin, JSON): client and engine addresses, the routing id to dial the client with,
a PING to wake the engine (its HELLO answers), the CALLs (hex frames) and a deadline.

Started as root with a uid as its argument, it becomes that uid (and its group, with no
supplementary groups and so no capabilities) once pyzmq is imported and before it opens
a socket: the kernel then reports that uid for its connections, and the interpreter never
has to read the checkout as that uid (a checkout under a mode-0700 directory is not
readable by it).
"""

from __future__ import annotations

import json
import os
import sys
import time

import zmq

WELCOME, RESULT, ERROR = 2, 6, 7


def _become(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to another uid: every capability is dropped
    assert os.getresuid() == (uid, uid, uid)
    assert os.getresgid() == (uid, uid, uid)


def main() -> None:
    if len(sys.argv) > 1:
        _become(int(sys.argv[1]))
    job = json.load(sys.stdin)
    ping = [bytes.fromhex(f) for f in job["ping"]]
    calls = [[bytes.fromhex(f) for f in call] for call in job["calls"]]
    ctx = zmq.Context()
    to_client = ctx.socket(zmq.DEALER)
    to_client.setsockopt(zmq.ROUTING_ID, job["routing_id"].encode())
    to_client.setsockopt(zmq.LINGER, 0)
    to_client.connect(job["client"])
    to_engine = ctx.socket(zmq.DEALER)
    to_engine.setsockopt(zmq.LINGER, 0)
    to_engine.connect(job["engine"])
    poller = zmq.Poller()
    poller.register(to_client, zmq.POLLIN)
    poller.register(to_engine, zmq.POLLIN)
    deadline = time.monotonic() + job["deadline"]
    replies: list[list[str]] = []
    attacked = False
    next_ping = 0.0
    while len(replies) < len(calls) and time.monotonic() < deadline:
        now = time.monotonic()
        if not attacked and now >= next_ping:
            to_engine.send_multipart(ping)  # a stranger's PING: the engine says HELLO
            next_ping = now + 0.5
        ready = dict(poller.poll(100))
        if to_engine in ready:
            frames = to_engine.recv_multipart()
            if attacked and frames[0][3] in (RESULT, ERROR):
                replies.append([f.hex() for f in frames])
            else:
                to_client.send_multipart(frames)
        if to_client in ready:
            frames = to_client.recv_multipart()
            to_engine.send_multipart(frames)
            if frames[0][3] == WELCOME and not attacked:
                attacked = True
                for call in calls:
                    to_engine.send_multipart(call)
    print(json.dumps({"attacked": attacked, "replies": replies}), flush=True)
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
