"""The docs cannot rot: every Python block in README.md and docs/*.md runs, and the site builds.

Rules for authors (also in docs/index.md, "About these pages"):

* Every fenced block opened with three backticks and ``python`` is a complete program. It
  runs as ``python -X dev -W error block.py`` (this venv's), in a process of its own with
  a temporary directory as its working directory and as ``TMPDIR``, and must exit 0 within
  :data:`TIMEOUT_S` seconds, leave no process running and no file behind (ipc:// socket
  files included). The process is forked from an interpreter with the same flags that has
  already imported torch and tensorrpc (tests/_forkserver.py): the block still has to
  import what it uses, and it skips the seconds of torch's import.
* A block that genuinely cannot run on its own (an interface sketch, a snippet that needs
  key files or another host) is preceded by ``<!-- doctest: skip (why) -->`` on the line
  just above its opening fence (blank lines between are allowed). The reason is required.
* A block whose fence names a file, ``python title="echo_service.py"``, is a module
  that later blocks of the same page import: it is written into the working directory
  (which is on ``PYTHONPATH``) of itself and of every block after it on that page.
* Output is not compared; examples ``assert`` what they promise.
"""

from __future__ import annotations

import ast
import hashlib
import html
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import _forkserver

ROOT = Path(__file__).resolve().parent.parent
#: Pages whose Python blocks are run.
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
#: Per block; examples are meant to finish in a few seconds (torch's import is most of it).
TIMEOUT_S = 90.0

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
_SKIP = re.compile(r"^\s*<!--\s*doctest:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->\s*$")
_ANY_DOCTEST_COMMENT = re.compile(r"^\s*<!--\s*doctest")
_IPC_PATH = re.compile(r"ipc://(?P<path>/[^\"'\s]+)")
_TITLE = re.compile(r'title="(?P<name>[\w.-]+\.py)"')

#: Blocks on pages owned by other people that are not programs (interface sketches, or
#: snippets that need key files and a remote host) and do not carry a skip marker yet,
#: identified by page and the SHA-256 of their code (first 16 hex digits). They are
#: reported as skipped until the page's owner marks them (a marker wins) or makes them
#: runnable; then the entry can go. An edited or new block is not covered and runs.
#: Do not add entries: mark the block in its page instead.


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced Python block of a page."""

    page: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    code: str
    skip_reason: str | None
    #: The file name the page gives the block (``title="name.py"``), if any.
    filename: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.code.encode()).hexdigest()[:16]


def extract_blocks(text: str, page: str) -> list[Block]:
    """Return the ``python`` fenced blocks of a markdown text, with their skip markers.

    Raises:
        ValueError: A fence is not closed, or a ``doctest`` comment is malformed or does
            not sit right above a python block.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    used_markers: set[int] = set()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, fence = match["indent"], match["fence"]
        info = match["info"].strip().split()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if (
                close is not None
                and close["fence"][0] == fence[0]
                and len(close["fence"]) >= len(fence)
                and not close["info"].strip()
            ):
                break
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        else:
            raise ValueError(f"{page}:{start + 1}: unclosed code fence")
        i += 1
        if not info or info[0] not in ("python", "py", "python3"):
            continue
        title = _TITLE.search(match["info"])
        skip_reason = None
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0 and _ANY_DOCTEST_COMMENT.search(lines[j]):
            marker = _SKIP.match(lines[j])
            if marker is None:
                raise ValueError(
                    f"{page}:{j + 1}: malformed marker; write <!-- doctest: skip (reason) -->"
                )
            skip_reason = marker["reason"].strip()
            used_markers.add(j)
        filename = title["name"] if title is not None else None
        blocks.append(Block(page, start + 1, "\n".join(body) + "\n", skip_reason, filename))
    for n, line in enumerate(lines):
        if _ANY_DOCTEST_COMMENT.search(line) and n not in used_markers:
            raise ValueError(f"{page}:{n + 1}: doctest marker not right above a python block")
    return blocks


def _all_blocks() -> tuple[list[Block], dict[str, str]]:
    blocks: list[Block] = []
    errors: dict[str, str] = {}
    for path in PAGES:
        page = str(path.relative_to(ROOT))
        try:
            blocks += extract_blocks(path.read_text(encoding="utf-8"), page)
        except ValueError as exc:
            errors[page] = str(exc)
    return blocks, errors


BLOCKS, PAGE_ERRORS = _all_blocks()


def test_pages_have_closed_fences_and_well_formed_markers() -> None:
    assert PAGE_ERRORS == {}


