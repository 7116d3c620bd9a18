"""What a user installs works: the wheel and sdist build, install and type-check.

``python -m build`` runs on a copy of the package sources (so the working tree gets no
``build/`` or ``*.egg-info``), offline (``--no-isolation``: the build backend is this
venv's). Each install goes into a fresh virtual environment that reaches this venv's
packages (torch, pyzmq, mypy, pip) through a ``.pth`` line, so nothing is downloaded:
``pip install --no-deps --no-index``. mypy then checks a small user project outside the
repository, configured as the docs tell users to (strict, the ``tensorrpc.mypy_plugin``
plugin), once against the installed wheel and once against an editable install made for
type checkers (``pip install -e --config-settings editable_mode=strict``: a tree of links
to the package, which mypy follows; the default editable install is an import hook that
it cannot follow). Neither install makes anything but ``tensorrpc`` importable: the
repository's ``tests``, ``bench`` and ``examples`` must not shadow a user's own.

mypy shares the project's ``.mypy_cache`` (same options as pyproject.toml), so torch's
analysis from the ``make check`` run that precedes the tests is reused.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600

USER_CODE = """\
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import assert_type

import torch

import tensorrpc
from tensorrpc import rpc, service


@service
class Calc:
    @rpc
    async def add(self, a: int, b: int = 1) -> int:
        return a + b

    @rpc
    def scale(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor

    @rpc
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i


async def main(client: tensorrpc.Client[Calc]) -> None:
    calc = client.stub()
    assert_type(await calc.add(1, 2), int)
    assert_type(await calc.scale(torch.ones(2), 2.0), torch.Tensor)
    assert_type(calc.count(3), tensorrpc.CallStream[int])
    assert_type(await client.call(Calc.add, 1), int)
    # Strict mode reports an unused ignore: each line proves mypy sees tensorrpc's types.
    await calc.add("x")  # type: ignore[arg-type]
    z: torch.Tensor = calc.scale(torch.ones(2), 2.0)  # type: ignore[assignment]
    calc.nothing()  # type: ignore[misc]
    del z
"""

USER_CONFIG = """\
[tool.mypy]
strict = true
python_version = "3.11"
warn_unreachable = true
plugins = ["tensorrpc.mypy_plugin"]
"""


def _clean_env() -> dict[str, str]:
    """The environment without anything that points Python or mypy at the repository."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        args,
        cwd=cwd,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    return proc


def _fresh_venv(path: Path) -> Path:
    """A venv without pip whose site-packages also sees this interpreter's packages."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(path)
    python = path / "bin" / "python"
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], path
    )
    shared = sysconfig.get_paths()["purelib"]
    # A .pth line adds the directory only: the .pth files inside it (this venv's own
    # editable tensorrpc) are not run, so the fresh venv has no tensorrpc of its own.
    Path(purelib.stdout.strip(), "_shared_packages.pth").write_text(shared + "\n")
    return python


#: Top-level packages of the repository that are not part of the distribution.
NOT_INSTALLED = ("tests", "bench", "examples")


def _source_copy(dest: Path) -> Path:
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(
        ROOT / "tensorrpc", dest / "tensorrpc", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in NOT_INSTALLED:  # beside the package, as in the repository
        (dest / name).mkdir()
        (dest / name / "__init__.py").write_text("")
    return dest


#: Prints where each top-level name imports from ("-" when it does not import).
WHERE_FROM = f"""
import importlib.util
for name in ("tensorrpc", *{NOT_INSTALLED!r}):
    spec = importlib.util.find_spec(name)
    print(name, spec.origin if spec else "-")
"""


def _importable(python: Path, cwd: Path) -> dict[str, str]:
    """Where ``tensorrpc`` and the repository's other packages import from, seen from ``cwd``."""
    out = _run([str(python), "-c", WHERE_FROM], cwd).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


def _user_project(dest: Path) -> Path:
    dest.mkdir()
    (dest / "pyproject.toml").write_text(USER_CONFIG)
    (dest / "user_app.py").write_text(USER_CODE)
    return dest


def _mypy(python: Path, project: Path) -> str:
    proc = _run(
        [str(python), "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache"), "user_app.py"],
        project,
    )
    return proc.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """``(sources, wheel, sdist)`` from one ``python -m build`` (sdist, then wheel from it)."""
    base = tmp_path_factory.mktemp("packaging")
    src = _source_copy(base / "src")
    dist = base / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist)], src)
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    return src, wheel, sdist


