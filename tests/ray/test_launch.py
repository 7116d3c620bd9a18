"""tensorrpc.ray on a real three-node Ray cluster (head + two workers, all on loopback).

One cluster for the module (see conftest.py). Engines are Ray actors placed by placement
groups; the client runs in this process, the Ray driver.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import anyio
import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

import tensorrpc
import tensorrpc.ray
from bench._measure import shm_files_of
from tensorrpc._security import auth_statistics
from tensorrpc.ray import LaunchError

from .services import Broken, Where

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

FAST = {"heartbeat_interval": 0.2, "dead_after": 2.0, "grace_period": 1.0}
#: Bound on actors starting (or restarting): each is a fresh Ray worker process that
#: imports torch and tensorrpc. The suite runs this module beside its other workers
#: (``make test`` is ``pytest -n 3`` on 2 cores): 4 actors once took over 60 s there.
START_S = 180.0


def _shm(*pids: int) -> set[str]:
    """The ``/dev/shm`` entries of this process and ``pids`` (not of tests running beside)."""
    return shm_files_of([os.getpid(), *pids])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _actor_states(ids: set[str]) -> dict[str, str]:
    from ray._private import state

    return {
        info["ActorID"]: info["State"]
        for actor_id, info in state.actors().items()
        if actor_id in ids
    }


async def _until(check, what: str, within: float = 30.0) -> None:
    with anyio.fail_after(within):
        while not check():  # noqa: ASYNC110 - the state lives in other processes
            await anyio.sleep(0.05)


async def _stranger_refused(client: tensorrpc.Client[Where], address: str, engine_id: str) -> None:
    """An engine with a key the launcher did not make is refused by the allow-list."""
    assert client.curve is not None
    stranger = tensorrpc.CurveClientConfig(
        tensorrpc.generate_keypair(), client.curve.keypair.public_key
    )
    sock = client._io.sock
    assert sock is not None
    before = auth_statistics(sock.socket).denied
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: tensorrpc.serve(
                Where("x"), connect=address, engine_id=engine_id, curve=stranger
            )
        )
        await _until(lambda: auth_statistics(sock.socket).denied > before, "ZAP refuses it")
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_spread_calls_broadcast_and_clean_shutdown(ray_cluster: dict[str, str]) -> None:
    shm_before = _shm()
    # The allow-list starts empty: the launcher makes each engine's key and lets it in.
    async with tensorrpc.Client(
        Where, bind="tcp://0.0.0.0:0", curve=tensorrpc.ray.client_curve()
    ) as client:
        started = time.monotonic()
        async with tensorrpc.ray.launch(
            Where,
            4,
            client=client,
            args=("t",),
            placement="spread",
            serve_options=FAST,
            timeout=START_S,
        ) as group:
            launch_s = time.monotonic() - started
            print(f"launched 4 engines on Ray in {launch_s:.2f} s")
            # the address is Ray's node address (loopback here) with the client's port
            port = client.addresses[0].rpartition(":")[2]
            node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
            assert group.address == f"tcp://{node_ip}:{port}"
            engines = group.engines
            assert set(engines) == {f"Where-{i}" for i in range(4)}
            assert {e.state for e in engines.values()} == {"live"}
            assert len({e.node_id for e in engines.values()}) == 3  # spread over all nodes
            # the standard health method, not a method of the service
            assert await group.health() == dict.fromkeys(engines, tensorrpc.HealthStatus.SERVING)
            unknown = await group.health(service="Other")
            assert set(unknown.values()) == {tensorrpc.HealthStatus.SERVICE_UNKNOWN}
            await group.set_health("Where-1", tensorrpc.HealthStatus.NOT_SERVING)
            assert (await group.health())["Where-1"] is tensorrpc.HealthStatus.NOT_SERVING
            assert await client.health("Where-0") is tensorrpc.HealthStatus.SERVING
            await group.set_health("Where-1", tensorrpc.HealthStatus.SERVING)
            assert set(client.engines) == set(engines)
            # one key per engine, each id bound to its own
            bound = dict(client.engine_keys or {})
            assert set(bound) == set(engines)
            assert len(set(bound.values())) == 4
            # a stranger with a key of its own is refused, even under a live engine's id
            await _stranger_refused(client, group.address or "", "Where-0")
            assert client.engines["Where-0"].pid == engines["Where-0"].pid

            # targeted: each engine answers from the node and process Ray reports
            for engine_id, engine in engines.items():
                where = await client.with_options(engine=engine_id).stub().where()
                assert where == {"node": engine.node_id, "pid": str(engine.pid), "tag": "t"}
                assert client.engines[engine_id].pid == engine.pid
            # balanced: sequential calls visit every engine
            pids = {(await client.stub().where())["pid"] for _ in range(8)}
            assert pids == {str(e.pid) for e in engines.values()}
            # broadcast
            results = await client.broadcast("where")
            assert {k: v["node"] for k, v in results.items()} == {
                k: e.node_id for k, e in engines.items()
            }
            # tensors and streams over tcp + CURVE
            out = await client.call(Where.double, torch.arange(4.0))
            assert torch.equal(out, torch.arange(4.0) * 2)
            assert [i async for i in client.stub().count(5)] == [0, 1, 2, 3, 4]
            actor_ids = {group.actor(k)._actor_id.hex() for k in engines}
        # leaving: drained (BYE), actors killed, processes gone, placement group removed
        assert client.engines == {}
        assert client.engine_keys is None  # the keys left the allow-list too
        assert {e.state for e in group.engines.values()} == {"stopped"}
    await _until(lambda: not any(_alive(e.pid) for e in engines.values()), "actors exit")
    await _until(
        lambda: set(_actor_states(actor_ids).values()) == {"DEAD"}, "Ray reports the actors dead"
    )
    assert _shm(*(e.pid for e in engines.values())) - shm_before == set()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_killed_actor_fails_only_its_calls_and_rejoins(
    ray_cluster: dict[str, str],
) -> None:
    async with (
        tensorrpc.Client(
            Where, bind="tcp://127.0.0.1:0", heartbeat_interval=0.2, dead_after=2.0
        ) as client,
        tensorrpc.ray.launch(
            Where,
            2,
            client=client,
            engine_ids=["victim", "bystander"],
            max_restarts=2,
            serve_options=FAST,
            timeout=START_S,
        ) as group,
    ):
        for round_, kill in enumerate(("ray.kill", "kill -9"), start=1):
            old_pid = group.engines["victim"].pid
            outcomes: dict[str, object] = {}

            async def call(engine_id: str, seconds: float, outcomes=outcomes) -> None:
                try:
                    outcomes[engine_id] = (
                        await client.with_options(engine=engine_id).stub().sleep(seconds)
                    )
                except tensorrpc.TensorRPCError as exc:
                    outcomes[engine_id] = exc

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(call, "victim", 60.0)
                    tg.start_soon(call, "bystander", 1.0)
                    await _until(
                        lambda: client.statistics().calls_in_flight == 2, "calls in flight"
                    )
                    if kill == "ray.kill":
                        ray.kill(group.actor("victim"), no_restart=False)
                    else:
                        os.kill(old_pid, signal.SIGKILL)
            assert isinstance(outcomes["victim"], tensorrpc.EngineDeadError), outcomes
            assert outcomes["bystander"] == group.engines["bystander"].pid
            await _until(
                lambda: group.engines["victim"].state == "live", f"rejoin after {kill}", START_S
            )
            victim = group.engines["victim"]
            assert victim.pid != old_pid
            assert victim.restarts == round_
            assert client.engines["victim"].pid == victim.pid
            assert (await client.with_options(engine="victim").stub().where())["pid"] == str(
                victim.pid
            )


@pytest.mark.parametrize("anyio_backend", ["trio"])  # the other tests run on asyncio
async def test_bind_topology_with_curve(ray_cluster: dict[str, str]) -> None:
    engine_keys = tensorrpc.generate_keypair()
    client_keys = tensorrpc.generate_keypair()
    curve = tensorrpc.CurveClientConfig(client_keys, engine_keys.public_key)
    async with tensorrpc.Client(Where, bind="tcp://127.0.0.1:0", curve=curve) as client:
        async with tensorrpc.ray.launch(
            Where,
            2,
            client=client,
            bind=True,
            engine_keys=engine_keys,
            placement="pack",
            serve_options=FAST,
            timeout=START_S,
        ) as group:
            engines = group.engines
            assert group.address is None
            for engine_id, engine in engines.items():
                assert engine.address.startswith("tcp://127.0.0.1:")
                assert client.engines[engine_id].address == engine.address
            assert set(await client.broadcast("where")) == set(engines)
        assert client.engines == {}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(
    ("resources", "what"),
    [({"num_cpus": 64}, "CPU"), ({"num_gpus": 1}, "GPU")],
    ids=["cpus", "gpus"],
)
async def test_unsatisfiable_resources_fail_within_the_timeout(
    ray_cluster: dict[str, str], resources: dict[str, Any], what: str
) -> None:
    async with tensorrpc.Client(Where, bind="tcp://127.0.0.1:0") as client:
        # No node can ever hold it: it fails at once, not after the (hour-long) timeout.
        with (
            anyio.fail_after(120),
            pytest.raises(LaunchError, match=f"could not place 1 engines .*{what}.*infeasible"),
        ):
            async with tensorrpc.ray.launch(Where, 1, client=client, timeout=3600, **resources):
                pytest.fail("launched")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_resources_that_are_only_busy_wait_within_the_timeout(
    ray_cluster: dict[str, str],
) -> None:
    # Nodes a and b have 2 CPUs each: a bundle of 2 fits, but not while these are held.
    hold = placement_group([{"CPU": 2.0}, {"CPU": 2.0}], strategy="SPREAD")
    try:
        await anyio.to_thread.run_sync(lambda: ray.get(hold.ready(), timeout=START_S))
        async with tensorrpc.Client(Where, bind="tcp://127.0.0.1:0") as client:
            with pytest.raises(LaunchError, match=r"within 2\.0 s"):
                async with tensorrpc.ray.launch(Where, 1, client=client, timeout=2.0, num_cpus=2):
                    pytest.fail("launched")
    finally:
        remove_placement_group(hold)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_unreachable_client_address_is_named(ray_cluster: dict[str, str]) -> None:
    async with tensorrpc.Client(Where, bind="tcp://127.0.0.1:0") as client:
        unreachable = "tcp://127.0.0.1:9"  # nothing listens on the discard port
        with pytest.raises(LaunchError, match=r"dial the client at tcp://127\.0\.0\.1:9") as info:
            async with tensorrpc.ray.launch(
                Where, 1, client=client, client_address=unreachable, join_timeout=2.0
            ):
                pytest.fail("launched")
        [engine] = info.value.engines.values()
        assert engine.state == "joining"
        assert engine.address == unreachable
        await _until(lambda: not _alive(engine.pid), "the actor is killed")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_constructor_failure_is_reported(ray_cluster: dict[str, str]) -> None:
    async with tensorrpc.Client(Broken, bind="tcp://127.0.0.1:0") as client:
        with pytest.raises(LaunchError, match="no model weights here"):
            async with tensorrpc.ray.launch(Broken, 1, client=client, timeout=START_S):
                pytest.fail("launched")


async def test_bad_arguments(ray_cluster: dict[str, str]) -> None:
    async with tensorrpc.Client(Where, bind="ipc:///tmp/tensorrpc-ray-never.sock") as client:
        with pytest.raises(ValueError, match="bind the client to a tcp://"):
            tensorrpc.ray.launch(Where, 1, client=client)
    async with tensorrpc.Client(Where, bind="tcp://127.0.0.1:0") as client:
        with pytest.raises(ValueError, match="distinct"):
            tensorrpc.ray.launch(Where, 2, client=client, engine_ids=["x", "x"])
        with pytest.raises(ValueError, match="placement"):
            tensorrpc.ray.launch(Where, 2, client=client, placement="diagonal")  # type: ignore[arg-type]
        # Without CURVE, a launch whose sockets reach beyond loopback is refused at once.
        with pytest.raises(LaunchError, match=r"without CURVE: the engines dial .*10\.9\.9\.9"):
            tensorrpc.ray.launch(Where, 1, client=client, client_address="tcp://10.9.9.9:5555")
        tensorrpc.ray.launch(  # not entered: nothing starts
            Where, 1, client=client, client_address="tcp://10.9.9.9:5555", allow_plaintext=True
        )
        with pytest.raises(ValueError, match="does not use CURVE"):
            async with tensorrpc.ray.launch(
                Where, 1, client=client, engine_keys=tensorrpc.generate_keypair()
            ):
                pytest.fail("launched")
    curve = tensorrpc.ray.client_curve()
    async with tensorrpc.Client(Where, bind="tcp://127.0.0.1:0", curve=curve) as client:
        with pytest.raises(ValueError, match="one keypair per engine"):
            async with tensorrpc.ray.launch(
                Where, 1, client=client, engine_keys=tensorrpc.generate_keypair()
            ):
                pytest.fail("launched")
