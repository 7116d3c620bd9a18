"""Ray actors doing the mixed load of `bench.mixed` (a child process: the Ray driver).

``python -m bench.peers.ray_mixed --config JSON --temp-dir D`` starts a private local Ray
instance on loopback (``_node_ip_address="127.0.0.1"``, no dashboard, its own temp dir, a
512 MiB object store) and one **async** actor (so a small call is not queued behind a
large one in the actor: Ray runs an async actor's calls concurrently), then runs
`bench.mixed.measure` from an asyncio loop in the driver, awaiting ``ObjectRef``s. Large
data goes as numpy arrays, Ray at its best: each call puts its array into the
shared-memory object store (one copy) and the reader gets a zero-copy read-only view;
``in`` is ``consume(a)``, ``out`` is ``produce(nbytes)`` (an array the actor holds),
``echo`` returns the argument. It prints the measurements as one JSON line and shuts Ray
down; `bench.mixed` bounds it and kills its process group past the bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

OBJECT_STORE_BYTES = 512 << 20


def _driver(raw: dict[str, Any], temp_dir: str) -> dict[str, Any]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback stays loopback
    import numpy as np
    import ray

    from bench.mixed import Config, measure

    cfg = Config(**{**raw, "sizes": tuple(raw["sizes"])})
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        object_store_memory=OBJECT_STORE_BYTES,
        _node_ip_address="127.0.0.1",
        _temp_dir=temp_dir,
    )
    try:

        @ray.remote
        class Mixed:
            def __init__(self) -> None:
                self.arrays: dict[int, np.ndarray] = {}

            async def add(self, a: int, b: int) -> int:
                return a + b

            async def consume(self, a: np.ndarray) -> int:
                return int(a.size)

            async def produce(self, nbytes: int) -> np.ndarray:
                if nbytes not in self.arrays:
                    self.arrays[nbytes] = np.ones(nbytes // 4, dtype=np.float32)
                return self.arrays[nbytes]

            async def echo(self, a: np.ndarray) -> np.ndarray:
                return a

        actor: Any = Mixed.remote()  # type: ignore[attr-defined]

        async def small() -> int:
            return int(await actor.add.remote(1, 2))

        def large_ops(size: int) -> dict[str, Callable[[], Awaitable[Any]]]:
            a = np.ones(size // 4, dtype=np.float32)

            async def send_in() -> None:
                if await actor.consume.remote(a) != a.size:
                    raise RuntimeError("wrong reply to consume")

            async def get_out() -> None:
                r = await actor.produce.remote(size)
                if r.size != size // 4:
                    raise RuntimeError("wrong array from produce")

            async def echo() -> None:
                r = await actor.echo.remote(a)
                if r.size != a.size:
                    raise RuntimeError("wrong array from echo")

            return {"in": send_in, "out": get_out, "echo": echo}

        result: dict[str, Any] = asyncio.run(
            asyncio.wait_for(measure(small, large_ops, cfg), cfg.case_timeout)
        )
        return result
    finally:
        ray.shutdown()


def main() -> None:
    """Driver entry point."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--temp-dir", required=True)
    args = parser.parse_args()
    from bench.peers._suite import emit

    emit(_driver(json.loads(args.config), args.temp_dir))


if __name__ == "__main__":
    main()
