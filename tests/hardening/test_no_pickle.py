"""Never pickle: the package source uses no pickle machinery, and the decoder refuses it.

vLLM's ZMQ CVEs (CVE-2025-30165, CVE-2025-32444, CVE-2024-11041) all came from unpickling
network input. The source check reads every module of ``tensorrpc/`` with ``tokenize``
(names only: comments and docstrings may mention pickle) and ``ast`` (``torch.load``
without ``weights_only=True``, ``numpy.load`` with ``allow_pickle``), and is itself
tested on planted bad sources so that it cannot pass vacuously.
"""

from __future__ import annotations

import ast
import io
import pickle
import tokenize
from pathlib import Path

import numpy as np
import pytest
import torch

from tensorrpc import _codec
from tensorrpc._exceptions import DecodeError, ErrorCode
from tensorrpc._protocol import MessageKind

from ._live import live_engine

PACKAGE = Path(__file__).resolve().parents[2] / "tensorrpc"

#: Identifiers that mean pickle machinery, wherever they appear as code.
FORBIDDEN_NAMES = frozenset(
    {
        "pickle",
        "_pickle",
        "cPickle",
        "cloudpickle",
        "dill",
        "marshal",
        "shelve",
        "copyreg",
        "joblib",
        "jsonpickle",
        "__reduce__",
        "__reduce_ex__",
        "__setstate__",
        "pickle_module",
        "Unpickler",
        "PickleBuffer",
    }
)


def pickle_findings(source: str, filename: str = "<source>") -> list[str]:
    """Every use of pickle machinery in ``source``, as ``file:line: what``."""
    found: list[str] = []
    # A name token is a substring of the source: most modules need no (slow) tokenizing.
    if any(name in source for name in FORBIDDEN_NAMES):
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.NAME and tok.string in FORBIDDEN_NAMES:
                found.append(f"{filename}:{tok.start[0]}: name {tok.string}")
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = ast.unparse(func)
        keywords = {kw.arg: kw.value for kw in node.keywords}
        allow = keywords.get("allow_pickle")
        if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
            found.append(f"{filename}:{node.lineno}: {name}(allow_pickle=...) not False")
        if name.endswith(("torch.load", "serialization.load")) or name == "load":
            weights_only = keywords.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                found.append(f"{filename}:{node.lineno}: {name}() without weights_only=True")
    return found


def package_sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_checker_catches_planted_pickle_uses() -> None:
    planted = {
        "import pickle\n": "name pickle",
        "from cloudpickle import loads\n": "name cloudpickle",
        "import dill as d\n": "name dill",
        "import marshal\n": "name marshal",
        "class A:\n    def __reduce__(self):\n        return (A, ())\n": "name __reduce__",
        "import torch\nx = torch.load('f')\n": "without weights_only",
        "import torch\nx = torch.load('f', weights_only=False)\n": "without weights_only",
        "import numpy as np\nnp.load('f', allow_pickle=True)\n": "(allow_pickle=...) not False",
    }
    for source, expected in planted.items():
        findings = pickle_findings(source)
        assert any(expected in f for f in findings), (source, findings)
    clean = "import torch\n# pickle in a comment\nx = torch.load('f', weights_only=True)\n"
    clean += "import numpy as np\ny = np.load('f', allow_pickle=False)\n"
    clean += '"""the word pickle in a docstring"""\n'
    assert pickle_findings(clean) == []


def test_package_source_has_no_pickle_machinery() -> None:
    sources = package_sources()
    assert len(sources) >= 10, sources  # the whole package, transports included
    assert any(p.parent.name == "transports" for p in sources)
    findings: list[str] = []
    for path in sources:
        findings += pickle_findings(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert findings == []


class _Evil:
    """Unpickling this would run code: a decoder that unpickles would set the flag."""

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (exec, ("import builtins; builtins.TENSORRPC_PWNED = True",))


def _pickle_payloads() -> list[bytes]:
    buffers: list[pickle.PickleBuffer] = []
    oob = pickle.dumps(
        pickle.PickleBuffer(bytearray(b"x" * 4096)), protocol=5, buffer_callback=buffers.append
    )
    return [
        pickle.dumps([1, 2], protocol=5),
        pickle.dumps({"a": np.arange(10)}, protocol=5),
        pickle.dumps(torch.ones(3), protocol=5),
        pickle.dumps(_Evil(), protocol=5),
        pickle.dumps(_Evil(), protocol=2),
        pickle.dumps(_Evil(), protocol=0),
        oob,
    ]


@pytest.mark.parametrize("index", range(len(_pickle_payloads())))
def test_decoder_refuses_pickle_streams(index: int) -> None:
    payload = _pickle_payloads()[index]
    with pytest.raises(DecodeError):
        _codec.decode(payload, [])
    with pytest.raises(DecodeError):
        _codec.decode(payload, [bytearray(64)])
    import builtins

    assert not hasattr(builtins, "TENSORRPC_PWNED")


async def test_live_engine_answers_pickle_with_decode_error_and_keeps_serving(
    tmp_path: Path,
) -> None:
    async with live_engine(tmp_path) as (server, peer, _):
        payloads = _pickle_payloads()
        for i, payload in enumerate(payloads, start=1):
            peer.raw_call(i, "add", payload)
            msg = await peer.expect(MessageKind.ERROR, i)
            assert msg.error().code == ErrorCode.DECODE, msg.error()
        # a pickle stream with a tensor-sized out-of-band frame beside it
        n = len(payloads) + 1
        peer.send(
            [
                *_call_header(n, "scale"),
                pickle.dumps(_Evil(), protocol=5),
                bytearray(1024),
            ]
        )
        msg = await peer.expect(MessageKind.ERROR, n)
        assert msg.error().code == ErrorCode.DECODE
        call_id = peer.call("add", 20, 22)
        assert await peer.result(call_id) == 42
        assert server.statistics().errors == n
    import builtins

    assert not hasattr(builtins, "TENSORRPC_PWNED")


def _call_header(call_id: int, method: str) -> list[bytes]:
    from tensorrpc._protocol import pack_call_header

    return [pack_call_header(call_id, method)]
