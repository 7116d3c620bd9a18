"""Ray Serve's ``@serve.batch`` on the handler of `bench.batching` (a child: the Ray driver).

``python -m bench.peers.ray_serve_batch --seconds S --temp-dir D`` starts a private local
Ray instance on loopback (``_node_ip_address="127.0.0.1"``, no dashboard, its own temp
dir, usage stats off) and Serve without its HTTP proxy (``proxy_location="Disabled"``:
the handle is the only way in), deploys one replica whose method is decorated with
``@serve.batch(max_batch_size=CALLERS, batch_wait_timeout_s=MAX_DELAY_S)`` and costs one
``STEP_S`` step on one "device" per batch (the same handler and settings as tensorrpc's
line), then runs `bench.batching`'s 64 callers from an asyncio loop in the driver, each
``await handle.batched.remote(x)`` as Serve's documentation shows. It prints the figures
as one JSON line and shuts Serve and Ray down; `bench.batching` bounds it and kills its
process group past the bound.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any


def _driver(seconds: float, temp_dir: str) -> dict[str, Any]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback stays loopback
    import ray
    from ray import serve

    from bench.batching import CALLERS, MAX_DELAY_S, STEP_S, unary

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=temp_dir,
    )
    try:
        serve.start(proxy_location="Disabled")

        # every caller's request is admitted to the replica at once (Serve's default
        # bound is 5 ongoing requests), so that batches can fill
        @serve.deployment(max_ongoing_requests=4 * CALLERS, ray_actor_options={"num_cpus": 0})
        class Model:
            def __init__(self) -> None:
                self._device = asyncio.Lock()
                self._counts = [0, 0]

            @serve.batch(max_batch_size=CALLERS, batch_wait_timeout_s=MAX_DELAY_S)
            async def batched(self, xs: list[int]) -> list[int]:
                self._counts[0] += 1
                self._counts[1] += len(xs)
                async with self._device:
                    await asyncio.sleep(STEP_S)
                return [v + 1 for v in xs]

            async def counts(self) -> tuple[int, int]:
                return self._counts[0], self._counts[1]

        app: Any = Model  # a serve.Deployment (its stubs type the decorator as identity)
        handle: Any = serve.run(app.bind(), name="batching", route_prefix=None)

        class Stub:
            """`bench.batching.unary`'s view: ``await stub.batched(x)``."""

            async def batched(self, x: int) -> int:
                result: int = await handle.batched.remote(x)
                return result

        async def measure() -> dict[str, Any]:
            stub = Stub()
            await unary(stub, "batched", seconds / 4)  # warm-up, not recorded
            before = await handle.counts.remote()
            out = await unary(stub, "batched", seconds)
            after = await handle.counts.remote()
            runs = after[0] - before[0]
            out["mean_batch"] = (after[1] - before[1]) / runs if runs else None
            return out

        result: dict[str, Any] = asyncio.run(asyncio.wait_for(measure(), 20 * seconds + 60))
        return result
    finally:
        try:
            serve.shutdown()  # type: ignore[no-untyped-call]
        finally:
            ray.shutdown()


def main() -> None:
    """Driver entry point."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--temp-dir", required=True)
    args = parser.parse_args()
    from bench.peers._suite import emit

    emit(_driver(args.seconds, args.temp_dir))


if __name__ == "__main__":
    main()
