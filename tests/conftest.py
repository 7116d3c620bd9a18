from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# The fixtures of tensorrpc.testing (tensorrpc_client, tensorrpc_engines), for our own tests;
# how the suite runs under pytest-xdist (`make test`: -n 3).
pytest_plugins = ["tensorrpc.testing", "tests._xdist"]

# Property tests must not fail because a 2-core CI machine is busy: no per-example
# deadline, no "too slow" health check. Under CI the examples are derandomized so that a
# run is reproducible; locally every run explores new examples.
settings.register_profile(
    "tensorrpc", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile(
    "tensorrpc-ci", parent=settings.get_profile("tensorrpc"), derandomize=True
)
settings.load_profile("tensorrpc-ci" if os.environ.get("CI") else "tensorrpc")


@pytest.fixture(
    params=[
        pytest.param("asyncio", id="asyncio"),
        pytest.param("trio", id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every async test on both anyio backends."""
    return str(request.param)
