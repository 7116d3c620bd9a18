"""docs/protocol.md read as a second implementer reads it, against the code.

Each test takes a rule from the page itself (a table or a stated example) and checks the
code does exactly that, so a change on either side without the other fails here.
"""

from __future__ import annotations

import enum
import math
import re
import struct
import unicodedata
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Literal, NamedTuple, NewType, TypedDict

import numpy as np
import ormsgpack
import pytest
import torch
from hypothesis import example, given, strategies as st
from numpy.typing import NDArray

from tensorrpc import ValidationError, _codec, describe, rpc, service
from tensorrpc._codec import ExtCode, Location
from tensorrpc._exceptions import ErrorCode, RemoteProtocolError
from tensorrpc._metadata import decode_block, encode_block
from tensorrpc._observe import statistics_body
from tensorrpc._protocol import (
    _SCHEMAS,
    MAX_BODY_BYTES,
    Bye,
    Flags,
    Header,
    MessageKind,
    decode_control,
    encode_control,
    unpack_header,
)
from tensorrpc._schema import compile_type
from tensorrpc._server_protocol import _NAMES_A_CALL, readable_call_id
from tensorrpc._service import _default_repr

from .server_helpers import Engine

PAGE = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
TEXT = PAGE.read_text(encoding="utf-8")


# ----------------------------------------------------------- ErrorInfo.path, §4 and §10


@dataclass
class Point:
    x: float


@service(name="paths")
class Paths:
    @rpc
    async def track(self, points: AsyncIterator[Point]) -> int:
        return 0


@pytest.mark.parametrize("helper", ["check_item", "decode_item"])
def test_a_request_items_field_path_starts_with_the_parameter_and_the_index(
    helper: str,
) -> None:
    # §10 request credit rule 6: `path` is ["chunks", 3, "x"], the message says chunks[3].x.
    item = getattr(describe(Paths).methods["track"], helper)
    bad = Point("no") if helper == "check_item" else {"x": "no"}  # type: ignore[arg-type]
    with pytest.raises(ValidationError) as info:
        item(bad, 3)
    assert info.value.path == "points[3].x"
    assert info.value.field_path == ["points", 3, "x"]


def test_a_validation_error_without_a_field_path_names_no_place() -> None:
    # No place parsed back from text: a path is data where it is made, or there is none.
    assert ValidationError("bad", path="req.items[3]").field_path == []


# ------------------------------------------------------------------- §4 control bodies

SUPERSCRIPT = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹", "0123456789")
#: The page's range dash and minus sign, read as ASCII: ``int 1..2³²-1``.
ASCII = str.maketrans({"\u2013": "..", "\u2212": "-"})


def section(number: str) -> str:
    start = TEXT.index(f"\n## {number}. ")
    return TEXT[start : TEXT.index("\n## ", start + 1)]


def number(text: str) -> int:
    """``65,536``, ``2³²-1`` (the page writes a minus sign), ``255`` as ints."""
    text = text.replace(",", "").strip()
    power = re.fullmatch(r"2([⁰¹²³⁴⁵⁶⁷⁸⁹]+)-1", text)
    return 2 ** int(power.group(1).translate(SUPERSCRIPT)) - 1 if power else int(text)


def body_tables() -> dict[str, dict[str, str]]:
    """Each §4 body (``**Hello** (HELLO)``) with its table: key → the type column."""
    tables: dict[str, dict[str, str]] = {}
    pattern = r"^\*\*(\w+)\*\* \((\w+)\):[^\n]*\n\n((?:\|[^\n]*\n)+)"
    for match in re.finditer(pattern, section("4"), re.M):
        rows = [line.split(" | ") for line in match.group(3).splitlines()[2:]]
        tables[match.group(1)] = {row[0].strip("| `"): row[1].translate(ASCII) for row in rows}
    return tables


CLASSES = {cls.__name__: cls for cls in _SCHEMAS}
KIND_OF = {
    "Hello": MessageKind.HELLO,
    "Welcome": MessageKind.WELCOME,
    "Reject": MessageKind.REJECT,
    "Bye": MessageKind.BYE,
    "Credit": MessageKind.CREDIT,
    "Attach": MessageKind.ATTACH,
    "Release": MessageKind.RELEASE,
    "ErrorInfo": MessageKind.ERROR,
}


