"""Ray actors: the general-purpose distributed runtime many ML services use.

Setup: a child process of the benchmark is the Ray driver. It starts a private local
Ray instance (``ray.init(num_cpus=1)``, no dashboard, its own temp dir) and one actor
whose methods are ``add(a, b)``, ``consume(t) -> (numel, first, last)`` and
``produce(nbytes) -> tensor``; the actor runs in its own worker process. Calls are
``ray.get(actor.method.remote(...))``. Ray is measured at its best as well as with torch:
the payload goes both as a ``torch.Tensor`` (pickled by Ray's serializer) and as a numpy
array, which Ray stores in its shared-memory object store and hands to the reader as a
zero-copy read-only view. Both directions are measured: tensor in / small result out
(``consume``), and small request in / tensor out (``produce``, the actor returning a
tensor it already holds, so that only the transfer is timed). Pipelined calls keep N
``ObjectRef``s outstanding and ``ray.get`` them in order. The driver prints its
measurements as one JSON line and shuts Ray down; the benchmark bounds it with a
timeout and kills its whole process group past it. Ray is optional: without it the
case reports why it did not run.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch


def _driver(config: dict[str, Any], temp_dir: str) -> dict[str, Any]:
    import numpy as np
    import ray

    from bench.peers._suite import sizes_suite, sync_suite
    from bench.transfer import make_tensor

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        _temp_dir=temp_dir,
    )
    try:

        @ray.remote
        class Sink:
            def __init__(self) -> None:
                self.tensors: dict[int, torch.Tensor] = {}

            def add(self, a: int, b: int) -> int:
                return a + b

            def consume(self, t: torch.Tensor) -> tuple[int, float, float]:
                return (t.numel(), float(t[0]), float(t[-1]))

            def consume_np(self, a: np.ndarray) -> tuple[int, float, float]:
                return (a.size, float(a[0]), float(a[-1]))

            def _tensor(self, nbytes: int) -> torch.Tensor:
                if nbytes not in self.tensors:
                    self.tensors[nbytes] = make_tensor(nbytes)
                return self.tensors[nbytes]

            def produce(self, nbytes: int) -> torch.Tensor:
                return self._tensor(nbytes)

            def produce_np(self, nbytes: int) -> np.ndarray:
                return self._tensor(nbytes).numpy()

        sink: Any = Sink.remote()  # type: ignore[attr-defined]
        if ray.get(sink.add.remote(1, 2)) != 3:
            raise RuntimeError("wrong reply")
        out = sync_suite(
            config,
            call_add=lambda: ray.get(sink.add.remote(1, 2)),
            submit_add=lambda: sink.add.remote(1, 2),
            wait=ray.get,
            consume=lambda t: ray.get(sink.consume.remote(t)),
        )
        out["sizes_numpy"] = sizes_suite(
            config, lambda a: ray.get(sink.consume_np.remote(a)), lambda n: make_tensor(n).numpy()
        )
        out["sizes_out"] = sizes_suite(
            config, lambda n: ray.get(sink.produce.remote(n)), make_tensor, direction="out"
        )
        out["sizes_out_numpy"] = sizes_suite(
            config, lambda n: ray.get(sink.produce_np.remote(n)), make_tensor, direction="out"
        )
        return out
    finally:
        ray.shutdown()


def run(config: dict[str, Any], *, workdir: str, timeout: float) -> dict[str, Any]:
    """Run the driver child (from the benchmark process); return its measurements.

    Raises:
        RuntimeError: Ray is not installed, or the driver failed or timed out.
    """
    import importlib.util

    from bench.peers._suite import run_json_child

    if importlib.util.find_spec("ray") is None:
        raise RuntimeError("ray is not installed (optional: pip install 'tensorrpc[bench-ray]')")
    temp_dir = os.path.join(workdir, "ray")
    args = ["--config", json.dumps(config), "--temp-dir", temp_dir]
    return run_json_child("bench.peers.ray_peer", args, timeout=timeout)


def main() -> None:
    """Driver entry point: ``python -m bench.peers.ray_peer --config JSON --temp-dir D``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--temp-dir", required=True)
    args = parser.parse_args()
    from bench.peers._suite import emit

    emit(_driver(json.loads(args.config), args.temp_dir))


if __name__ == "__main__":
    main()