def _leftover_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a recycled id owned by someone else
        return False
    return True


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    if block.skip_reason is not None:
        pytest.skip(f"marked in the page: {block.skip_reason}")
    work = tmp_path / "cwd"
    tmp = tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    script = tmp_path / "doc_example.py"
    script.write_text(block.code, encoding="utf-8")
    modules = _page_files_up_to(block)
    for module in modules:
        assert module.filename is not None
        (work / module.filename).write_text(module.code, encoding="utf-8")
    env = dict(os.environ)
    # The working tree's tensorrpc (and examples/), whatever the venv's install looks like;
    # the page's module files in the working directory.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work), str(ROOT), env.get("PYTHONPATH")]))
    env["TMPDIR"] = str(tmp)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    ipc_files = [Path(m["path"]) for m in _IPC_PATH.finditer(block.code)]
    before = {p for p in ipc_files if p.exists()}
    started = time.monotonic()
    # Output goes to a file, not a pipe: a pipe would make us wait for any child that
    # inherited it, and the leftover-process check below would never see it.
    log_path = tmp_path / "output.txt"
    with log_path.open("wb") as log:
        proc = _forkserver.popen(
            [sys.executable, "-X", "dev", "-W", "error", str(script)],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            text = log_path.read_text(errors="replace")
            pytest.fail(f"{block.id} ran past {TIMEOUT_S} s:\n{text}")
    text = log_path.read_text(errors="replace")
    assert proc.returncode == 0, f"{block.id} exited {proc.returncode}:\n{text}"
    # Children of the example (engine processes) must be gone too.
    deadline = time.monotonic() + 5.0
    while _process_group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _process_group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{block.id} left processes running")
    written = sorted(str(m.filename) for m in modules)
    assert _leftover_files(work) == written, f"{block.id} left files in its working directory"
    assert _leftover_files(tmp) == [], f"{block.id} left files in TMPDIR"
    left = [str(p) for p in ipc_files if p.exists() and p not in before]
    assert left == [], f"{block.id} left ipc socket files"
    assert time.monotonic() - started < TIMEOUT_S


def _page_files_up_to(block: Block) -> list[Block]:
    """The module blocks (with a file name) of ``block``'s page, up to ``block`` itself."""
    return [
        b
        for b in BLOCKS
        if b.page == block.page and b.filename is not None and b.line <= block.line
    ]


def test_every_page_in_the_nav_exists_and_every_page_is_in_the_nav() -> None:
    nav = re.findall(r":\s*([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav) == pages


def _missing_docs_toolchain() -> str | None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return module
    return None


@dataclass(frozen=True)
class BuiltSite:
    """One ``mkdocs build`` of the docs: its log, exit status and output directory."""

    log: str
    returncode: int
    root: Path

    def page(self, name: str) -> str:
        """The HTML of ``name.md`` (the offline plugin writes ``name.html``)."""
        return (self.root / f"{name}.html").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> BuiltSite:
    missing = _missing_docs_toolchain()
    if missing is not None:
        pytest.skip(f"{missing} is not installed: pip install -e '.[docs]' to check the site")
    site = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return BuiltSite(proc.stdout + proc.stderr, proc.returncode, site)


@pytest.mark.slow
def test_mkdocs_build_is_strict_clean(built_site: BuiltSite) -> None:
    assert built_site.returncode == 0, built_site.log
    log = built_site.log.splitlines()
    warnings = [line for line in log if line.startswith(("WARNING", "ERROR"))]
    assert warnings == []
    reference = built_site.page("reference")
    import tensorrpc

    missing_names = [n for n in tensorrpc.__all__ if f'id="tensorrpc.{n}"' not in reference]
    assert missing_names == [], "the API reference does not render these exported names"
    # It opens with the client (not PROTOCOL_VERSION, as grouping by category did), and
    # renders each name once.
    rendered = re.findall(r'id="tensorrpc\.(\w+)"', reference)
    assert rendered[0] == "Client"
    assert rendered.count("Client") == 1


#: A Sphinx role left in a docstring, as it shows in the rendered text.
_SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|data|exc|mod|obj|const):`")
#: A mkdocstrings cross-reference that did not resolve: autorefs leaves the source text.
_UNRESOLVED_REF = re.compile(r"\[[^\]\n]{1,80}\]\[[\w.]+\]")
#: Headings of dunder members (``tensorrpc.Client.__aenter__``) in the reference.
_DUNDER_ID = re.compile(r'id="(tensorrpc[\w.]*\.__\w+__)"')


def rendering_problems(page_html: str) -> list[str]:
    """Literal Sphinx roles, unresolved cross-references and dunder headings in a page."""
    text = html.unescape(re.sub(r"<[^>]+>", "", page_html))
    return [
        *(f"Sphinx role {m!r}" for m in _SPHINX_ROLE.findall(text)),
        *(f"unresolved reference {m!r}" for m in _UNRESOLVED_REF.findall(text)),
        *(f"dunder member {m!r}" for m in _DUNDER_ID.findall(page_html)),
    ]


def test_rendering_problems_are_found() -> None:
    page = (
        '<h3 id="tensorrpc.Client.__aenter__">x</h3><p>Raises :class:`<code>Foo</code>`'
        "; see [<code>Client</code>][tensorrpc.Nope]; fine: <a href=x>Client</a></p>"
    )
    assert rendering_problems(page) == [
        "Sphinx role ':class:`'",
        "unresolved reference '[Client][tensorrpc.Nope]'",
        "dunder member 'tensorrpc.Client.__aenter__'",
    ]
    assert rendering_problems("<p>a <code>[x][y]</code> b</p>") == ["unresolved reference '[x][y]'"]