def test_every_body_and_field_of_the_code_has_its_row_in_section_4() -> None:
    tables = body_tables()
    assert set(tables) == set(CLASSES)
    for name, cls in CLASSES.items():
        assert list(tables[name]) == [f[0] for f in _SCHEMAS[cls]], name


def test_the_body_size_caps_are_the_codes() -> None:
    caps = re.search(r"\| kind \| cap \(bytes\) \|\n.*?\n((?:\s*\|.*\n)+)", section("4"))
    assert caps is not None
    stated = {}
    for line in caps.group(1).splitlines():
        kind, cap = (cell.strip() for cell in line.strip().strip("|").split("|"))
        stated[MessageKind[kind]] = number(cap.split()[0])
    assert stated == dict(MAX_BODY_BYTES)


Case = tuple[object, bool]  # a value for the field, and whether the page allows it


def cases(spec: str) -> list[Case]:
    """Values at and just past the bounds of a type the page writes (§4's notation)."""
    if m := re.fullmatch(r"int (\S+)\.\.(\S+)", spec):
        low, high = number(m.group(1)), number(m.group(2))
        out: list[Case] = [(low, True), (high, True), (True, False), (1.0, False), ("1", False)]
        if high < 2**64 - 1:  # msgpack holds no larger integer
            out.append((high + 1, False))
        return [*out, *([(low - 1, False)] if low > 0 else [])]
    if m := re.fullmatch(r"(str|name)(?: ≤ (\S+))?", spec):
        is_str = m.group(1) == "str"
        assert m.group(2) or not is_str, "a str states its limit"
        limit = number(m.group(2)) if m.group(2) else 1024
        out = [("é" * limit, True), ("x" * (limit + 1), False), (1, False), (b"x", False)]
        return [*out, ("", True), ("a\x1bb", is_str), ("a\u202eb", is_str)]
    if m := re.fullmatch(r"list\[(.*)\](?:, at (least|most) (\d+) entr(?:y|ies))?", spec):
        inner, bound, count = m.group(1), m.group(2), int(m.group(3) or 4096)
        most = count if bound == "most" else 4096
        if inner == "name or int 0..2⁶³-1":  # ErrorInfo.path: either kind of entry
            names = [(v, ok) for v, ok in cases("name") if not isinstance(v, int)]
            items = [*names, *((v, ok) for v, ok in cases("int 0..2⁶³-1") if type(v) is not str)]
        else:
            items = cases(inner)
        first = items[0][0]
        out = [([], bound != "least"), ({}, False), ("x", False)]
        out += [([value], ok) for value, ok in items]
        return [*out, ([first] * most, True), ([first] * (most + 1), False)]
    raise AssertionError(f"the page writes a type §4 does not define: {spec!r}")


def hello_lists(wire: dict[str, Any], name: str) -> None:
    """Keep HELLO's cross-field rules while one list field takes a test value."""
    if name in ("methods", "streaming", "request_streaming") and isinstance(wire[name], list):
        names = [v for v in wire[name] if isinstance(v, str)]
        if name != "methods":
            wire["methods"] = names
        wire["signatures"] = [""] * len(wire["methods"])
    elif name == "signatures" and isinstance(wire[name], list):
        wire["methods"] = [f"m{i}" for i in range(len(wire[name]))]


def valid_wire(cls: type) -> dict[str, Any]:
    wire: dict[str, Any] = {}
    for name, ftype, _ in _SCHEMAS[cls]:
        wire[name] = {"int": 1, "ints": [1], "strs": [], "names": [], "path": []}.get(ftype, "")
    return wire


def decodes(kind: MessageKind, wire: dict[str, Any]) -> bool:
    try:
        decode_control(Header(kind), ormsgpack.packb(wire))
    except RemoteProtocolError:
        return False
    return True


@pytest.mark.parametrize("body", sorted(KIND_OF))
def test_each_field_takes_exactly_the_values_its_row_allows(body: str) -> None:
    cls, kind = CLASSES[body], KIND_OF[body]
    assert decodes(kind, valid_wire(cls))
    rows = body_tables()[body]
    if body == "Hello":  # §4: a HELLO's request window of 0 is refused
        assert rows["stream_window"].startswith("int 1..")
    for name, spec in rows.items():
        for value, allowed in cases(spec):
            wire = valid_wire(cls)
            wire[name] = value
            if body == "Hello":
                hello_lists(wire, name)
            if len(ormsgpack.packb(wire)) > MAX_BODY_BYTES[kind]:
                continue  # over the body's cap: refused whole, not by this field's rule
            assert decodes(kind, wire) is allowed, (body, name, repr(value)[:60], allowed)
        missing = valid_wire(cls)
        del missing[name]
        assert not decodes(kind, missing), (body, name)
    extra = {**valid_wire(cls), "later": [1, {"x": None}]}
    assert decodes(kind, extra)  # unknown keys are ignored (§12)


