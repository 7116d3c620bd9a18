"""Launch tensorrpc engines as Ray actors and join them to a client (docs/scale-out.md).

```python
curve = tensorrpc.ray.client_curve()  # CURVE server, allow-list grown by each launch
async with tensorrpc.Client(LM, bind="tcp://0.0.0.0:0", curve=curve) as client:
    async with tensorrpc.ray.launch(LM, 4, client=client, placement="spread") as group:
        print(group.engines)  # engine id -> RayEngine(node_id, pid, address, state, ...)
```

Ray is the ``ray`` extra: ``import tensorrpc`` never imports it; importing this module
without Ray raises ``ImportError`` naming the extra.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import anyio
import anyio.from_thread

from tensorrpc._exceptions import ClosedError, HandshakeRejectedError, TensorRPCError
from tensorrpc._health import HealthStatus
from tensorrpc._security import (
    CurveClientConfig,
    CurveConfig,
    CurveKeyPair,
    CurveServerConfig,
    generate_keypair,
    is_loopback,
)
from tensorrpc._server import Server

try:
    import ray
    import ray.exceptions
    import ray.util
    from ray.util.placement_group import (
        placement_group,
        placement_group_table,
        remove_placement_group,
    )
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "tensorrpc.ray needs Ray: install the extra with `pip install 'tensorrpc[ray]'`"
    ) from exc

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from tensorrpc._client import Client

# Ray's own functions are partly untyped: call them through this alias.
_ray: Any = ray

__all__ = [
    "EngineGroup",
    "EngineState",
    "LaunchError",
    "Placement",
    "RayEngine",
    "client_curve",
    "launch",
]

#: How the actors are placed: ``"spread"`` over as many nodes as possible, ``"pack"`` on as
#: few as possible (Ray's SPREAD and PACK placement group strategies).
Placement: TypeAlias = Literal["spread", "pack"]

#: An engine's state as the launcher sees it:
#:
#: * ``"starting"``: the actor is being created or is constructing the service;
#: * ``"joining"``: the actor runs and its engine is not (or no longer) live on the client;
#: * ``"live"``: the client has the engine live, with the actor's current process;
#: * ``"restarting"``: the actor died and Ray is restarting it (``max_restarts``);
#: * ``"dead"``: the actor died for good;
#: * ``"failed"``: the engine stopped serving on its own (the error says why);
#: * ``"stopped"``: stopped by [`EngineGroup.stop`][tensorrpc.ray.EngineGroup.stop].
EngineState: TypeAlias = Literal[
    "starting", "joining", "live", "restarting", "dead", "failed", "stopped"
]

_STRATEGIES: Mapping[str, str] = {"spread": "SPREAD", "pack": "PACK"}
#: How often the wait for a placement asks Ray whether it found it infeasible (seconds).
_INFEASIBLE_POLL_S = 0.5


class LaunchError(TensorRPCError, RuntimeError):
    """The engines could not be launched: resources, actor start-up, or joining the client.

    Attributes:
        engines: What the launcher knew about each engine when it gave up (may be empty).
    """

    def __init__(self, message: str, *, engines: Mapping[str, RayEngine] | None = None) -> None:
        super().__init__(message)
        self.engines: Mapping[str, RayEngine] = MappingProxyType(dict(engines or {}))


@dataclasses.dataclass(frozen=True, slots=True)
class RayEngine:
    """One launched engine (a snapshot).

    Attributes:
        engine_id: The engine's id on the client.
        node_id: The Ray node the actor runs on (hex), ``""`` before it started.
        node_address: That node's address as Ray knows it.
        pid: The process id of the actor's current incarnation (0 before it started).
        address: The address the engine dials (``bind=False``) or listens on (``bind=True``).
        state: See [`EngineState`][tensorrpc.ray.EngineState].
        restarts: How many times Ray restarted the actor.
        error: Why the engine is ``"dead"`` or ``"failed"`` (``""`` otherwise).
    """

    engine_id: str
    node_id: str
    node_address: str
    pid: int
    address: str
    state: EngineState
    restarts: int = 0
    error: str = ""


# -- the actor --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _EngineSpec:
    service_cls: Callable[..., object]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    engine_id: str
    connect: str | None
    bind: bool
    curve: CurveConfig | None
    serve_options: Mapping[str, Any]
    rejoin_timeout: float


def _tcp(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class _EngineActor:
    """The Ray actor: serves one engine in a thread of its own (an asyncio loop)."""

    def __init__(self, spec: _EngineSpec) -> None:
        self._spec = spec
        self._node_address = str(_ray.util.get_node_ip_address())
        self._ready = threading.Event()
        self._server: Server | None = None
        self._error = ""
        try:
            instance = spec.service_cls(*spec.args, **dict(spec.kwargs))
        except Exception as exc:  # reported by describe(), without Ray's wrapping
            self._error = f"the service's constructor raised {type(exc).__name__}: {exc}"
            return
        self._portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
        self._portal = self._portal_cm.__enter__()
        self._future = self._portal.start_task_soon(_serve_engine, self, instance)

    def describe(self, timeout: float) -> dict[str, Any]:
        """Where the engine runs; waits until its server is up (or failed)."""
        where = {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_address": self._node_address,
            "pid": os.getpid(),
        }
        if self._error:
            return {**where, "address": "", "error": self._error}
        self._ready.wait(timeout)
        if self._future.done() and self._future.result():
            return {**where, "address": "", "error": self._future.result()}
        server = self._server
        if server is None:
            return {**where, "address": "", "error": f"not serving after {timeout} s"}
        address = (server.endpoint or "") if self._spec.bind else (self._spec.connect or "")
        return {**where, "address": address, "error": ""}

    def wait(self) -> str:
        """Block until the engine stops serving; ``""`` or why it failed."""
        return self._error or self._future.result()

    def set_health(self, status: str) -> str:
        """Set what the engine's health method answers; ``""`` or why not."""
        server = self._server
        if self._error or server is None or self._future.done():
            return self._error or "the engine is not serving"
        try:
            self._portal.call(server.set_health, HealthStatus(status))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    def stop(self, timeout: float) -> str:
        """Drain the engine (calls finish, BYE), then stop its thread."""
        if self._error:
            return self._error
        server = self._server
        if server is not None and not self._future.done():
            with contextlib.suppress(Exception):
                self._portal.call(server.aclose)
        try:
            return self._future.result(timeout)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            with contextlib.suppress(Exception):
                self._portal_cm.__exit__(None, None, None)


