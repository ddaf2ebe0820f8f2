"""The package's shape: import-linter's contracts (pyproject.toml), and the size limits.

The layering is checked by import-linter itself (``lint-imports``), on the package as it is and on
a copy with one upward import and one cycle added, which it must refuse. The size rules (modules
under 600 lines, functions under 80) and the rule that mtcli's own modules import each other at
the top (the command line, ``cli.py``, ``cli_recipes.py`` and ``cli_errors.py``, excepted: it imports the library per
command, for start-up time) are read
from the source with ``ast``.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "mtcli"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with the project's contracts, on the ``mtcli`` package under ``root``."""
    if not LINT_IMPORTS.exists():
        pytest.skip(f"{LINT_IMPORTS} not installed (pip install -e '.[dev]')")
    return subprocess.run([str(LINT_IMPORTS), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
                          cwd=root, capture_output=True, text=True, env={"PYTHONPATH": str(root)})


def test_the_import_contracts_hold() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "line", "broken"), [
    ("model/transformer.py", "import mtcli.infer.search", "mtcli is layered"),
    ("infer/search.py", "import mtcli.train.trainer", "decoding never imports training"),
    ("data/cache.py", "import mtcli.data.prepare", "no import cycle"),
])
def test_the_contracts_refuse_an_upward_import_or_a_cycle(tmp_path: Path, module: str, line: str,
                                                          broken: str) -> None:
    shutil.copytree(PACKAGE, tmp_path / "mtcli", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "mtcli" / module
    path.write_text(path.read_text(encoding="utf-8") + f"\n{line}  # noqa\n", encoding="utf-8")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_modules_and_functions_stay_small() -> None:
    too_long: list[str] = []
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "\n".join(too_long)


def test_mtcli_modules_import_each_other_at_the_top() -> None:
    """An import of mtcli inside a function hides a dependency from import-linter (and once hid
    an import cycle); only the command line's per-command imports, the package's lazy ``Translator``
    attribute (``mtcli/__init__.py``'s ``__getattr__``) and the entry point's guarded import of
    the CLI are deliberate."""
    hidden: list[str] = []
    for path in _sources():
        if path in (PACKAGE / "cli.py", PACKAGE / "cli_recipes.py", PACKAGE / "cli_errors.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if path == PACKAGE / "__init__.py" and node.name == "__getattr__":
                continue
            if path == PACKAGE / "__main__.py" and node.name == "main":  # the entry point: a Ctrl-C in its import
                continue
            for inner in ast.walk(node):
                names = [inner.module or ""] if isinstance(inner, ast.ImportFrom) else \
                    [a.name for a in inner.names] if isinstance(inner, ast.Import) else []
                if any(n == "mtcli" or n.startswith("mtcli.") for n in names):
                    hidden.append(f"{path.relative_to(REPO)}:{inner.lineno} in {node.name}")
    assert not hidden, "\n".join(hidden)


def test_architecture_md_names_every_module() -> None:
    """ARCHITECTURE.md's table of modules is where a reader finds what each one holds: a module
    split off without a row there was found only by reading the package."""
    import re

    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8"), re.M))
    modules = {path.relative_to(PACKAGE).as_posix() for path in _sources() if path.name != "__init__.py"}
    assert modules - {"__main__.py"} <= listed, sorted(modules - listed - {"__main__.py"})
    assert listed <= modules, sorted(listed - modules)