def test_a_body_that_is_not_a_map_is_refused() -> None:
    for payload in (ormsgpack.packb([]), ormsgpack.packb(None), b"", b"\x81"):
        with pytest.raises(RemoteProtocolError):
            decode_control(Header(MessageKind.BYE), payload)


# --------------------------------------------------- Appendix A.3: VALUE text, by its rules

NOT_PRINTABLE = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"}


def spec_escape(c: str) -> str:
    """A.3: one character of a str VALUE that is neither the quote nor a backslash."""
    named = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
    if c in named:
        return named[c]
    code = ord(c)
    if code < 0x20 or code == 0x7F or (c != " " and unicodedata.category(c) in NOT_PRINTABLE):
        if code <= 0xFF:
            return f"\\x{code:02x}"
        return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
    return c


def spec_str(text: str) -> str:
    quote = '"' if "'" in text and '"' not in text else "'"
    body = "".join("\\" + c if c in ("\\", quote) else spec_escape(c) for c in text)
    return quote + body + quote


def spec_bytes(data: bytes) -> str:
    quote = '"' if b"'" in data and b'"' not in data else "'"
    named = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
    out = []
    for b in data:
        if chr(b) in ("\\", quote):
            out.append("\\" + chr(b))
        elif b in named:
            out.append(named[b])
        else:
            out.append(chr(b) if 0x20 <= b <= 0x7E else f"\\x{b:02x}")
    return "b" + quote + "".join(out) + quote


