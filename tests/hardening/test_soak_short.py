"""The short soak (``bench/soak.py``): 20,000 small and 200 tensor calls, 3 engines, 2 clients.

Nothing lost, duplicated (the engines handled exactly what was issued) or mis-delivered
(every reply echoes its own caller's id); no file descriptor or ``/dev/shm`` growth; the
engines' memory flat after warm-up. The long run is ``make soak``.
"""

from __future__ import annotations

from bench.soak import Config, run


def test_short_soak_loses_duplicates_and_misroutes_nothing() -> None:
    figures = run(Config(calls=20_000, tensor_calls=200, in_flight=200, time_limit=120.0))
    assert not figures.time_limited, figures
    assert figures.issued == 20_200
    assert figures.completed == figures.issued, figures.errors
    assert figures.checks["zero_lost"]
    assert figures.checks["zero_failed"], figures.errors
    assert figures.checks["zero_duplicated"], (figures.duplicated, figures.engine_handled)
    assert figures.checks["zero_misdelivered"], figures.misdelivered
    assert figures.checks["no_fd_growth"], (figures.fds_after_warmup, figures.fds_end)
    assert figures.checks["no_shm_growth"], (figures.shm_before, figures.shm_end)
    for engine_id in ("s1", "s2", "s3"):
        assert figures.rss_growth_after_warmup_mib.get(engine_id, 0.0) < 64.0, figures