async def _serve_engine(actor: _EngineActor, instance: object) -> str:
    # A module function, not a method: Ray makes an actor with any `async def` method an
    # asyncio actor whose methods all share one thread, and wait() would then block stop().
    spec = actor._spec
    deadline = time.monotonic() + spec.rejoin_timeout
    while True:
        server = Server(
            instance,
            connect=spec.connect,
            bind=_tcp(actor._node_address, 0) if spec.bind else None,
            engine_id=spec.engine_id,
            curve=spec.curve,
            **dict(spec.serve_options),
        )
        try:
            async with server:
                actor._server = server
                actor._ready.set()
                await server.serve_forever()
            return ""
        except HandshakeRejectedError as exc:
            # A restarted actor may say HELLO before the client has seen its previous
            # incarnation die; the id is free again within the client's dead_after.
            if exc.reason != "duplicate_id" or time.monotonic() > deadline:
                return f"{type(exc).__name__}: {exc}"
            await anyio.sleep(0.2)
        except Exception as exc:
            actor._ready.set()
            return f"{type(exc).__name__}: {exc}"


# -- the launcher -----------------------------------------------------------------------------


@dataclasses.dataclass(slots=True, eq=False)
class _Slot:
    engine_id: str
    actor: Any
    node_id: str = ""
    node_address: str = ""
    pid: int = 0
    address: str = ""
    phase: Literal["starting", "running", "restarting", "dead", "failed", "stopped"] = "starting"
    restarts: int = 0
    error: str = ""
    ref: Any = None
    ref_kind: Literal["describe", "wait", ""] = ""


def _wait_placed(pg: Any, timeout: float) -> bool | str:
    """Blocking: True once ``pg`` is placed; False after ``timeout``; ``"infeasible"`` as
    soon as Ray finds that no node can ever hold a bundle (busy nodes only make it wait)."""
    ready = pg.ready()
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if ray.wait([ready], timeout=min(left, _INFEASIBLE_POLL_S))[0]:
            return True
        with contextlib.suppress(Exception):  # the table is informative only
            if placement_group_table(pg)["stats"]["scheduling_state"] == "INFEASIBLE":
                return "infeasible"


