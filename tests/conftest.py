from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# The fixtures of tensorrpc.testing (tensorrpc_client, tensorrpc_engines), for our own tests;
# how the suite runs under pytest-xdist (`make test`: -n 3).
pytest_plugins = ["tensorrpc.testing", "tests._xdist"]


def pytest_configure(config: pytest.Config) -> None:
    """Fork the engine processes of tensorrpc.testing from the suite's zygote.

    `engine_processes` (and ``isolation="process"``) would start fresh interpreters that
    each import torch; forked from the zygote (tests/_forkserver.py) they are separate
    processes all the same, signalled and reaped alike. A user's script still starts them
    with `subprocess.Popen` (tests/test_blocking_client.py::test_plain_script runs one
    outside pytest).
    """
    import tensorrpc.testing
    from tests import _forkserver

    tensorrpc.testing._popen = _forkserver.popen


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

#: The share of each property test's ``max_examples`` (its own or the profile's) that a
#: run makes: a quarter, at least `MIN_EXAMPLES`, so that the suite stays a few minutes on
#: 2 cores. ``TENSORRPC_HYPOTHESIS=thorough`` runs every test's full count, the numbers
#: written in the tests (before a release, after a change to the codec or a protocol).
#: State machines keep their ``stateful_step_count``: a run is as deep, only fewer.
MIN_EXAMPLES = 10


def examples_share(environ: Mapping[str, str]) -> float:
    """The share of examples to make under ``environ``: all with ``thorough``."""
    return 1.0 if environ.get("TENSORRPC_HYPOTHESIS") == "thorough" else 0.25


EXAMPLES_SHARE = examples_share(os.environ)


def scaled(given: settings, share: float = EXAMPLES_SHARE) -> settings:
    """``given`` with ``share`` of its examples (at least `MIN_EXAMPLES`, never more)."""
    count = given.max_examples
    fewer = min(count, max(MIN_EXAMPLES, round(count * share)))
    return given if fewer == count else settings(given, max_examples=fewer)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Apply `EXAMPLES_SHARE` to the property tests and the state machines collected."""
    for item in items:
        function = getattr(item, "function", None)
        cls = getattr(item, "cls", None)
        if hasattr(cls, "runTest") and isinstance(getattr(cls, "settings", None), settings):
            target: Any = cls  # a state machine's TestCase (its runTest reads them)
            attribute = "settings"
        elif getattr(function, "is_hypothesis_test", False):
            target, attribute = function, "_hypothesis_internal_use_settings"  # @given's
        else:
            continue
        own = getattr(target, attribute, None)
        # Once per test function, however many items (parameters) it has.
        if isinstance(own, settings) and not getattr(target, "_tensorrpc_scaled", False):
            setattr(target, attribute, scaled(own))
            target._tensorrpc_scaled = True


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported, so that a full collection skips it.

    torch, numpy, hypothesis and the package leave ~200k objects that every full
    collection would scan (0.4 s on this machine, each explicit ``gc.collect()`` in a test
    and each of the interpreter's own full passes); frozen, they are never scanned (nor
    freed: they live as long as the modules). Objects the tests make are not frozen.
    (Not in the zygote of tests/_forkserver.py: a child must behave as a fresh
    interpreter, and ``gc.get_referrers`` does not see frozen objects: hypothesis, imported
    late in a child, then warns that trio's registered random has no referrer.)
    """
    gc.collect()
    gc.freeze()


@pytest.fixture
def make_socket() -> Iterator[Callable[..., Any]]:
    """Create sockets through ``tensorrpc._zmq.create_socket`` and close every one of
    them afterwards (tests that open real sockets: not in tests/unit)."""
    from tensorrpc._zmq import AsyncSocket, create_socket

    made: list[AsyncSocket] = []

    def factory(socket_type: int, **kwargs: Any) -> AsyncSocket:
        sock = create_socket(socket_type, **kwargs)
        made.append(sock)
        return sock

    yield factory
    for sock in made:
        sock.close()
