"""``tensorrpc top ADDR...``: a live terminal view of engines' statistics (the ``top`` extra).

It connects like any client to the engines at the given addresses, asks each for the
built-in ``_tensorrpc.statistics`` method every interval (docs/protocol.md §10) and draws
a row per engine (the columns: docs/observability.md). What an engine sends is drawn as
plain text: strings are escaped (`tensorrpc._text.peer_text`) and shown as
``rich.text.Text``, never as markup, and an answer is checked (`check_statistics`) before
it is used; a bad one becomes that engine's note and top goes on.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import anyio

from tensorrpc import _observe
from tensorrpc._client import Client
from tensorrpc._exceptions import TensorRPCError
from tensorrpc._text import peer_text

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator, Sequence

    from rich.console import Console
    from rich.table import Table

    from tensorrpc._security import CurveConfig

__all__ = ["EngineView", "check_statistics", "percentile", "run", "table"]

#: Longest engine id or note drawn (characters, escapes included).
_SHOWN_CHARS = 64
#: Most latency buckets one method of a statistics answer may list.
_MAX_BUCKETS = 4096
#: Most methods a statistics answer may list.
_MAX_METHODS = 4096
_COUNTERS = ("calls", "errors", "bytes_in", "bytes_out")
_TRANSPORT_COUNTERS = ("bytes_sent", "bytes_received")


def _count(where: str, value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{where} is not a count")
    return value


def _check_latency(latency: object, per_octave: int) -> None:
    if not isinstance(latency, list) or len(latency) > _MAX_BUCKETS:
        raise ValueError("a method's latency is not a list of at most 4096 buckets")
    for pair in latency:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise ValueError("a latency bucket is not a [bucket, count] pair")
        if type(pair[0]) is not int or abs(pair[0]) > 64 * per_octave:  # 2**64 µs at most
            raise ValueError("a latency bucket index is out of range")
        _count("a latency count", pair[1])


def check_statistics(body: object) -> dict[str, Any]:
    """``body`` (an engine's statistics answer) if top can use it.

    Checks what top reads: a finite ``time``; counts (non-negative integers) for calls,
    errors, bytes, in-flight and queued calls and the transports' bytes; a
    ``latency_buckets_per_octave`` of 1..64; methods mapping names to ``latency`` lists
    of ``[bucket, count]`` integer pairs (bounded in number).

    Raises:
        ValueError: The answer is not what the statistics method documents (the
            message names the first field at fault; it holds no engine-written text).
    """
    if not isinstance(body, dict):
        raise ValueError("the answer is not a map")
    t = body.get("time")
    if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t):
        raise ValueError("time is not a finite number")
    for name in (*_COUNTERS, "in_flight", "queued"):
        _count(name, body.get(name))
    per_octave = body.get("latency_buckets_per_octave")
    if type(per_octave) is not int or not 1 <= per_octave <= 64:
        raise ValueError("latency_buckets_per_octave is not in 1..64")
    transports = body.get("transports")
    if not isinstance(transports, dict):
        raise ValueError("transports is not a map")
    for name in ("frames", "torch_shm"):
        counters = transports.get(name)
        if not isinstance(counters, dict):
            raise ValueError(f"transports.{name} is not a map")
        for counter in _TRANSPORT_COUNTERS:
            _count(f"transports.{name}.{counter}", counters.get(counter))
    methods = body.get("methods")
    if not isinstance(methods, dict) or len(methods) > _MAX_METHODS:
        raise ValueError("methods is not a map of at most 4096 entries")
    for method in methods.values():
        _check_latency(method.get("latency") if isinstance(method, dict) else None, per_octave)
    _check_batching(body.get("batching"), per_octave)
    return body


def _check_batching(batching: object, per_octave: int) -> None:
    """The ``batching`` map: per method, ``sizes`` and ``queue_wait`` pairs."""
    if not isinstance(batching, dict) or len(batching) > _MAX_METHODS:
        raise ValueError("batching is not a map of at most 4096 entries")
    for b in batching.values():
        if not isinstance(b, dict):
            raise ValueError("a batching entry is not a map")
        sizes = b.get("sizes")
        if not isinstance(sizes, list) or len(sizes) > _MAX_BUCKETS:
            raise ValueError("batching sizes is not a list of at most 4096 pairs")
        for pair in sizes:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError("a batching size is not a [size, count] pair")
            _count("a batch size", pair[0])
            _count("a batch count", pair[1])
        _check_latency(b.get("queue_wait"), per_octave)


def percentile(counts: dict[int, int], q: float, per_octave: int) -> float | None:
    """The ``q`` quantile (0..1) of a statistics latency histogram (bucket index -> calls,
    ``per_octave`` buckets an octave): the upper bound in seconds of the bucket holding
    it, or None for no calls."""
    total = sum(counts.values())
    if total <= 0:
        return None
    rank = max(1, math.ceil(q * total))
    running = 0
    for index in sorted(counts):
        running += counts[index]
        if running >= rank:
            return float(2.0 ** (index / per_octave) / 1e6)
    return None  # pragma: no cover - running reaches total


@dataclass
class EngineView:
    """What ``top`` shows of one engine: the last two statistics answers and liveness."""

    engine_id: str
    live: bool = True
    note: str = ""
    previous: dict[str, Any] | None = None
    current: dict[str, Any] | None = None
    rates: dict[str, float] = field(default_factory=dict)
    p50: float | None = None
    p99: float | None = None
    #: Batched methods over the last interval: mean items per batch (step), and the
    #: median wait of an item for its batch.
    batch_size: float | None = None
    batch_wait: float | None = None

    def update(self, stats: object) -> None:
        """Take a new statistics answer; compute the rates since the previous one.

        An answer `check_statistics` refuses is not taken: the reason becomes the note.
        """
        try:
            stats = check_statistics(stats)
        except ValueError as exc:
            self.note = f"bad statistics: {exc}"
            return
        self.previous, self.current = self.current, stats
        self.note = ""
        prev = self.previous
        if prev is None:
            return
        dt = float(stats["time"]) - float(prev["time"])
        if dt <= 0:
            return

        def rate(new: dict[str, Any], old: dict[str, Any], *keys: str) -> float:
            return max(0.0, float(sum(new[k] - old[k] for k in keys)) / dt)

        self.rates = {
            "calls": rate(stats, prev, "calls"),
            "errors": rate(stats, prev, "errors"),
            "bytes": rate(stats, prev, "bytes_in", "bytes_out"),
        }
        for name in ("frames", "torch_shm"):
            new, old = stats["transports"][name], prev["transports"][name]
            self.rates[name] = rate(new, old, "bytes_sent", "bytes_received")
        window: dict[int, int] = {}
        for method, m in stats["methods"].items():
            _grown(m["latency"], prev["methods"].get(method, {}).get("latency", []), window)
        per_octave = int(stats["latency_buckets_per_octave"])
        self.p50 = percentile(window, 0.50, per_octave)
        self.p99 = percentile(window, 0.99, per_octave)
        self._batching(stats["batching"], prev["batching"], per_octave)

    def _batching(self, new: dict[str, Any], old: dict[str, Any], per_octave: int) -> None:
        sizes: dict[int, int] = {}
        wait: dict[int, int] = {}
        for method, b in new.items():
            before = old.get(method, {})
            _grown(b["sizes"], before.get("sizes", []), sizes)
            _grown(b["queue_wait"], before.get("queue_wait", []), wait)
        batches = sum(sizes.values())
        self.batch_size = sum(k * n for k, n in sizes.items()) / batches if batches else None
        self.batch_wait = percentile(wait, 0.50, per_octave)


def _grown(new: list[Any], old: list[Any], into: dict[int, int]) -> None:
    """Add to ``into`` how much each ``[key, count]`` pair of ``new`` grew since ``old``."""
    before = {int(k): int(n) for k, n in old}
    for k, n in new:
        grew = int(n) - before.get(int(k), 0)
        if grew > 0:
            into[int(k)] = into.get(int(k), 0) + grew


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if value < 1:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def _bytes_per_s(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B/s", "KB/s", "MB/s", "GB/s"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B/s" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB/s"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


#: The columns, most important first: at a narrow width the last ones are dropped until
#: the table fits (80 columns keeps engine to wire/s).
_COLUMNS: Final = (
    ("engine", "left"),
    ("state", "left"),
    ("calls/s", "right"),
    ("err/s", "right"),
    ("p50", "right"),
    ("p99", "right"),
    ("batch", "right"),  # only when an engine serves batched methods
    ("in flight", "right"),
    ("queued", "right"),
    ("wire/s", "right"),
    ("shm/s", "right"),
    ("errors", "right"),
    ("calls", "right"),
    ("frames/s", "right"),
)
#: Columns always shown, however narrow the terminal (the rest are dropped in order).
_ALWAYS: Final = 4
#: Widest engine id and state drawn (longer ones end in an ellipsis).
_ENGINE_WIDTH: Final = 16
_STATE_WIDTH: Final = 24


def _cells(v: EngineView) -> list[Any]:
    from rich.text import Text

    s = v.current or {}
    r = v.rates
    state = ("live" if v.live else "dead") + (f" ({v.note})" if v.note else "")
    return [  # an engine's strings: escaped, and Text (never markup)
        Text(peer_text(v.engine_id, _SHOWN_CHARS)),
        Text(peer_text(state, _SHOWN_CHARS + 12)),
        _rate(r.get("calls")),
        _rate(r.get("errors")),
        _seconds(v.p50),
        _seconds(v.p99),
        "-" if v.batch_size is None else f"{v.batch_size:.1f}/{_seconds(v.batch_wait)}",
        str(s.get("in_flight", "-")),
        str(s.get("queued", "-")),
        _bytes_per_s(r.get("bytes")),
        _bytes_per_s(r.get("torch_shm")),
        str(s.get("errors", "-")),
        str(s.get("calls", "-")),
        _bytes_per_s(r.get("frames")),
    ]


def _build(rows: list[list[Any]], title: str, columns: list[int], caps: dict[int, int]) -> Table:
    from rich import box
    from rich.table import Table

    t = Table(
        title=title, title_justify="left", expand=False, box=box.SIMPLE_HEAD,
        collapse_padding=True, pad_edge=False,
    )  # fmt: skip
    for i in columns:
        name, justify = _COLUMNS[i]
        t.add_column(
            name, justify=justify,  # type: ignore[arg-type,unused-ignore]
            no_wrap=True, overflow="ellipsis", max_width=caps.get(i),
        )  # fmt: skip
    for row in rows:
        t.add_row(*(row[i] for i in columns))
    return t


def table(views: Sequence[EngineView], title: str, width: int | None = None) -> Table:
    """The rich table of one refresh, fitted to ``width`` columns (None: every column).

    To fit, in this order: a long state (an error note) is cut short; columns are dropped
    from the least important (frames/s, the totals, shm/s...) down to the first four; a
    long engine id is cut short. The caption names the columns not shown.
    """
    from rich.console import Console
    from rich.measure import Measurement

    rows = [_cells(v) for v in views]
    # The batch column only when an engine serves batched methods.
    batched = any((v.current or {}).get("batching") for v in views)
    columns = [i for i, (name, _) in enumerate(_COLUMNS) if batched or name != "batch"]
    every = len(columns)
    caps: dict[int, int] = {}
    t = _build(rows, title, columns, caps)
    if width is not None:
        measure = Console(width=10_000)

        def too_wide() -> bool:
            return Measurement.get(measure, measure.options, t).maximum > width

        if too_wide():
            caps[1] = _STATE_WIDTH
            t = _build(rows, title, columns, caps)
        while len(columns) > _ALWAYS and too_wide():
            columns.pop()
            t = _build(rows, title, columns, caps)
        if too_wide():
            caps[0] = _ENGINE_WIDTH
            t = _build(rows, title, columns, caps)
    if len(columns) < every:
        hidden = [n for i, (n, _) in enumerate(_COLUMNS) if i > columns[-1]]
        t.caption = "not shown at this width: " + ", ".join(
            n for n in hidden if batched or n != "batch"
        )
    return t


@contextlib.contextmanager
def _cbreak(fd: int) -> Iterator[bool]:
    """Single keys without Enter (and no echo) while inside; False when not a terminal."""
    if not os.isatty(fd):
        yield False
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _poll(client: Client[Any], views: dict[str, EngineView], patience: float) -> None:
    for engine_id in client.engines:
        views.setdefault(engine_id, EngineView(engine_id))
    for engine_id, view in views.items():
        view.live = engine_id in client.engines
        if not view.live:
            view.rates = {}
            view.p50 = view.p99 = None
            continue
        try:
            # An engine that just left is shown as such, not waited for.
            view_of = client.with_options(engine=engine_id, timeout=patience, wait_for_ready=False)
            stats = await view_of.call_by_name(_observe.STATISTICS_METHOD)
        except TensorRPCError as exc:
            view.note = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:60]}"
            continue
        view.update(stats)


async def run(
    addresses: Sequence[str],
    *,
    interval: float = 1.0,
    wait: float = 10.0,
    count: int | None = None,
    curve: CurveConfig | None = None,
    console: Console | None = None,
) -> int:
    """Watch the engines at ``addresses`` until ``q``, Ctrl-C or ``count`` refreshes,
    every ``interval`` seconds; ``wait`` bounds the wait for the first engine and for each
    answer. Returns the exit status (0).

    Raises:
        EnginesUnavailableError: No engine answered within ``wait``.
    """
    console = console if console is not None else _default_console()
    views: dict[str, EngineView] = {}
    title = "tensorrpc top " + " ".join(addresses)
    stdin = _stdin_fd()
    async with Client.dynamic(connect=list(addresses), curve=curve) as client:
        await client.wait_for_engines(1, timeout=wait)
        with (
            anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
            _cbreak(stdin) if stdin >= 0 else contextlib.nullcontext(False) as keys,
        ):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_on_signal, signals, tg.cancel_scope)
                if keys:
                    tg.start_soon(_cancel_on_quit_key, stdin, tg.cancel_scope)
                footer = "; q or Ctrl-C quits" if keys else ""
                await _refresh(client, views, console, title, footer, interval, wait, count)
                tg.cancel_scope.cancel()
    return 0


def _default_console() -> Console:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 150))  # a log or a pipe: no truncation
    return console


def _stdin_fd() -> int:
    """Our stdin's descriptor, or -1 when there is none."""
    try:
        return sys.stdin.fileno() if sys.stdin is not None else -1
    except (OSError, ValueError):  # replaced by something without a descriptor
        return -1


async def _cancel_on_signal(signals: AsyncIterator[int], scope: anyio.CancelScope) -> None:
    async for _ in signals:
        scope.cancel()
        return


async def _cancel_on_quit_key(stdin: int, scope: anyio.CancelScope) -> None:
    while True:
        await anyio.wait_readable(stdin)
        data = os.read(stdin, 64)
        if not data or b"q" in data.lower():
            scope.cancel()
            return


async def _refresh(
    client: Client[Any],
    views: dict[str, EngineView],
    console: Console,
    title: str,
    footer: str,
    interval: float,
    wait: float,
    count: int | None,
) -> None:
    """Poll and draw every ``interval`` until ``count`` refreshes (or forever)."""
    from rich.live import Live

    refreshes = 0
    with (
        Live(console=console, auto_refresh=False)
        if console.is_terminal
        else contextlib.nullcontext() as screen
    ):
        while count is None or refreshes < count:
            await _poll(client, views, wait)
            refreshes += 1
            shown = table(list(views.values()), title, console.width)
            dropped = f"\n{shown.caption}" if shown.caption else ""
            shown.caption = f"refresh {refreshes}, every {interval:g} s" + footer + dropped
            if screen is not None:
                screen.update(shown, refresh=True)
            else:
                console.print(shown)
            if count is not None and refreshes >= count:
                break
            await anyio.sleep(interval)