def _wait_any(refs: list[Any], timeout: float) -> list[tuple[Any, Any, BaseException | None]]:
    """Blocking: the refs that finish within ``timeout`` (at least one, if any does)."""
    ready, rest = ray.wait(refs, num_returns=1, timeout=timeout)
    if ready and rest:
        ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
    out: list[tuple[Any, Any, BaseException | None]] = []
    for ref in ready:
        try:
            out.append((ref, ray.get(ref), None))
        except Exception as exc:
            out.append((ref, None, exc))
    return out


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


@dataclasses.dataclass(frozen=True, slots=True)
class _Launch:
    """What `launch` was asked for (see its arguments)."""

    service_cls: type[Any]
    n: int
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    num_cpus: float
    num_gpus: float
    placement: Placement
    max_restarts: int
    engine_ids: tuple[str, ...]
    bind: bool
    engine_keys: CurveKeyPair | None
    serve_options: Mapping[str, Any]
    ray_options: Mapping[str, Any]
    timeout: float
    join_timeout: float | None


class EngineGroup:
    """The engines of one [`launch`][tensorrpc.ray.launch]: an async context manager.

    Entering it places and starts the actors and waits until every engine joined the
    client (or raises [`LaunchError`][tensorrpc.ray.LaunchError]); leaving it calls
    [`stop`][tensorrpc.ray.EngineGroup.stop].
    """

    def __init__(self, plan: _Launch, client: Client[Any], client_address: str | None) -> None:
        self._plan = plan
        self._client = client
        self._client_address = client_address
        self._slots: dict[str, _Slot] = {}
        self._pg: Any = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._stopped = False
        self._entered = False
        self._connected: list[str] = []
        self._keys: dict[str, bytes] = {}

    # -- public -----------------------------------------------------------------------------

    @property
    def address(self) -> str | None:
        """The client address the engines dial (``None`` with ``bind=True``)."""
        return None if self._plan.bind else self._client_address

    @property
    def engines(self) -> Mapping[str, RayEngine]:
        """Engine id → where it runs and its state (a snapshot)."""
        live = self._client.engines
        out: dict[str, RayEngine] = {}
        for engine_id, slot in self._slots.items():
            state: EngineState
            if slot.phase == "running":
                info = live.get(engine_id)
                state = "live" if info is not None and info.pid == slot.pid else "joining"
            else:
                state = slot.phase
            where = (slot.node_id, slot.node_address, slot.pid, slot.address)
            out[engine_id] = RayEngine(engine_id, *where, state, slot.restarts, slot.error)
        return MappingProxyType(out)

    def actor(self, engine_id: str) -> Any:
        """The Ray actor handle of an engine (for ``ray.kill``, custom actor calls).

        Raises:
            KeyError: Not an engine of this group.
        """
        return self._slots[engine_id].actor

    @property
    def placement_group(self) -> Any:
        """The Ray placement group holding the actors (``None`` once stopped)."""
        return self._pg

    async def health(
        self,
        *,
        service: str = "",
        timeout: float = 5.0,  # noqa: ASYNC109 - each answer's deadline
    ) -> dict[str, HealthStatus]:
        """Ask every engine of the group through the standard health method.

        Engines answer on their loop without a worker, ``NOT_SERVING`` while they drain;
        an engine that is not live on the client (joining, restarting, stopped) or gives
        no answer within ``timeout`` is ``UNKNOWN``.

        Args:
            service: The service asked about (``""``: each engine as a whole).
            timeout: Seconds for each answer.

        Returns:
            Engine id → its status, for every engine of the group.
        """
        client = self._client
        out = dict.fromkeys(self._slots, HealthStatus.UNKNOWN)

        async def one(engine_id: str) -> None:
            with contextlib.suppress(TensorRPCError):
                out[engine_id] = await client.health(engine_id, service=service, timeout=timeout)

        async with anyio.create_task_group() as tg:
            for engine_id, engine in self.engines.items():
                if engine.state == "live":
                    tg.start_soon(one, engine_id)
        return out

    async def set_health(
        self,
        engine_id: str,
        status: HealthStatus,
        *,
        timeout: float = 10.0,  # noqa: ASYNC109 - bounds the actor call
    ) -> None:
        """Set what one engine's health method answers (`Server.set_health` in its actor):
        ``NOT_SERVING`` takes it out of rotation while it still accepts calls.

        Args:
            engine_id: An engine of this group.
            status: ``HealthStatus.SERVING`` or ``HealthStatus.NOT_SERVING``.
            timeout: Seconds for the actor to answer.

        Raises:
            KeyError: Not an engine of this group.
            ValueError: Another status.
            LaunchError: The actor did not set it (not serving, or no answer in time).
        """
        slot = self._slots[engine_id]
        if status not in (HealthStatus.SERVING, HealthStatus.NOT_SERVING):
            raise ValueError(f"an engine is SERVING or NOT_SERVING, not {status.value}")
        ref = slot.actor.set_health.remote(status.value)
        ready, _ = await anyio.to_thread.run_sync(lambda: ray.wait([ref], timeout=timeout))
        why = ray.get(ready[0]) if ready else f"no answer within {timeout} s"
        if why:
            raise LaunchError(f"engine {engine_id!r}: cannot set its health: {why}")

    async def __aenter__(self) -> EngineGroup:
        if self._entered:
            raise RuntimeError("an EngineGroup can be entered only once")
        self._entered = True
        try:
            await self._start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._teardown(drain=False)
            raise
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._monitor, name="tensorrpc.ray monitor")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            with anyio.CancelScope(shield=True):
                await self.stop()
        finally:
            tg, self._tg = self._tg, None
            if tg is not None:
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)
        return None

    async def stop(self, grace_period: float | None = None) -> None:
        """Drain every engine, then kill the actors and remove the placement group.

        Each engine refuses new calls, lets its running calls finish within its grace
        period and says BYE; actors that do not finish in time are killed anyway.
        Idempotent.

        Args:
            grace_period: Seconds to wait for the drains (default: the engines' grace
                period plus 10 s).
        """
        if self._stopped:
            return
        self._stopped = True
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        if grace_period is None:
            grace_period = float(self._plan.serve_options.get("grace_period", 5.0)) + 10.0
        await self._teardown(drain=True, wait=grace_period)

    # -- start ------------------------------------------------------------------------------

    async def _start(self) -> None:
        spec_curve = self._engine_curves()
        if self._keys:
            self._client.bind_engine_keys(self._keys)
        if not self._plan.bind:
            self._client_address = self._client_address or _reachable_address(self._client)
        deadline = time.monotonic() + self._plan.timeout
        await self._place()
        self._spawn(spec_curve)
        # Every actor reports where it runs, then every engine joins the client.
        await self._wait_started(deadline)
        if self._plan.join_timeout is not None:
            deadline = time.monotonic() + self._plan.join_timeout
        if self._plan.bind:
            for slot in self._slots.values():
                self._client.connect(slot.address)
                self._connected.append(slot.address)
        await self._wait_joined(deadline)

    async def _place(self) -> None:
        """Create the placement group (one bundle per engine) and wait until it is placed."""
        plan = self._plan
        bundle: dict[str, float] = {"CPU": float(plan.num_cpus)}
        if plan.num_gpus:
            bundle["GPU"] = float(plan.num_gpus)
        strategy = _STRATEGIES[plan.placement]
        self._pg = placement_group([dict(bundle) for _ in range(plan.n)], strategy=strategy)
        placed = await anyio.to_thread.run_sync(_wait_placed, self._pg, plan.timeout)
        what = f"Ray could not place {plan.n} engines of {bundle} each ({strategy})"
        if placed == "infeasible":
            raise LaunchError(
                f"{what}: no node of the cluster can ever hold one (Ray found the placement "
                f"infeasible); the cluster has {_resources(_ray.cluster_resources())} in all"
            )
        if not placed:
            raise LaunchError(
                f"{what} within {plan.timeout} s: the cluster has "
                f"{_resources(_ray.cluster_resources())} in all, "
                f"{_resources(_ray.available_resources())} available"
            )

    def _spawn(self, spec_curve: list[CurveConfig | None]) -> None:
        """Start one actor per engine in its bundle; each is asked where it runs."""
        rejoin = float(self._plan.serve_options.get("dead_after", 5.0)) * 2 + 5.0
        remote_cls: Any = ray.remote(_EngineActor)
        for index, engine_id in enumerate(self._plan.engine_ids):
            spec = _EngineSpec(
                service_cls=self._plan.service_cls,
                args=self._plan.args,
                kwargs=self._plan.kwargs,
                engine_id=engine_id,
                connect=None if self._plan.bind else self._client_address,
                bind=self._plan.bind,
                curve=spec_curve[index],
                serve_options=self._plan.serve_options,
                rejoin_timeout=rejoin,
            )
            actor = remote_cls.options(
                num_cpus=self._plan.num_cpus,
                num_gpus=self._plan.num_gpus,
                max_restarts=self._plan.max_restarts,
                max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=index
                ),
                **self._plan.ray_options,
            ).remote(spec)
            slot = _Slot(engine_id, actor)
            slot.ref, slot.ref_kind = actor.describe.remote(self._plan.timeout), "describe"
            self._slots[engine_id] = slot

    async def _wait_started(self, deadline: float) -> None:
        """Wait until every actor has started (or raise when one failed or time is up)."""
        while any(s.phase in ("starting", "restarting") for s in self._slots.values()):
            await self._poll(min(0.5, max(0.0, deadline - time.monotonic())))
            self._raise_if_failed()
            if time.monotonic() > deadline:
                waiting = [k for k, s in self._slots.items() if s.phase == "starting"]
                raise LaunchError(
                    f"engines {', '.join(waiting)} did not start within {self._plan.timeout} s",
                    engines=self.engines,
                )

    async def _wait_joined(self, deadline: float) -> None:
        """Wait until every engine is live on the client (or raise)."""
        client = self._client
        joining = time.monotonic()
        while True:
            missing = [k for k, e in self.engines.items() if e.state != "live"]
            if not missing:
                return
            self._raise_if_failed()
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(self._join_failure(missing, joining), engines=self.engines)
            with anyio.move_on_after(min(left, 0.2)):
                await client.wait_for_engines(len(client.engines) + 1)
            await self._poll(0)

    def _engine_curves(self) -> list[CurveConfig | None]:
        """Each engine's CURVE configuration; dial-in: one fresh keypair per engine, its
        public key bound to the engine's id (``self._keys``, bound on the client in
        `_start`) and its secret key handed to the actor in its Ray arguments."""
        curve = self._client.curve
        if curve is None:
            if self._plan.engine_keys is not None:
                raise ValueError("engine_keys given, but the client does not use CURVE")
            return [None] * self._plan.n
        if not self._plan.bind:
            if not isinstance(curve, CurveServerConfig):
                raise ValueError(
                    "engines dial in: the client must be the CURVE server "
                    "(Client(curve=tensorrpc.ray.client_curve()))"
                )
            if self._plan.engine_keys is not None:
                raise ValueError(
                    "engines dial in: the launcher makes one keypair per engine; "
                    "engine_keys= is for bind=True"
                )
            pairs = [generate_keypair() for _ in range(self._plan.n)]
            self._keys = {
                engine_id: pair.public_key
                for engine_id, pair in zip(self._plan.engine_ids, pairs, strict=True)
            }
            server_key = curve.keypair.public_key
            return [CurveClientConfig(pair, server_key) for pair in pairs]
        if not isinstance(curve, CurveClientConfig):
            raise ValueError(
                "engines bind: the client must be a CURVE client "
                "(Client(curve=CurveClientConfig(client_keys, engine_public_key)))"
            )
        if (
            self._plan.engine_keys is None
            or self._plan.engine_keys.public_key != curve.server_public_key
        ):
            raise ValueError(
                "engines bind with CURVE: pass engine_keys= with the keypair whose public key "
                "the client's CurveClientConfig names as server_public_key"
            )
        server = CurveServerConfig(self._plan.engine_keys, {curve.keypair.public_key})
        return [server] * self._plan.n

    def _raise_if_failed(self) -> None:
        bad = {k: s for k, s in self._slots.items() if s.phase in ("dead", "failed")}
        if bad:
            text = "; ".join(
                f"{k} on node {s.node_address or '?'}: {s.error}" for k, s in bad.items()
            )
            raise LaunchError(f"engines failed to start: {text}", engines=self.engines)

    def _join_failure(self, missing: list[str], since: float) -> str:
        engines = self.engines
        waited = f"{time.monotonic() - since:.1f} s"
        where = ", ".join(
            f"{k} (pid {engines[k].pid} on {engines[k].node_address})" for k in missing
        )
        if self._plan.bind:
            tried = ", ".join(engines[k].address for k in missing)
            text = (
                f"engines {where} run but did not join within {waited}: the client "
                f"dialled {tried}; are those addresses reachable from this process?"
            )
        else:
            text = (
                f"engines {where} run but did not join within {waited}: they dial "
                f"the client at {self._client_address}; is that address reachable from "
                "their nodes (firewall, interface, CURVE keys)?"
            )
        refused = {k: v for k, v in self._client.rejected.items() if k in missing}
        if refused:
            text += " Refused: " + "; ".join(f"{k}: {v}" for k, v in sorted(refused.items()))
        return text

    # -- watching ---------------------------------------------------------------------------

    async def _monitor(self) -> None:
        while True:
            if any(s.ref is not None for s in self._slots.values()):
                await self._poll(0.5)
            else:
                await anyio.sleep_forever()

    async def _poll(self, wait_s: float) -> None:
        pending = {id(s.ref): s for s in self._slots.values() if s.ref is not None}
        if not pending:
            return
        refs = [s.ref for s in pending.values()]
        results = await anyio.to_thread.run_sync(_wait_any, refs, wait_s, abandon_on_cancel=True)
        by_ref = {id(s.ref): s for s in pending.values()}
        for ref, value, error in results:
            slot = by_ref.get(id(ref))
            if slot is not None and slot.ref is ref:
                self._on_result(slot, value, error)

    def _on_result(self, slot: _Slot, value: Any, error: BaseException | None) -> None:
        slot.ref, kind, slot.ref_kind = None, slot.ref_kind, ""
        if self._stopped:
            return
        if error is None and kind == "describe":
            slot.node_id = str(value["node_id"])
            slot.node_address = str(value["node_address"])
            slot.pid = int(value["pid"])
            slot.address = str(value["address"])
            if value["error"]:
                slot.phase, slot.error = "failed", str(value["error"])
                return
            slot.phase = "running"
            slot.ref, slot.ref_kind = slot.actor.wait.remote(), "wait"
            return
        if error is None:  # wait() returned: the engine stopped serving on its own
            slot.phase = "failed" if value else "stopped"
            slot.error = str(value)
            return
        if kind == "describe" and isinstance(error, ray.exceptions.ActorUnavailableError):
            # still restarting: ask again (Ray queues the call until the actor is back)
            slot.ref, slot.ref_kind = slot.actor.describe.remote(self._plan.timeout), "describe"
            return
        died = isinstance(error, ray.exceptions.RayActorError)
        reason = _short(error)
        if slot.pid:
            self._client.declare_dead(slot.engine_id, pid=slot.pid, reason=f"died (Ray: {reason})")
        if died and kind == "wait" and slot.restarts < self._plan.max_restarts:
            slot.restarts += 1
            slot.phase = "restarting"
            slot.ref, slot.ref_kind = slot.actor.describe.remote(self._plan.timeout), "describe"
            return
        slot.phase = "dead" if died else "failed"
        slot.error = reason

    # -- teardown ---------------------------------------------------------------------------

    async def _teardown(self, *, drain: bool, wait: float = 0.0) -> None:
        self._stopped = True
        slots = list(self._slots.values())
        if drain and slots:
            refs = [s.actor.stop.remote(wait) for s in slots if s.phase == "running"]
            if refs:
                await anyio.to_thread.run_sync(
                    lambda: ray.wait(refs, num_returns=len(refs), timeout=wait)
                )
        with contextlib.suppress(ClosedError):
            if drain:
                # The engines said BYE before their sockets closed; let the client read
                # them, then take out (by pid) any incarnation it still holds.
                with anyio.move_on_after(2.0):
                    while self._held_by_client():
                        with anyio.move_on_after(0.1):
                            await self._client.wait_for_engines(len(self._client.engines) + 1)
            for slot in slots:
                if slot.pid:
                    self._client.declare_dead(slot.engine_id, pid=slot.pid, reason="was stopped")
        for address in self._connected:
            with contextlib.suppress(TensorRPCError):
                self._client.disconnect(address)
        self._connected.clear()
        with contextlib.suppress(TensorRPCError, ValueError):
            self._client.unbind_engine_keys(self._keys)
        for slot in slots:
            with contextlib.suppress(Exception):
                ray.kill(slot.actor, no_restart=True)
            if slot.phase not in ("dead", "failed"):
                slot.phase = "stopped"
            slot.ref = None
        if self._pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)

    def _held_by_client(self) -> bool:
        live = self._client.engines
        return any(
            (info := live.get(slot.engine_id)) is not None and info.pid == slot.pid
            for slot in self._slots.values()
        )


