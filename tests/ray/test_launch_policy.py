"""When `tensorrpc.ray.launch` needs CURVE (issue 21 item 5): the decision alone, no cluster.

A launch needs CURVE when engines may run on another host (a Ray node whose address is
neither loopback nor this node's) or when a socket of the launch listens beyond loopback.
"""

from __future__ import annotations

import pytest

from tensorrpc.ray import _exposure

HERE = "10.0.0.1"


@pytest.mark.parametrize(
    ("bind", "client_binds", "client_address", "nodes", "why"),
    [
        # one host, every socket on loopback: nothing to secure
        (False, ["tcp://127.0.0.1:5000"], None, ["127.0.0.1", "127.0.0.1"], ""),
        (False, ["tcp://127.0.0.1:5000", "ipc:///tmp/c"], None, [HERE], ""),
        (True, ["tcp://127.0.0.1:5000"], None, ["127.0.0.1"] * 3, ""),
        # a node on another host
        (False, ["tcp://127.0.0.1:5000"], None, [HERE, "10.0.0.2"], "nodes on other hosts"),
        (True, [], None, [HERE, "10.0.0.2"], "nodes on other hosts (10.0.0.2)"),
        # one host, but a socket other hosts can reach
        (False, ["tcp://0.0.0.0:5000"], None, [HERE], "client listens on tcp://0.0.0.0:5000"),
        (False, ["tcp://10.0.0.1:5000"], None, [HERE], "client listens on tcp://10.0.0.1"),
        (False, ["tcp://127.0.0.1:5000"], "tcp://10.0.0.1:80", [HERE], "dial the client at"),
        (True, ["tcp://127.0.0.1:5000"], None, [HERE], "listen on their node's address"),
    ],
)
def test_when_a_launch_needs_curve(
    bind: bool, client_binds: list[str], client_address: str | None, nodes: list[str], why: str
) -> None:
    here = nodes[0]
    got = _exposure(
        bind=bind,
        client_binds=client_binds,
        client_address=client_address,
        node_addresses=nodes,
        here=here,
    )
    if why:
        assert why in got
    else:
        assert got == ""
