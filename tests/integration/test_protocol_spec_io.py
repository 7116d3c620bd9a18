"""docs/protocol.md rules that the engine's I/O shell carries out (the deadline runs in
its cancel scope), checked against a running engine on the wire."""

from __future__ import annotations

from pathlib import Path

from tensorrpc._exceptions import ErrorCode
from tensorrpc._protocol import Flags, MessageKind

from .server_peer import Msg
from .test_server import engine


async def test_a_stream_paused_for_credit_holds_no_worker_and_its_deadline_still_runs(
    tmp_path: Path,
) -> None:
    # §7 OVERLOADED: a paused stream counts in neither bound; §10 credit rule 6: its
    # timeout_ms still runs, and it ends with DEADLINE_EXCEEDED.
    async with engine(tmp_path, stream_window=0, max_concurrency=1, max_queued=1) as (
        _,
        peer,
        probe,
    ):
        paused = peer.call("count", 3, "paused", flags=Flags.STREAM, timeout_ms=1000)
        # One worker, first in first out: it took the stream, which paused for credit and
        # gave the worker back, so the call queued behind it runs.
        calls = [peer.call("add", 1)]
        replies: dict[int, Msg] = {}
        while len(replies) < 1:
            msg = await peer.recv()
            replies[msg.call_id] = msg
        # The paused stream counts in neither bound: a NO_WAIT call is admitted too.
        calls.append(peer.call("add", 2, flags=Flags.NO_WAIT))
        while len(replies) < 3:  # in any order: the deadline may pass first
            msg = await peer.recv()
            replies[msg.call_id] = msg
        assert [replies[c].kind for c in calls] == [MessageKind.RESULT] * 2
        assert [replies[c].value() for c in calls] == [2, 3]
        assert replies[paused].kind is MessageKind.ERROR
        assert replies[paused].error().code == ErrorCode.DEADLINE_EXCEEDED
        assert probe.produced.get("paused", 0) == 0