def _resources(resources: Mapping[str, float]) -> str:
    shown = {k: v for k, v in sorted(resources.items()) if not k.startswith("node:")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in shown.items()) + "}"


def _reachable_address(client: Client[Any]) -> str:
    """The client's bound tcp:// address as the other Ray nodes can reach it.

    A wildcard host (``0.0.0.0``, ``*``, ``::``) becomes this node's address as Ray knows
    it (``ray.util.get_node_ip_address()``); a specific host is kept, since it is the only
    one the socket listens on.
    """
    for address in client.addresses:
        if not address.startswith("tcp://"):
            continue
        host, _, port = address[len("tcp://") :].rpartition(":")
        host = host.strip("[]")
        if host in ("0.0.0.0", "*", "::", ""):
            host = str(_ray.util.get_node_ip_address())
        return _tcp(host, port)
    raise ValueError(
        "engines on Ray nodes dial the client over tcp://: bind the client to a tcp:// "
        f"address (tcp://0.0.0.0:0 with CURVE, or the node's address); it is bound to "
        f"{list(client.addresses) or 'nothing'}"
    )


def client_curve() -> CurveServerConfig:
    """The CURVE configuration of a client that launched engines dial into.

    A fresh keypair and an empty allow-list: [`launch`][tensorrpc.ray.launch] adds one
    key per engine it starts (the secret handed to the actor through Ray) and removes
    them when its group stops.

    Returns:
        A ``CurveServerConfig`` for ``Client(curve=...)``.
    """
    return CurveServerConfig(generate_keypair(), frozenset())


