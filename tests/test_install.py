"""The installed package is complete: every module imports, every import is declared in setup.py,
and every script starts. A dependency that is present only because someone installed it by hand
fails here, not in a user's hands."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ["runtime", "tokenizer_manager", "scheduler", "vision", "kernels"]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
# Import names of declared packages that are absent on a CPU machine (their metadata is not there
# to map them to a distribution).
NOT_INSTALLED_HERE = {"flashinfer": "flashinfer-python"}


def package_modules() -> list[str]:
    names = ["launch"]
    for top in TOP_LEVEL:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def requirement_name(spec: str) -> tuple[str, str | None]:
    """'pytest>=8; extra == "test"' -> ('pytest', 'test')."""
    name = re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0]
    extra = re.search(r'extra\s*==\s*"([^"]+)"', spec)
    return canonical(name), extra.group(1) if extra else None


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str | None, set[str]]:
    """Distribution names tessera's installed metadata requires, by extra (None: always)."""
    out: dict[str | None, set[str]] = {}
    for spec in metadata.requires("tessera") or []:
        name, extra = requirement_name(spec)
        out.setdefault(extra, set()).add(name)
    return out


def imported_names(paths: list[Path]) -> set[str]:
    """Top-level names of every absolute import in these files, lazy imports included."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def third_party(names: set[str]) -> set[str]:
    local = set(TOP_LEVEL) | {"launch"}
    local |= {p.stem for p in (ROOT / "scripts").glob("*.py")}
    local |= {p.stem for p in (ROOT / "tests").glob("*.py")}
    return {n for n in names if n not in sys.stdlib_module_names and n not in local}


def distributions_of(name: str) -> set[str]:
    found = metadata.packages_distributions().get(name)
    if found:
        return {canonical(d) for d in found}
    return {canonical(NOT_INSTALLED_HERE.get(name, name))}


def undeclared(paths: list[Path], allowed: set[str]) -> list[str]:
    return sorted(
        f"{name} (distribution {sorted(dists)})"
        for name in third_party(imported_names(paths))
        if not (dists := distributions_of(name)) & allowed
    )


def python_files(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]


def setup_top_level() -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TOP_LEVEL":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no TOP_LEVEL list")


def test_setup_py_ships_every_package() -> None:
    """setup.py finds packages under its TOP_LEVEL folders: every folder with code is one."""
    assert sorted(setup_top_level()) == sorted(TOP_LEVEL)
    code_dirs = {p.parent for p in python_files(*TOP_LEVEL)}
    bare = [d for d in code_dirs if not (d / "__init__.py").is_file()]
    missing = sorted(str(d.relative_to(ROOT)) for d in bare)
    assert missing == [], f"folders with code but no __init__.py (not shipped): {missing}"


def test_runtime_imports_are_install_requires() -> None:
    """What the server imports must come with a plain install (GPU-only packages: the gpu extra)."""
    deps = declared()
    allowed = deps.get(None, set()) | deps.get("gpu", set())
    files = [ROOT / "launch.py", *python_files(*TOP_LEVEL)]
    assert undeclared(files, allowed) == []


def test_script_and_test_imports_are_declared() -> None:
    deps = declared()
    allowed = deps.get(None, set()) | deps.get("test", set())
    files = [*SCRIPTS, *python_files("tests")]
    assert undeclared(files, allowed) == []


@pytest.mark.parametrize("module", package_modules())
def test_module_imports(module: str) -> None:
    importlib.import_module(module)


# Runs each script's `--help` in a child forked from one process that imported the heavy
# libraries once (torch alone costs each fresh interpreter about a second of CPU), two at a time;
# prints a JSON map of the scripts that failed to their output.
HELP_ALL = """
import json, os, runpy, sys, tempfile
import numpy, torch, transformers  # noqa: F401 - shared by every child

def run(path, out):
    pid = os.fork()
    if pid == 0:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.argv, code = [path, "--help"], 1
        sys.path.insert(0, os.path.dirname(path))  # as `python path` puts the script's folder
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return pid

paths, running, failed = sys.argv[1:], {}, {}
tmp = tempfile.mkdtemp()
while paths or running:
    while paths and len(running) < 2:
        path = paths.pop()
        out = os.path.join(tmp, os.path.basename(path) + ".out")
        running[run(path, out)] = (path, out)
    pid, status = os.wait()
    path, out = running.pop(pid)
    text = open(out, errors="replace").read()
    if os.waitstatus_to_exitcode(status) != 0 or "usage:" not in text:
        failed[os.path.basename(path)] = text[-2000:]
print(json.dumps(failed))
"""


def test_scripts_start() -> None:
    """Each script answers --help (it imports everything it needs at the top)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", HELP_ALL, *map(str, SCRIPTS)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert SCRIPTS and not failed, failed
