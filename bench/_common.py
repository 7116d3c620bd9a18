"""Small helpers shared by the benchmark sections."""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

Progress = Callable[[str], None]

_deadline: float | None = None


def set_deadline(monotonic_s: float | None) -> None:
    """Set the time (``time.monotonic()``) after which no new case starts."""
    global _deadline
    _deadline = monotonic_s


def unavailable(exc: BaseException) -> dict[str, Any]:
    """The entry recorded for a system (or size) that could not be measured."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    text = str(exc).strip().replace("\n", " ")
    if len(text) > 400:
        text = text[:400] + "..."
    reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return {"unavailable": reason}


def guarded(progress: Progress, label: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one system's case; turn any failure into an ``unavailable`` entry.

    A failure is never fatal to the run: the other systems are still measured, and the
    reason is kept in the results instead of a number.
    """
    if _deadline is not None and time.monotonic() > _deadline:
        progress(f"{label}: skipped, the run's time budget is spent")
        return {"unavailable": "skipped: the run's time budget was spent"}
    progress(f"{label} ...")
    try:
        result = fn()
    except Exception as exc:
        progress(f"{label}: unavailable ({exc!r})")
        tb = traceback.format_exc(limit=3)
        entry = unavailable(exc)
        entry["traceback"] = tb
        return entry
    return result


def run_async(coro_fn: Callable[[], Coroutine[Any, Any, dict[str, Any]]], timeout: float) -> Any:
    """``asyncio.run`` one case, bounded by ``timeout`` seconds."""

    async def bounded() -> dict[str, Any]:
        try:
            return await asyncio.wait_for(coro_fn(), timeout)
        except TimeoutError:
            raise TimeoutError(f"case did not finish within {timeout:.0f}s") from None

    return asyncio.run(bounded())


def background_nice_arg(text: str) -> int | str:
    """A ``--background-nice`` value: ``0`` .. ``19`` or ``idle``
    (`tensorrpc.set_background_nice`)."""
    return text if text == "idle" else int(text)