def _exposure(
    *,
    bind: bool,
    client_binds: Sequence[str],
    client_address: str | None,
    node_addresses: Sequence[str],
    here: str,
) -> str:
    """Why the engines' link to the client may cross hosts or reach the network (``""``:
    every socket of the launch stays on this host): the launcher then needs CURVE.
    ``node_addresses`` are the alive Ray nodes', ``here`` this process's node address."""
    others = sorted({a for a in node_addresses if a and a != here and not _loopback_host(a)})
    if others:
        return f"the Ray cluster has nodes on other hosts ({', '.join(others)})"
    if bind:
        hosts = sorted({a for a in [*node_addresses, here] if a and not _loopback_host(a)})
        return f"the engines listen on their node's address ({', '.join(hosts)})" if hosts else ""
    if client_address is not None and not is_loopback(client_address):
        return f"the engines dial the client at {client_address}"
    exposed = [a for a in client_binds if not is_loopback(a)]
    return f"the client listens on {', '.join(exposed)}" if exposed else ""


def _loopback_host(host: str) -> bool:
    return is_loopback(_tcp(host, 0))


def _check_exposure(
    client: Client[Any], bind: bool, client_address: str | None, allow_plaintext: bool
) -> None:
    if client.curve is not None or allow_plaintext:
        return
    why = _exposure(
        bind=bind,
        client_binds=client.addresses,
        client_address=client_address,
        node_addresses=[
            str(n.get("NodeManagerAddress", "")) for n in _ray.nodes() if n.get("Alive")
        ],
        here=str(_ray.util.get_node_ip_address()),
    )
    if not why:
        return
    if bind:
        how = (
            "give the client curve=CurveClientConfig(client_keys, engine_keys.public_key) "
            "and launch(..., engine_keys=engine_keys)"
        )
    else:
        how = (
            'build the client with Client(Service, bind="tcp://0.0.0.0:0", '
            "curve=tensorrpc.ray.client_curve()): the launcher then makes one key per "
            "engine, hands it to the actor through Ray and lets only those keys in"
        )
    raise LaunchError(
        f"refusing to launch without CURVE: {why}, so anyone who can reach those sockets "
        f"could join as an engine or call it in plaintext. To secure it, {how}. On a "
        "network you trust, pass allow_plaintext=True."
    )