def spec_float(x: float) -> str:
    """A.3: the shortest decimal that reads back as ``x``, with a . or an exponent."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    digits, exponent = _shortest(abs(x))
    sign = "-" if math.copysign(1.0, x) < 0 else ""
    if exponent < -4 or exponent >= 16:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{sign}{mantissa}e{'-' if exponent < 0 else '+'}{abs(exponent):02d}"
    if exponent < 0:
        return f"{sign}0.{'0' * (-exponent - 1)}{digits}"
    whole, frac = digits[: exponent + 1].ljust(exponent + 1, "0"), digits[exponent + 1 :]
    return f"{sign}{whole}.{frac or '0'}"


def _shortest(x: float) -> tuple[str, int]:
    """The digits and decimal exponent of the shortest decimal that reads back as ``x``
    (>= 0); of two as short, the nearer. At each length the correctly rounded decimal may
    not read back while its neighbour in the last digit does (2**-24), so both are tried."""
    if x == 0:
        return "0", 0
    exact = Decimal(x)
    for precision in range(17):
        mantissa, _, exp = f"{x:.{precision}e}".partition("e")
        rounded = Decimal(f"{mantissa}e{exp}")
        unit = Decimal(1).scaleb(int(exp) - precision)
        fits = [d for d in (rounded, rounded - unit, rounded + unit) if float(d) == x]
        if fits:
            _, digit_tuple, exponent = (
                min(fits, key=lambda d: abs(d - exact)).normalize().as_tuple()
            )
            assert isinstance(exponent, int)
            digits = "".join(map(str, digit_tuple))
            return digits, exponent + len(digits) - 1
    raise AssertionError(f"{x!r} has no decimal of at most 17 digits")  # pragma: no cover


@given(st.text())
def test_a_str_value_is_written_as_appendix_a3_says(text: str) -> None:
    assert _default_repr(text, "w") == spec_str(text)


@given(st.binary())
def test_a_bytes_value_is_written_as_appendix_a3_says(data: bytes) -> None:
    assert _default_repr(data, "w") == spec_bytes(data)


@given(st.floats())
@example(1.0)
@example(-0.0)
@example(1e16)
@example(1.5e-05)
@example(0.0001)
@example(123456789012345.6)
@example(2.0**-24)  # 5.9604644775390625e-08: ...062e-08 does not read back, ...063e-08 does
def test_a_float_value_is_written_as_appendix_a3_says(x: float) -> None:
    assert _default_repr(x, "w") == spec_float(x)


# ------------------------------------------------------------ §8 sessions, §11 one rule


def test_a_new_client_session_keeps_the_engines_epoch() -> None:
    # §8, Sessions: a WELCOME with a new epoch starts a new session; the engine's own
    # epoch does not change, and a repeated HELLO still carries it.
    engine = Engine.make()
    engine.join(epoch=5)
    before = engine.proto.sessions[b"c1"].epoch
    engine.welcome(b"c1", epoch=6)
    assert engine.take() == []
    assert engine.proto.sessions[b"c1"].client_epoch == 6
    engine.now += 2.0  # past the heartbeat: a HELLO may go again
    engine.control(b"c1", MessageKind.PING, None, 0)
    hello = [s.body for s in engine.take() if s.kind is MessageKind.HELLO]
    assert [h.epoch for h in hello] == [before]


def test_the_kinds_that_name_a_call_are_those_section_11_lists() -> None:
    rule = section("11")
    listed = re.search(r"a kind a client sends about a call \(([^)]*)\)", rule.replace("\n", " "))
    assert listed is not None
    stated = {int(n) for n in re.findall(r"\d+", listed.group(1))}
    assert stated == set(_NAMES_A_CALL)
    assert {MessageKind[k].value for k in re.findall(r"[A-Z_]{4,}", listed.group(1))} == stated
    # ... and the engine answers exactly those: ERROR(id, PROTOCOL), whatever the version.
    for kind in MessageKind:
        frame = struct.pack("<2sBBHHQI", b"TR", 9, kind, 0, 0, 11, 0)
        assert (readable_call_id(frame) == 11) is (kind in stated), kind
        engine = Engine.make()
        engine.join()
        engine.send(b"c1", [frame, b""])
        sent = engine.take()
        if kind in stated:
            assert [(s.kind, s.header.call_id, s.body.code) for s in sent] == [
                (MessageKind.ERROR, 11, ErrorCode.PROTOCOL)
            ]
        else:
            assert sent == []
            assert engine.proto.dropped == 1


# ------------------------------------------------------ §10 the statistics method's map


def test_the_statistics_map_has_the_keys_section_10_lists() -> None:
    calls = section("10")
    table = calls[calls.index("| key | type | meaning |") :].split("\n\n")[0]
    keys = {k for row in table.splitlines()[2:] for k in re.findall(r"`(\w+)`", row.split("|")[1])}
    counters = SimpleNamespace(
        tensors_sent=1, bytes_sent=2, tensors_received=3, bytes_received=4, fallbacks=5
    )
    stats = SimpleNamespace(
        engine_id="e1",
        clients=[SimpleNamespace(state="live", bytes_in=1, bytes_out=2)],
        transports=SimpleNamespace(
            frames=counters,
            torch_shm=counters,
            torch_shm_detail=SimpleNamespace(releases_refused=7),
        ),
        calls=1,
        errors=0,
        in_flight=0,
        queued=0,
        overloaded=0,
        dropped=0,
        methods={"add": {"calls": 1, "errors": 0, "latency": [[3, 1]]}},
        batching={},
    )
    body = statistics_body(stats, service="s", pid=1, started=0.0)
    assert set(body) == keys
    shm_row = next(row for row in table.splitlines() if row.startswith("| `transports`"))
    per_transport = set(re.findall(r"`(\w+)`", shm_row.split("|")[3])) - {"frames", "torch_shm"}
    assert set(body["transports"]["frames"]) | {"releases_refused"} == per_transport
    assert set(body["transports"]["torch_shm"]) == per_transport
    assert body["transports"]["torch_shm"]["releases_refused"] == 7
    method_row = next(row for row in table.splitlines() if row.startswith("| `methods`"))
    assert {"calls", "errors", "latency"} <= set(re.findall(r"`(\w+)`", method_row))
    assert set(body["methods"]["add"]) == {"calls", "errors", "latency"}


# ------------------------------------------------------------------ §3 kinds and flags


def table_rows(text: str, head: str) -> list[list[str]]:
    start = text.index(head)
    block = text[start:].split("\n\n")[0].splitlines()[2:]
    return [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in block]


def test_the_kinds_and_their_call_ids_are_the_codes() -> None:
    rows = table_rows(section("3"), "| value | kind | direction | `call_id` | payload |")
    assert {int(r[0]): r[1] for r in rows} == {k.value: k.name for k in MessageKind}
    for value, _, _, call_id, _ in rows:
        kind = MessageKind(int(value))
        method = b"m" if kind is MessageKind.CALL else b""
        accepted = []
        for cid in (0, 5):
            frame = struct.pack("<2sBBHHQI", b"TR", 1, kind, 0, 0, cid, 0) + method
            try:
                unpack_header(frame)
            except RemoteProtocolError:
                accepted.append(False)
            else:
                accepted.append(True)
        expected = [True, False] if call_id == "0" else None
        if call_id.startswith("≠ 0"):
            expected = [False, True]
        if expected is None:  # "any", "the call's, or 0"
            expected = [True, True]
        assert accepted == expected, (kind, call_id)


def test_the_flag_bits_are_the_codes() -> None:
    rows = table_rows(section("3"), "| bit | name | meaning |")
    assert {int(r[0].strip("`"), 16): r[1].strip("`") for r in rows} == {
        f.value: f.name for f in Flags
    }


# ------------------------------------------------------------- §6 tensor descriptors


def test_the_ext_types_locations_and_dtypes_are_the_codecs() -> None:
    tensors = section("6")
    exts = table_rows(tensors, "| ext type | name | decodes to |")
    assert {int(r[0]): r[1].strip("`") for r in exts} == {e.value: e.name for e in ExtCode}
    locs = table_rows(tensors, "| loc | name | `ref` |")
    assert {int(r[0]): r[1].strip("`") for r in locs} == {loc.value: loc.name for loc in Location}
    sizes = table_rows(tensors, "| names | itemsize |")
    stated = {name: int(size) for names, size in sizes for name in re.findall(r"`(\w+)`", names)}
    assert set(stated) == set(_codec._TORCH_DTYPE_NAMES)
    numpy_line = re.search(r"`NUMPY` descriptors accept only (.*?)\.", tensors, re.S)
    assert numpy_line is not None
    numpy_names: set[str] = set()
    for part in re.findall(r"`(\w+)`(?:\.\.`(\w+)`)?", numpy_line.group(1).translate(ASCII)):
        first, last = part
        if not last:
            numpy_names.add(first)
            continue
        stem = first.rstrip("0123456789")
        numpy_names |= {f"{stem}{bits}" for bits in (8, 16, 32, 64)}
    assert numpy_names == set(_codec._NUMPY_DTYPE_NAMES)
    for name in _codec._NUMPY_DTYPE_NAMES:
        assert np.dtype(name).itemsize == stated[name], name
    for name, size in stated.items():
        dtype = getattr(torch, name, None)
        if dtype is not None:  # the float8/float4/bits types only where torch has them
            assert dtype.itemsize == size, name


# ------------------------------------------------- Appendix A.2: the TYPE grammar, parsed


class Grammar:
    """A recursive-descent reader of A.2's TYPE (and A.3's VALUE), from the page's rules."""

    SCALARS = ("None", "bool", "int", "float", "str", "bytes", "Tensor", "ndarray")
    RECORDS = ("dataclass", "typeddict", "namedtuple", "struct", "model")

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def eat(self, literal: str) -> bool:
        if self.text.startswith(literal, self.pos):
            self.pos += len(literal)
            return True
        return False

    def need(self, literal: str) -> None:
        assert self.eat(literal), (literal, self.text[self.pos :], self.text)

    def ident(self) -> str:
        match = re.compile(r"[A-Za-z_][A-Za-z0-9_]*").match(self.text, self.pos)
        assert match is not None, self.text[self.pos :]
        self.pos = match.end()
        return match.group()

    def sep_list(self, item: Callable[[], object], end: str) -> int:
        count = 1
        item()
        while self.eat(", "):
            item()
            count += 1
        self.need(end)
        return count

    def type_(self) -> None:
        for head in ("list[", "Optional["):
            if self.eat(head):
                self.type_()
                return self.need("]")
        if self.eat("tuple["):
            if self.eat("()]"):
                return None
            self.type_()
            if self.eat(", ...]"):
                return None
            while self.eat(", "):
                self.type_()
            return self.need("]")
        if self.eat("dict["):
            assert self.eat("str, ") or self.eat("int, ")
            self.type_()
            return self.need("]")
        if self.eat("Union["):
            assert self.sep_list(self.type_, "]") >= 2
            return None
        if self.eat("Literal["):
            self.sep_list(self.literal, "]")
            return None
        if self.eat("enum ") or self.eat("flag "):
            self.ident()
            self.need("{")
            self.sep_list(self.member, "}")
            return None
        for record in self.RECORDS:
            if self.eat(record + " "):
                self.ident()
                if self.eat("{") and not self.eat("}"):
                    self.sep_list(self.field, "}")
                return None
        for scalar in self.SCALARS:
            if self.eat(scalar):
                return None
        raise AssertionError(f"not a TYPE at {self.text[self.pos :]!r} in {self.text!r}")

    def field(self) -> None:
        self.ident()
        self.need(": ")
        self.type_()
        self.eat(" = ...")

    def member(self) -> None:
        self.ident()
        self.need("=")
        self.value()

    def literal(self) -> None:
        start = self.pos
        if re.compile(r"[A-Za-z_]\w*\.").match(self.text, self.pos) and not self.eat("None"):
            self.ident()
            self.need(".")
            self.member()
            return
        self.pos = start
        self.value()

    def value(self) -> None:
        for word in ("None", "True", "False", "inf", "-inf", "nan"):
            if self.eat(word):
                return
        if self.eat("("):
            if self.eat(")"):
                return
            self.value()
            if self.eat(",)"):
                return
            self.sep_list(self.value, ")")
            return
        number = re.compile(r"-?\d+(\.\d+)?(e[+-]\d{2,})?").match(self.text, self.pos)
        if number is not None:
            self.pos = number.end()
            return
        self.eat("b")
        quote = self.text[self.pos]
        assert quote in "'\"", self.text[self.pos :]
        self.pos += 1
        while self.text[self.pos] != quote:
            self.pos += 2 if self.text[self.pos] == "\\" else 1
        self.pos += 1