def _package_files() -> set[str]:
    return {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tensorrpc").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_sdist_has_the_sources_license_and_marker(built: tuple[Path, Path, Path]) -> None:
    _, _, sdist = built
    with tarfile.open(sdist) as tar:
        top = sdist.name.removesuffix(".tar.gz")
        names = {n.removeprefix(top + "/") for n in tar.getnames()}
    assert {"LICENSE", "README.md", "pyproject.toml", "tensorrpc/py.typed"} <= names
    assert _package_files() <= names


def test_wheel_metadata_and_files(built: tuple[Path, Path, Path]) -> None:
    _, wheel, _ = built
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (metadata_name,) = (n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(zf.read(metadata_name).decode())
    assert _package_files() <= names
    assert {n.split("/")[0] for n in names} == {"tensorrpc", "tensorrpc-0.1.0.dist-info"}
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Requires-Python"] == ">=3.11"
    assert "Typing :: Typed" in metadata.get_all("Classifier", [])
    assert any(r.startswith("torch") for r in metadata.get_all("Requires-Dist", []))
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text
    assert "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text


def test_installed_wheel_imports_runs_and_type_checks(
    built: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    _, wheel, _ = built
    python = _fresh_venv(tmp_path / "venv")
    _run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], tmp_path
    )
    project = _user_project(tmp_path / "app")
    # One interpreter: import the package, then run the
    # console script pip wrote (its code, as `tensorrpc --help` runs it).
    script = tmp_path / "venv" / "bin" / "tensorrpc"
    code = (
        "import runpy, sys, tensorrpc\n"
        "print(tensorrpc.__file__, flush=True)\n"
        f"sys.argv = [{str(script)!r}, '--help']\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    out = _run([str(python), "-c", code], project).stdout
    where, cli = out.split("\n", 1)
    assert Path(where).is_relative_to(tmp_path / "venv")
    assert script.read_text().startswith(f"#!{python}")
    assert "serve" in cli
    found = _importable(python, project)
    assert Path(found.pop("tensorrpc")).is_relative_to(tmp_path / "venv")
    assert found == dict.fromkeys(NOT_INSTALLED, "-")
    assert "Success: no issues found in 1 source file" in _mypy(python, project)


def _editable_install(src: Path, venv_dir: Path, *options: str) -> Path:
    """A fresh venv with ``pip install -e src`` (plus ``options``); returns its python."""
    python = _fresh_venv(venv_dir)
    pip = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    _run([*pip, "--no-build-isolation", *options, "-e", str(src)], venv_dir)
    return python


def test_editable_install_imports_the_package_and_nothing_beside_it(
    built: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    # A copy of its own: the install writes nothing into `built`'s sources.
    src = shutil.copytree(built[0], tmp_path / "src")
    python = _editable_install(src, tmp_path / "venv")
    project = _user_project(tmp_path / "app")
    # The sources themselves (edits take effect), found without importing them.
    assert _importable(python, project) == {
        "tensorrpc": str(src / "tensorrpc" / "__init__.py"),
        **dict.fromkeys(NOT_INSTALLED, "-"),
    }
    # A module added after the install is found too (the hook maps the package directory).
    (src / "tensorrpc" / "_added_later.py").write_text("")
    code = "import importlib.util; print(importlib.util.find_spec('tensorrpc._added_later'))"
    assert "_added_later.py" in _run([str(python), "-c", code], project).stdout


def test_editable_install_for_type_checkers_is_followed_by_mypy(
    built: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    src = shutil.copytree(built[0], tmp_path / "src")
    python = _editable_install(src, tmp_path / "venv", "--config-settings", "editable_mode=strict")
    project = _user_project(tmp_path / "app")
    where = _importable(python, project)
    # A tree of links to the package's files: edits show through, and mypy follows it.
    assert Path(where.pop("tensorrpc")).resolve() == src / "tensorrpc" / "__init__.py"
    assert where == dict.fromkeys(NOT_INSTALLED, "-")
    assert "Success: no issues found in 1 source file" in _mypy(python, project)


def test_extras_install_from_the_wheel_as_the_readme_shows(
    built: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    _, wheel, _ = built
    readme = (ROOT / "README.md").read_text()
    assert "pip install 'dist/tensorrpc-0.1.0-py3-none-any.whl[metrics,top]'" in readme
    assert wheel.name == "tensorrpc-0.1.0-py3-none-any.whl"
    python = _fresh_venv(tmp_path / "venv")
    # pip resolves the extras' requirements (found in this venv's packages, no index).
    out = _run(
        [str(python), "-m", "pip", "install", "--dry-run", "--no-index", f"{wheel}[metrics,top]"],
        tmp_path,
    ).stdout
    assert "Would install tensorrpc-0.1.0" in out
    assert "prometheus_client" in out.replace("-", "_")
    assert "rich" in out


def test_make_dist_builds_with_the_build_tools_only(tmp_path: Path) -> None:
    # `make -n` prints the commands the target would run, without running them.
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    out = _run([make, "-n", "-C", str(ROOT), "dist", "DIST_VENV=" + str(tmp_path / "v")], ROOT)
    commands = out.stdout
    assert "pip install" in commands
    assert "build 'setuptools>=77'" in commands
    assert "-m build --no-isolation --outdir dist" in commands
    assert "[dev" not in commands  # not the development environment
    assert ".venv/bin" not in commands