def _check_launch(
    n: int, placement: str, max_restarts: int, timeout: float, join_timeout: float | None
) -> None:
    if n < 1:
        raise ValueError("n must be at least 1")
    if placement not in _STRATEGIES:
        raise ValueError(f"placement must be 'spread' or 'pack', not {placement!r}")
    if max_restarts < 0:
        raise ValueError("max_restarts must be at least 0")
    if timeout <= 0 or (join_timeout is not None and join_timeout <= 0):
        raise ValueError("timeouts must be positive")


def _launch_ids(
    client: Client[Any], n: int, engine_ids: Sequence[str] | None, bind: bool
) -> list[str]:
    """The engines' ids, checked, once the client and Ray can take them."""
    name = client.service.name
    ids = list(engine_ids) if engine_ids is not None else [f"{name}-{i}" for i in range(n)]
    if len(ids) != n or len(set(ids)) != n:
        raise ValueError(f"engine_ids must be {n} distinct ids, got {ids!r}")
    taken = sorted(set(ids) & set(client.engines))
    if taken:
        raise ValueError(f"engine ids already live on the client: {', '.join(taken)}")
    if not bind and not any(a.startswith("tcp://") for a in client.addresses):
        _reachable_address(client)  # raises the explanation
    if not ray.is_initialized():
        raise RuntimeError(
            "Ray is not initialised: call ray.init(address=...) first (or launch from a "
            "Ray task or actor)"
        )
    return ids