class Colour(enum.Enum):
    RED = "red"
    CRIMSON = "red"  # noqa: PIE796  (an alias: A.2 lists it too)
    DARK = 2.5


class Perm(enum.Flag):
    R = 1
    W = 2


class Pair(NamedTuple):
    a: int
    b: str = "x"


class Opts(TypedDict, total=False):
    depth: int


@dataclass
class Tree:
    label: str
    children: list[Tree] = field(default_factory=list)


UserId = NewType("UserId", int)


@pytest.mark.parametrize(
    "tp",
    [
        int | str | None,
        None | int,  # Optional wherever None stands
        tuple[()],
        tuple[int, ...],
        tuple[int, str, bytes],
        dict[str, list[float]],
        dict[int, Tree | None],
        Literal["a", 1, b"x", None, True],
        Literal[Colour.RED, "b"],
        Colour,
        Perm,
        Pair,
        Opts,
        Tree,
        Annotated[list[UserId], "meta"],
        list[NDArray[np.float32]],
        list[torch.Tensor],
    ],
    ids=repr,
)
def test_each_type_description_is_a_sentence_of_appendix_a2(tp: object) -> None:
    whole(compile_type(tp, where="w").description)


def whole(text: str) -> None:
    """``text`` is one TYPE of A.2, all of it."""
    reader = Grammar(text)
    reader.type_()
    assert reader.pos == len(text), text


@pytest.mark.parametrize(
    "text", ["List[int]", "tuple[int,...]", "dict[float, int]", "Union[int]", "enum E{}", "int]"]
)
def test_the_grammar_reader_refuses_what_a2_does_not_allow(text: str) -> None:
    with pytest.raises(AssertionError):
        whole(text)


# ------------------------------------------------------------- the page's byte examples


def hex_bytes(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


def test_the_bye_and_metadata_examples_are_what_the_code_writes() -> None:
    bye = re.search(
        r"a BYE is the header `([0-9a-f ]+)` \+ (\d+) zero bytes, and the payload\s+"
        r"`([0-9a-f ]+)`",
        TEXT,
    )
    assert bye is not None
    header = hex_bytes(bye.group(1)) + bytes(int(bye.group(2)))
    assert encode_control(MessageKind.BYE, Bye("shutdown")) == [header, hex_bytes(bye.group(3))]
    block = re.search(r"the block of `\{\"k\": \"v\"\}` is\s+`([0-9a-f ]+)`", TEXT)
    assert block is not None
    assert encode_block({"k": "v"}) == hex_bytes(block.group(1))
    assert decode_block(memoryview(hex_bytes(block.group(1))), 0, 7) == ({"k": "v"}, 7)