@pytest.mark.slow
def test_rendered_pages_have_no_sphinx_roles_unresolved_references_or_dunders(
    built_site: BuiltSite,
) -> None:
    pages = sorted(built_site.root.glob("*.html"))
    assert len(pages) >= 15
    problems = {
        p.name: found for p in pages if (found := rendering_problems(p.read_text(encoding="utf-8")))
    }
    assert problems == {}


# -- the extractor itself ------------------------------------------------------------------


def test_extract_blocks_reads_markers_and_ignores_other_languages() -> None:
    text = "\n".join(
        [
            "# Page",
            "```python",
            "print(1)",
            "```",
            "<!-- doctest: skip (fragment) -->",
            "",
            "```python",
            "x.y()",
            "```",
            "```console",
            "make test",
            "```",
            "- item",
            "",
            "  ```python",
            "  print(2)",
            "  ```",
            '```python title="svc.py"',
            "X = 1",
            "```",
        ]
    )
    blocks = extract_blocks(text, "page.md")
    assert [(b.line, b.code, b.skip_reason, b.filename) for b in blocks] == [
        (2, "print(1)\n", None, None),
        (7, "x.y()\n", "fragment", None),
        (15, "print(2)\n", None, None),
        (18, "X = 1\n", None, "svc.py"),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "```python\nprint(1)\n",
        "<!-- doctest: skip -->\n```python\nx\n```",
        "<!-- doctest: skip (no block follows) -->\ntext\n",
        "<!-- doctest: skip (a console block) -->\n```console\nx\n```",
    ],
)
def test_extract_blocks_rejects_bad_fences_and_markers(text: str) -> None:
    with pytest.raises(ValueError, match=r"page\.md:\d+"):
        extract_blocks(text, "page.md")


def test_pages_are_found() -> None:
    assert ROOT / "README.md" in PAGES
    assert ROOT / "docs" / "index.md" in PAGES


# -- the README's benchmark figures are the benchmark page's -------------------------------

_FIGURE = re.compile(r"(?<![\w.,])\d[\d,.]*\s?(?:µs|ms|s|/s)(?![\w])")


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def test_readme_benchmark_figures_are_copied_from_the_benchmark_page() -> None:
    """Every figure in the README's "How fast" section appears verbatim in benchmarks.md."""
    readme = _section((ROOT / "README.md").read_text(encoding="utf-8"), "## How fast")
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    figures = set(_FIGURE.findall(readme))
    assert len(figures) >= 15, figures
    assert sorted(f for f in figures if f not in page) == []


def test_figure_pattern_reads_latencies_and_rates() -> None:
    text = "281 µs, 11,295/s and 12.3 ms; 4 times, 64 MiB, p99s"
    assert _FIGURE.findall(text) == ["281 µs", "11,295/s", "12.3 ms"]


# -- code fits the page ----------------------------------------------------------------------

#: Columns of code the site shows without scrolling at 1280 px (docs/stylesheets/extra.css
#: and the integrated table of contents make room for them; checked on screenshots).
CODE_COLUMNS = 100


#: Languages of the blocks readers copy from; a block without one (a terminal capture,
#: a diagram) may be wider: the site scrolls it inside its box.
CODE_LANGUAGES = frozenset({"python", "py", "python3", "console", "bash", "sh", "toml", "yaml"})


def long_code_lines(text: str) -> list[tuple[int, int]]:
    """``(line, length)`` of every code line longer than CODE_COLUMNS (see CODE_LANGUAGES)."""
    found: list[tuple[int, int]] = []
    fence: str | None = None
    checked = False
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if match is not None and (fence is None or match["fence"][0] == fence[0]):
            if fence is None:
                fence = match["fence"]
                words = match["info"].split()
                checked = bool(words) and words[0] in CODE_LANGUAGES
            else:
                fence = None
            continue
        if fence is not None and checked and len(line) > CODE_COLUMNS:
            found.append((number, len(line)))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_code_lines_fit_the_page(page: Path) -> None:
    assert long_code_lines(page.read_text(encoding="utf-8")) == []


def test_long_code_lines_are_found() -> None:
    text = "x" * 120 + "\n```python\n" + "y" * 101 + "\n" + "z" * 100 + "\n```\n"
    assert long_code_lines(text) == [(3, 101)]
    capture = "```\n" + "w" * 130 + "\n```\n```console\n" + "v" * 101 + "\n```\n"
    assert long_code_lines(capture) == [(5, 101)]


def test_docstrings_have_no_rst_literal_markers() -> None:
    # The reference renders docstrings as Markdown: an RST "text::" + indented block shows
    # the "::" and a bare indented block; write a fenced block instead.
    found = []
    for path in sorted((ROOT / "tensorrpc").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            doc = (
                ast.get_docstring(node, clean=False)
                if isinstance(
                    node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
                )
                else None
            )
            for line in (doc or "").splitlines():
                if line.rstrip().endswith("::"):
                    found.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert found == []


def test_messages_spell_dialling_one_way() -> None:
    # Logs and errors say "dialling" (as the docs do); "dialing" is only a state's name.
    found = []
    for path in sorted((ROOT / "tensorrpc").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and "dialing" in node.value
                and node.value != "dialing"
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert found == []