def launch(
    service_cls: type[Any],
    n: int,
    *,
    client: Client[Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    placement: Placement = "spread",
    max_restarts: int = 0,
    engine_ids: Sequence[str] | None = None,
    bind: bool = False,
    client_address: str | None = None,
    engine_keys: CurveKeyPair | None = None,
    allow_plaintext: bool = False,
    serve_options: Mapping[str, Any] | None = None,
    ray_options: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    join_timeout: float | None = None,
) -> EngineGroup:
    """Start ``n`` engines of ``service_cls`` as Ray actors and join them to ``client``.

    Use the result as an async context manager: entering it returns once every engine
    is live on the client; leaving it drains and stops them. Ray must be initialised
    (``ray.init(address=...)`` in this process, or running inside a Ray task or actor).

    Args:
        service_cls: The ``@service`` class; each actor calls ``service_cls(*args,
            **kwargs)`` on its node. It must be importable on the nodes (or picklable by
            value, as Ray does for classes defined in ``__main__``).
        n: How many engines.
        client: The open client the engines join.
        args: Positional arguments of the service's constructor.
        kwargs: Keyword arguments of the service's constructor.
        num_cpus: CPUs per engine (a placement group bundle and the actor's request).
        num_gpus: GPUs per engine; Ray sets ``CUDA_VISIBLE_DEVICES`` in the actor.
        placement: ``"spread"`` or ``"pack"`` (see [`Placement`][tensorrpc.ray.Placement]).
        max_restarts: How often Ray restarts a dead actor; it rejoins with the same id.
        engine_ids: The engines' ids (default ``"{service}-{i}"``); ``n`` distinct ids,
            none live on the client.
        bind: ``False``: the engines dial the client (it must be bound to ``tcp://``).
            ``True``: each engine listens on its node's address and the client dials it.
        client_address: The address engines dial, when the automatic one (the client's
            port on this node's Ray address) is not reachable from the nodes (NAT, a
            Kubernetes service).
        engine_keys: ``bind=True`` with CURVE: the engines' keypair, whose public key the
            client's ``CurveClientConfig`` names. Dial-in takes none: the launcher makes
            one keypair per engine (see [`client_curve`][tensorrpc.ray.client_curve]).
        allow_plaintext: Launch without CURVE even when engines may run on other hosts or
            a socket of the launch listens beyond loopback (a network you trust);
            otherwise such a launch raises `LaunchError`.
        serve_options: Other keyword arguments of [`serve`][tensorrpc.serve]
            (``grace_period``, ``heartbeat_interval``, ``max_concurrency``, ...).
        ray_options: Other options of the actors (``runtime_env``, ``resources``, ...).
        timeout: Seconds for placing the actors, starting them and joining the client.
        join_timeout: Seconds for the engines to join the client once their actors run
            (default: what is left of ``timeout``).

    Returns:
        The [`EngineGroup`][tensorrpc.ray.EngineGroup], to enter with ``async with``.

    Raises:
        ValueError: Bad arguments (sizes, ids, CURVE roles, a client not bound to tcp://).
        RuntimeError: Ray is not initialised.
        LaunchError: The client has no CURVE and engines may run on other hosts or a
            socket of the launch listens beyond loopback (see ``allow_plaintext``).
    """
    _check_launch(n, placement, max_restarts, timeout, join_timeout)
    ids = _launch_ids(client, n, engine_ids, bind)
    _check_exposure(client, bind, client_address, allow_plaintext)
    plan = _Launch(
        service_cls, n, tuple(args), dict(kwargs or {}), num_cpus, num_gpus, placement,
        max_restarts, tuple(ids), bind, engine_keys, dict(serve_options or {}),
        dict(ray_options or {}), timeout, join_timeout,
    )  # fmt: skip
    return EngineGroup(plan, client, client_address)
