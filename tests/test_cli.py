"""The ``tensorrpc`` command line: help, describe, serve + call end to end, one-line errors.

Most cases run ``main()`` in this process (starting a Python that imports torch costs
seconds on a loaded machine); the end-to-end tests run ``serve`` and ``call`` as real
processes (``python -m tensorrpc.cli``, forked from the pre-imported interpreter of
tests/_forkserver.py; the installed ``tensorrpc`` script itself is run by
tests/test_packaging.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tensorrpc
from tensorrpc import cli
from tensorrpc.cli import (
    UsageError,
    describe_dict,
    main,
    normalize_address,
    parse_args,
    split_signature,
    to_json,
)

from . import _forkserver
from .integration.services import Calculator

ROOT = Path(__file__).resolve().parent.parent
SERVICE = "tests.integration.services:Calculator"
#: Bound on every wait for a child process (each imports torch: slow on a busy machine).
PROC_WAIT_S = 90.0


#: The command line, as ``python -m tensorrpc.cli`` (what the console script calls).
COMMAND = [sys.executable, "-m", "tensorrpc.cli"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, expected_code: int, *fragments: str) -> None:
    assert code == expected_code
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("tensorrpc")
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    # `module:Class` is imported with the current directory on sys.path.
    monkeypatch.chdir(ROOT)


# ------------------------------------------------------------------------------ help


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["serve", "--help"],
        ["describe", "--help"],
        ["call", "--help"],
        ["bench", "--help"],
        ["demo", "--help"],
    ],
    ids=lambda argv: " ".join(argv),
)
def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 0
    assert out.startswith("usage: tensorrpc")
    assert err == ""
    if argv[0] == "--help":
        for sub in ("serve", "describe", "call", "bench", "demo"):
            assert sub in out


def test_no_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys)
    assert_one_line_error(code, err, 2, "required")


# -------------------------------------------------------------------------- describe


def test_describe_prints_every_method(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "describe", SERVICE)
    assert code == 0, err
    spec = tensorrpc.describe(Calculator)
    assert "service Calculator" in out
    assert f"fingerprint {spec.fingerprint}" in out
    for method in spec.methods.values():
        assert method.signature in out
    assert "request  Calculator_add_Request(a: int, b: int = 1)" in out
    assert "response Calculator_add_Response(value: int)" in out
    assert "unary, sync (runs in a thread)" in out  # mul
    assert "stream, async" in out  # count


def test_describe_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "describe", SERVICE, "--json")
    assert code == 0
    doc = json.loads(out)
    spec = tensorrpc.describe(Calculator)
    assert doc["service"] == "Calculator"
    assert doc["fingerprint"] == spec.fingerprint
    by_name = {m["name"]: m for m in doc["methods"]}
    assert list(by_name) == list(spec.methods)
    int_schema = {"type": "integer", "minimum": -(1 << 63), "maximum": (1 << 64) - 1}
    assert by_name["add"]["params"] == [
        {"name": "a", "type": "int", "schema": int_schema},
        {"name": "b", "type": "int", "schema": int_schema, "default": 1},
    ]
    assert by_name["add"]["returns"] == "int"
    assert by_name["add"]["async"] is True
    assert by_name["mul"]["async"] is False
    assert by_name["count"]["streaming"] is True
    assert by_name["count"]["signature"] == "count(n: int) -> AsyncIterator[int]"
    assert by_name["scale"]["params"][0]["type"] == "Tensor"
    assert by_name["scale"]["params"][0]["schema"]["x-tensorrpc"] == "tensor"


def test_describe_json_gives_records_as_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    jsonschema = pytest.importorskip("jsonschema")  # the dev extra installs it
    code, out, err = run_cli(capsys, "describe", "tests.typing.test_record_typing:Tagger", "--json")
    assert code == 0, err
    doc = json.loads(out)
    defs = doc["$defs"]
    assert set(defs) == {"Request", "Span", "Options", "Reply"}
    assert defs["Request"]["x-tensorrpc"] == "struct"
    assert defs["Span"]["prefixItems"][0]["type"] == "integer"
    assert defs["Options"]["required"] == ["temperature"]
    tag = next(m for m in doc["methods"] if m["name"] == "tag")
    assert tag["params"][0]["type"].startswith("struct Request{")  # the canonical text stays
    assert tag["returns_schema"] == {"$ref": "#/$defs/Reply"}

    def valid(schema: dict[str, object], value: object) -> bool:
        validator = jsonschema.Draft202012Validator({**schema, "$defs": defs})
        return bool(validator.is_valid(value))

    request = tag["params"][0]["schema"]
    assert valid(request, {"text": "t", "spans": [[0, 2]]})
    assert not valid(request, {"text": "t", "spans": [[0, "2"]]})
    assert not valid(request, {"text": "t", "spans": [], "extra": 1})
    assert valid(tag["params"][2]["schema"], {"7": 0.5})
    assert not valid(tag["params"][2]["schema"], {"seven": 0.5})


def test_describe_json_defines_a_recursive_dataclass_once() -> None:
    @dataclasses.dataclass
    class Node:
        value: int
        children: list[Node]

    @tensorrpc.service
    class Trees:
        @tensorrpc.rpc
        async def size(self, tree: Node) -> int:
            return 1

    doc = describe_dict(tensorrpc.describe(Trees))
    assert doc["methods"][0]["params"][0]["schema"] == {"$ref": "#/$defs/Node"}
    node = doc["$defs"]["Node"]
    assert node["properties"]["children"] == {"type": "array", "items": {"$ref": "#/$defs/Node"}}
    assert node["required"] == ["value", "children"]
    json.dumps(doc)  # all of it is JSON


def test_describe_accepts_a_factory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cli_factory_mod.py").write_text(
        "from tests.integration.services import Calculator\n"
        "def make():\n"
        "    return Calculator('from-factory')\n"
        "def broken():\n"
        "    return 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, _ = run_cli(capsys, "describe", "cli_factory_mod:make")
    assert code == 0
    assert "service Calculator" in out
    code, _, err = run_cli(capsys, "describe", "cli_factory_mod:broken")
    assert_one_line_error(code, err, 1, "returned a int, not an instance of a @service class")


@pytest.mark.parametrize(
    ("target", "code", "fragment"),
    [
        ("no_such_module_xyz:Calc", 1, "cannot import 'no_such_module_xyz'"),
        ("tests.integration.services:Nope", 1, "has no attribute 'Nope'"),
        ("tests.integration.services", 2, "expected module:Class"),
        ("tests.integration.services:WAIT_NOT_THERE", 1, "has no attribute"),
        ("tests.engine_proc:ROOT", 1, "not a @service class or a factory"),
        ("tests.engine_proc:EngineProcess", 1, "is not a @service class"),
    ],
)
def test_describe_mistakes_are_one_line(
    capsys: pytest.CaptureFixture[str], target: str, code: int, fragment: str
) -> None:
    status, _, err = run_cli(capsys, "describe", target)
    assert_one_line_error(status, err, code, fragment)


def test_a_module_that_fails_to_import_is_named_with_its_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its own missing dependency is not "no module named <the target>"; its error is shown.
    (tmp_path / "cli_needs_missing.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "cli_raises.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run_cli(capsys, "describe", "cli_needs_missing:Calc")
    assert_one_line_error(
        code, err, 1, "importing 'cli_needs_missing' failed: No module named 'no_such_dependency"
    )
    code, _, err = run_cli(capsys, "describe", "cli_raises:Calc")
    assert_one_line_error(code, err, 1, "importing 'cli_raises' failed: boom at import")
    code, _, err = run_cli(capsys, "describe", "cli_raises.sub:Calc")
    assert_one_line_error(code, err, 1, "importing 'cli_raises.sub' failed: boom at import")


# ---------------------------------------------------------------------- call parsing


def test_arg_values_are_json_when_they_parse() -> None:
    args = parse_args(
        ["a=1", "b=2.5", "c=true", "d=null", "e=[1, 2]", 'f={"k": "v"}', 'g="7"', "h=hello", "i="]
    )
    assert args == {
        "a": 1,
        "b": 2.5,
        "c": True,
        "d": None,
        "e": [1, 2],
        "f": {"k": "v"},
        "g": "7",
        "h": "hello",
        "i": "",
    }


def test_data_is_a_json_object_merged_with_the_items(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parse_args([], '{"a": 2, "b": [1, 2]}') == {"a": 2, "b": [1, 2]}
    # -d values are plain JSON: a string stays a string, even one that looks like @FILE.
    assert parse_args(["b=5"], '{"a": "@x.npy"}') == {"a": "@x.npy", "b": 5}
    path = tmp_path / "args.json"
    path.write_text('{"n": 3}', encoding="utf-8")
    assert parse_args([], f"@{path}") == {"n": 3}
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"tag": "from stdin"}'))
    assert parse_args([], "@-") == {"tag": "from stdin"}
    with pytest.raises(UsageError, match="given twice \\(also in -d\\)"):
        parse_args(["a=1"], '{"a": 2}')
    with pytest.raises(UsageError, match="not JSON"):
        parse_args([], "{a: 2}")
    with pytest.raises(UsageError, match=r"^-d must be a JSON object of arguments, not list$"):
        parse_args([], "[1, 2]")  # not "-d from -d must be ..."
    path.write_text("[1]", encoding="utf-8")
    with pytest.raises(UsageError, match=r"^-d from '.*args.json' must be a JSON object"):
        parse_args([], f"@{path}")
    with pytest.raises(UsageError, match="not null"):
        parse_args([], "null")
    with pytest.raises(UsageError, match="'1x' is not a parameter name"):
        parse_args([], '{"1x": 2}')
    with pytest.raises(UsageError, match="cannot read -d"):
        parse_args([], f"@{tmp_path}/missing.json")


def test_arg_npy_files_load_without_pickle(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    np.save(path, np.arange(6, dtype=np.int16).reshape(2, 3))
    value = parse_args([f"x=@{path}"])["x"]
    assert isinstance(value, np.ndarray)
    assert value.dtype == np.int16
    assert value.shape == (2, 3)
    objects = tmp_path / "obj.npy"
    np.save(objects, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(Exception, match="cannot load"):
        parse_args([f"x=@{objects}"])


def test_addresses_default_to_loopback() -> None:
    assert normalize_address("5555") == "tcp://127.0.0.1:5555"
    assert normalize_address(":5555") == "tcp://127.0.0.1:5555"
    assert normalize_address("localhost:7") == "tcp://localhost:7"
    assert normalize_address("ipc:///tmp/x.sock") == "ipc:///tmp/x.sock"


def test_signatures_split_into_parameter_types() -> None:
    text = "f(x: Tensor, d: dict[str, list[int]] = (1, 2), p: tuple[int, str]) -> Tensor"
    assert split_signature(text) == {
        "x": "Tensor",
        "d": "dict[str, list[int]]",
        "p": "tuple[int, str]",
    }
    assert split_signature("g() -> int") == {}


def test_results_become_json_with_tensors_summarized() -> None:
    import torch

    doc = to_json({"t": torch.arange(20, dtype=torch.int32).reshape(4, 5), "b": b"\x00\x01"})
    assert doc == {
        "t": {
            "tensor": {
                "dtype": "int32",
                "shape": [4, 5],
                "numel": 20,
                "values": [0, 1, 2, 3, 4, 5, 6, 7],
            }
        },
        "b": {"bytes": "AAE="},
    }
    assert to_json(np.ones(2, dtype=np.float32), max_values=1)["tensor"]["values"] == [1.0]


@pytest.mark.parametrize(
    ("argv", "code", "fragment"),
    [
        (["call", "not-an-address", "add"], 2, "bad address 'not-an-address'"),
        (["call", "tcp://", "add"], 2, "bad address"),
        (["call", "5555", "add", "--arg", "a"], 2, "expected NAME=VALUE"),
        (["call", "5555", "add", "--arg", "1x=2"], 2, "not a parameter name"),
        (["call", "5555", "add", "--arg", "a=1", "--arg", "a=2"], 2, "given twice"),
        (["call", "5555", "add", "a=1", "--arg", "a=2"], 2, "argument a given twice"),
        (["call", "5555", "add", "a"], 2, "bad argument 'a': expected NAME=VALUE"),
        (["call", "5555", "add", "-d", "[1]"], 2, "must be a JSON object"),
        (["call", "5555", "add", "-d", '{"a": 1}', "a=2"], 2, "given twice (also in -d)"),
        (["call", "5555", "--list", "a=1"], 2, "--list takes no arguments"),
        (["call", "5555"], 2, "give a METHOD"),
        (["call", "5555", "add", "--timeout", "-1"], 2, "expected a positive number"),
        (["call", "5555", "add", "--arg", "x=@/nonexistent/x.npy"], 2, "cannot load"),
        (["serve", SERVICE, "--bind", "nowhere"], 2, "bad address"),
        (["serve", SERVICE], 2, "one of the arguments --connect --bind is required"),
        (["serve", SERVICE, "--bind", "1", "--workers", "0"], 2, "positive integer"),
        (["serve", "tests.integration.services:Nope", "--bind", "1"], 1, "no attribute"),
    ],
)
def test_usage_mistakes_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], code: int, fragment: str
) -> None:
    status, _, err = run_cli(capsys, *argv)
    assert_one_line_error(status, err, code, fragment)


def test_unreachable_engine_fails_within_the_timeout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    started = time.monotonic()
    status, _, err = run_cli(
        capsys, "call", f"ipc://{tmp_path}/nobody.sock", "add", "--timeout", "0.3"
    )
    assert time.monotonic() - started < 10
    assert_one_line_error(status, err, 1, "no engine answered", "within 0.3 s")


def test_bench_and_demo_say_when_the_checkout_is_missing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tensorrpc, "__file__", str(tmp_path / "site" / "tensorrpc" / "x.py"))
    for command in ("bench", "demo"):
        status, _, err = run_cli(capsys, command)
        assert_one_line_error(status, err, 1, "is not available", "repository checkout")


# ------------------------------------------------------------------------ end to end


@contextlib.contextmanager
def serving(
    tmp_path: Path, *args: str, service: str = SERVICE
) -> Iterator[tuple[_forkserver.Forked, Path]]:
    """``tensorrpc serve`` in a child process; always killed and reaped."""
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = _forkserver.popen(
            [*COMMAND, "serve", service, *args],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=PROC_WAIT_S)


def test_serve_and_call_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    with serving(tmp_path, "--bind", address, "--engine-id", "e1", "--workers", "4") as (
        proc,
        log,
    ):
        call = [*COMMAND, "call", address, "--timeout", str(PROC_WAIT_S)]
        # Two real `tensorrpc call` processes, side by side: unary and streaming.
        unary = _forkserver.popen(
            [*call, "add", "--arg", "a=1", "--arg", "b=41"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        stream = _forkserver.popen(
            [*call, "count", "--arg", "n=3", "--json"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = unary.communicate(timeout=PROC_WAIT_S)
            assert unary.returncode == 0, err
            assert out == "42\n"
            out, err = stream.communicate(timeout=PROC_WAIT_S)
            assert stream.returncode == 0, err
            assert out.splitlines() == ["0", "1", "2"]
        finally:
            for child in (unary, stream):
                if child.poll() is None:
                    child.kill()
                if child.stdout is not None and not child.stdout.closed:
                    child.communicate(timeout=PROC_WAIT_S)  # closes its pipes
                child.wait(timeout=PROC_WAIT_S)  # reaps it

        # The engine is up: the rest run in this process (fast).
        status, out, err = run_cli(capsys, "call", address, "--list")
        assert status == 0, err
        assert out.splitlines()[0].startswith("engine e1: service Calculator")
        assert "  count(n: int) -> AsyncIterator[int]" in out.splitlines()
        status, out, err = run_cli(capsys, "call", address, "--list", "--json")
        assert status == 0, err
        listed = json.loads(out)
        assert (listed["engine_id"], listed["service"]) == ("e1", "Calculator")
        count = next(m for m in listed["methods"] if m["name"] == "count")
        assert count == {
            "name": "count",
            "signature": "count(n: int) -> AsyncIterator[int]",
            "streaming": True,
        }

        # Arguments as people type them after httpie (positional) and grpcurl (-d JSON),
        # also after options, and mixed with --arg.
        for argv in (
            ["add", "a=1", "b=41"],
            ["--timeout", "30", "add", "a=1", "b=41"],
            ["add", "--json", "a=1", "--arg", "b=41"],
            ["add", "-d", '{"a": 1, "b": 41}'],
            ["add", "--data", '{"a": 1}', "b=41"],
        ):
            status, out, err = run_cli(capsys, "call", address, *argv)
            assert (status, out) == (0, "42\n"), (argv, err)
        status, out, err = run_cli(capsys, "call", address, "count", "-d", '{"n": 2}')
        assert (status, out.splitlines()) == (0, ["0", "1"]), err

        # Calculator() was made with no arguments: its own engine_id field is "".
        status, out, _ = run_cli(capsys, "call", address, "echo", "--arg", "tag=hi")
        assert (status, out) == (0, ":hi\n")
        status, out, _ = run_cli(capsys, "call", address, "echo", "--arg", "tag=hi", "--json")
        assert (status, out) == (0, '":hi"\n')

        npy = tmp_path / "x.npy"
        np.save(npy, np.arange(4, dtype=np.float32))
        status, out, err = run_cli(
            capsys, "call", address, "scale", "--arg", f"x=@{npy}", "--arg", "factor=2"
        )
        assert status == 0, err
        assert json.loads(out) == {
            "tensor": {"dtype": "float32", "shape": [4], "numel": 4, "values": [0, 2, 4, 6]}
        }

        status, _, err = run_cli(capsys, "call", address, "nope")
        assert_one_line_error(status, err, 1, "unknown method 'nope'", "offers: add, mul")
        status, _, err = run_cli(capsys, "call", address, "add", "--arg", "z=1")
        assert_one_line_error(status, err, 1, "unexpected argument 'z'")
        status, _, err = run_cli(capsys, "call", address, "add", "--arg", "a=x")
        assert_one_line_error(status, err, 1, "req.a: expected int")
        status, _, err = run_cli(capsys, "call", address, "fail", "--arg", "message=boom")
        assert_one_line_error(status, err, 1, "ValueError: boom")
        status, _, err = run_cli(
            capsys, "call", address, "add", "--engine", "e9", "--timeout", "0.3"
        )
        assert_one_line_error(status, err, 1, "engine 'e9' is not connected", "e1")

        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=PROC_WAIT_S) == 0
        text = log.read_text()
        assert "SIGTERM: draining" in text
        assert "Traceback" not in text
    assert not (tmp_path / "engine.sock").exists()


def test_serve_dials_a_client_that_binds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/client.sock"
    with serving(tmp_path, "--connect", address, "--engine-id", "dialer") as (proc, _):
        # `call --bind`: the command binds and waits for the engine to dial in.
        status, out, err = run_cli(
            capsys, "call", address, "--bind", "pid", "--timeout", str(PROC_WAIT_S)
        )
        assert status == 0, err
        assert out == f"{proc.pid}\n"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=PROC_WAIT_S) == 0


def test_a_method_whose_request_streams_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/streams.sock"
    streams = "tests.integration.services:Streams"
    with serving(tmp_path, "--bind", address, service=streams) as (proc, _):
        status, _, err = run_cli(capsys, "call", address, "upload", "--timeout", str(PROC_WAIT_S))
        assert_one_line_error(status, err, 1, "upload takes a stream of requests")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=PROC_WAIT_S) == 0


def test_top_without_rich_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `rich` is an optional extra; without it `top` must say so before connecting anywhere
    monkeypatch.setitem(sys.modules, "rich", None)
    code, _, err = run_cli(capsys, "top", "tcp://127.0.0.1:9", "--count", "1")
    assert_one_line_error(code, err, 1, "needs rich", "tensorrpc[top]")


def test_a_health_check_that_times_out_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def late(*args: object) -> int:
        raise tensorrpc.CallTimeoutError("health did not answer")

    monkeypatch.setattr(cli, "_run", late)
    assert main(["health", "ipc:///nowhere.sock", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert "the health check did not finish within 2 s" in err
    assert "None" not in err
