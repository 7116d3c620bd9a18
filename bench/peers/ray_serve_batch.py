"""Ray Serve's ``@serve.batch`` on the handler of `bench.batching` (a child: the Ray driver).

``python -m bench.peers.ray_serve_batch --seconds S --temp-dir D [--mode M]`` starts a
private Ray instance on loopback (``address="local"``, ``_node_ip_address="127.0.0.1"``,
no dashboard, its own temp dir, usage stats off; Ray picks free ports) and Serve without
its HTTP proxy (``proxy_location="Disabled"``: the handle is the only way in), deploys one
replica whose method is decorated with ``@serve.batch(max_batch_size=CALLERS,
batch_wait_timeout_s=MAX_DELAY_S)`` and costs one ``STEP_S`` step on one "device" per batch
(the same handler and settings as tensorrpc's line), then runs `bench.batching`'s 64
callers from an asyncio loop in the driver, each ``await handle.batched.remote(x)`` as
Serve's documentation shows. Serve gets its best settings: every caller's request is
admitted to the replica at once (``max_ongoing_requests``; Serve's default is 5), the
replica's per-request access log is off, and warm-up is not recorded. ``--mode``:

* ``default``: Serve's request path as shipped (the handle's router on its own event
  loop thread, calls to the replica as Ray actor calls);
* ``throughput``: ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, Serve's documented high-throughput
  mode (router and user code on the caller's and replica's own loops, handle calls over
  direct gRPC, request-path logs buffered, the replica's heap frozen after start-up),
  with ``RAY_SERVE_ENABLE_DIRECT_INGRESS=0`` (direct ingress is HTTP on port 8000, which
  a handle does not use).

It prints the figures as one JSON line and shuts Serve and Ray down; `bench.batching`
bounds it and kills its process group past the bound.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

#: The environment each ``--mode`` sets before Ray is imported (Serve reads it then, and
#: Ray's processes inherit it).
MODES: dict[str, dict[str, str]] = {
    "default": {},
    "throughput": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"},
}


def _deployment(callers: int, wait_s: float, step_s: float) -> Any:
    from ray import serve
    from ray.serve.schema import LoggingConfig

    @serve.deployment(
        max_ongoing_requests=4 * callers,
        ray_actor_options={"num_cpus": 0},
        logging_config=LoggingConfig(enable_access_log=False),
    )
    class Model:
        def __init__(self) -> None:
            self._device = asyncio.Lock()
            self._counts = [0, 0]

        @serve.batch(max_batch_size=callers, batch_wait_timeout_s=wait_s)
        async def batched(self, xs: list[int]) -> list[int]:
            self._counts[0] += 1
            self._counts[1] += len(xs)
            async with self._device:
                await asyncio.sleep(step_s)
            return [v + 1 for v in xs]

        async def counts(self) -> tuple[int, int]:
            return self._counts[0], self._counts[1]

    return Model


async def _measure(seconds: float) -> dict[str, Any]:
    from ray import serve

    from bench.batching import unary

    # The handle is taken on this loop: in throughput mode its router runs on it.
    handle: Any = serve.get_app_handle("batching")

    class Stub:
        """`bench.batching.unary`'s view: ``await stub.batched(x)``."""

        async def batched(self, x: int) -> int:
            result: int = await handle.batched.remote(x)
            return result

    try:
        stub = Stub()
        await unary(stub, "batched", seconds / 4)  # warm-up, not recorded
        before = await handle.counts.remote()
        cpu = time.process_time()
        out = await unary(stub, "batched", seconds)
        cpu = time.process_time() - cpu
        after = await handle.counts.remote()
        runs = after[0] - before[0]
        out["mean_batch"] = (after[1] - before[1]) / runs if runs else None
        out["client_cpu_us"] = cpu / out["n"] * 1e6 if out["n"] else None
        return out
    finally:
        await serve.shutdown_async()  # type: ignore[no-untyped-call]


def _start_ray(temp_dir: str) -> None:
    """``ray.init`` a private node; once more if it fails to start (on a loaded machine its
    raylet can time out waiting for its metrics agent, a Python process, to come up)."""
    import ray

    for attempt in (1, 2):
        try:
            ray.init(
                address="local",
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                _node_ip_address="127.0.0.1",
                _temp_dir=temp_dir,
            )
            return
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise


def _driver(seconds: float, temp_dir: str, mode: str) -> dict[str, Any]:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # Without it Ray swaps a loopback _node_ip_address for this host's outward address.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.update(MODES[mode])
    import ray
    from ray import serve

    from bench.batching import CALLERS, MAX_DELAY_S, STEP_S

    _start_ray(temp_dir)
    try:
        serve.start(proxy_location="Disabled")
        app: Any = _deployment(CALLERS, MAX_DELAY_S, STEP_S)
        serve.run(app.bind(), name="batching", route_prefix=None)
        result: dict[str, Any] = asyncio.run(asyncio.wait_for(_measure(seconds), 20 * seconds + 60))
        result["mode"] = mode
        return result
    finally:
        ray.shutdown()


def main() -> None:
    """Driver entry point."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--temp-dir", required=True)
    parser.add_argument("--mode", choices=sorted(MODES), default="default")
    args = parser.parse_args()
    from bench.peers._suite import emit

    emit(_driver(args.seconds, args.temp_dir, args.mode))


if __name__ == "__main__":
    main()
