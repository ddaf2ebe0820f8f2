"""The results tables and where their rows ran.

Each table is ``results/<table>.json`` (its rows), ``results/<table>.md`` (rendered) and a block
of README.md between the table's markers, all written by the command that produces the numbers
(:mod:`mtcli.reproduce`, :mod:`mtcli.multilingual`, :mod:`mtcli.backtranslation`), so every
number in the README comes from a command. A row names the commit it ran (``-dirty`` when files
differ from it; the tables themselves do not count), the git tree of its files, and its device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from mtcli.config import Config, DataConfig, DecodeConfig, ModelConfig, TrainConfig
from mtcli.device import cpu_has_bf16_units, cpu_name
from mtcli.errors import ConfigError, DataError, shown
from mtcli.fileio import atomic_write
from mtcli.logs import get_logger
from mtcli.version import __version__

RESULTS_DIR = Path("results")
README = Path("README.md")
MARK_START, MARK_END = "<!-- results:start -->", "<!-- results:end -->"
#: every results table: the recipes' (mtcli.reproduce), the multilingual and back-translation ones
TABLES = ("bt", "multi30k", "multilingual", "wmt_news")


#: config keys that say where and how a run is carried out, not what it trains: a recipe's
#: fingerprint leaves them out (and each ``data.sources`` corpus's ``source``), so the same recipe
#: run from a local copy of the data, on another device or with another seed compares equal; the
#: data's own fingerprint (:func:`data_fingerprint`) says whether two runs read the same text
PLACE_KEYS = {"data": ("source", "prepared_dir", "num_workers"),
              "train": ("seed", "run_dir", "device", "num_threads", "progress", "log_every", "compile"),
              "decode": ("workers", "max_tokens")}
RECIPE_FINGERPRINT_VERSION = 1


def _defaults(section: str) -> dict[str, Any]:
    """The default value of each key of a config section that has one."""
    kind = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig, "decode": DecodeConfig}[section]
    found = {}
    for item in dataclasses.fields(kind):
        if item.default is not dataclasses.MISSING:
            found[item.name] = item.default
        elif item.default_factory is not dataclasses.MISSING:
            found[item.name] = item.default_factory()
    return json.loads(json.dumps(found, default=str))


def recipe_fingerprint(config: Config) -> str:
    """16 hex digits of a sha256 over what ``config`` sets apart from the defaults, less
    :data:`PLACE_KEYS`: each results row keeps it (``recipe``), so that seeds of different
    recipes are never averaged into one row. A key a later mtcli adds, with its default, leaves
    the fingerprint as it was."""
    data = json.loads(json.dumps(config.to_dict(), default=str))
    for corpus in data.get("data", {}).get("sources") or []:  # where each corpus is read from, as data.source
        corpus.pop("source", None)
    kept: dict[str, Any] = {"version": RECIPE_FINGERPRINT_VERSION}
    for section, body in sorted(data.items()):
        defaults = _defaults(section) if section in ("data", "model", "train", "decode") else {}
        kept[section] = {key: value for key, value in sorted((body or {}).items())
                         if key not in PLACE_KEYS.get(section, ()) and (key not in defaults or defaults[key] != value)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def results_home(results_dir: Path, changed: bool) -> Path:
    """Where a table's rows go: ``results_dir``; for a run that changed the recipe, given the
    default ``results/``, ``results/changed/``, so that a smoke test does not replace the rows the
    README shows."""
    return results_dir / "changed" if changed and results_dir == RESULTS_DIR else results_dir


def table_place(results_dir: Path, readme: Path | None, table_name: str, changed: bool) -> tuple[Path, Path | None]:
    """Where a table goes (:func:`results_home`) and the README to refresh (none for a run that
    changed the recipe), said in a warning when the recipe was changed."""
    home = results_home(results_dir, changed)
    if changed:
        get_logger().warning("the recipe was changed (--config/--forward/--reverse/--set): the table goes to %s%s",
                             home / f"{table_name}.json", f"; {readme} is left as it is" if readme else "")
    return home, None if changed else readme


def data_fingerprint(inputs: dict[str, Any]) -> str:
    """16 hex digits of a sha256 over a prepared cache's record of what it was made from (its
    manifest's ``inputs``: each file's sha256, or the hub dataset and its revision). Each results
    row keeps it (``data``): the recipe's fingerprint leaves out where the data was read from (a
    local copy compares equal), so this says whether two seeds read the same data."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def seeds_of_recipe(seeds: dict[str, dict[str, Any]], recipe: str | None) -> dict[str, dict[str, Any]]:
    """The stored ``seeds`` trained by ``recipe`` (:func:`recipe_fingerprint`): the others, or
    those that do not say, are left out (with a warning), never averaged with this run's."""
    dropped = [seed for seed, row in seeds.items() if recipe is None or row.get("recipe") != recipe]
    if dropped:
        get_logger().warning("seed(s) %s of the stored results were trained by another recipe (or do not say "
                             "which): left out", ", ".join(dropped))
    return {seed: row for seed, row in seeds.items() if seed not in dropped}


def seeds_of_data(seeds: dict[str, dict[str, Any]], data: str | None) -> dict[str, dict[str, Any]]:
    """The stored ``seeds`` trained and scored on the data ``data`` (:func:`data_fingerprint`;
    a row from before it, which does not say, is taken as it is): the others are left out, with
    a warning, never averaged with this run's."""
    dropped = [seed for seed, row in seeds.items() if None not in (data, row.get("data")) and row["data"] != data]
    if dropped:
        get_logger().warning("seed(s) %s of the stored results were trained and scored on other data: left out",
                             ", ".join(dropped))
    return {seed: row for seed, row in seeds.items() if seed not in dropped}


def check_one_recipe(seeds: dict[Any, dict[str, Any]], what: str) -> None:
    """Refuse seed rows (seed -> row) of different recipes (:func:`recipe_fingerprint`) or data
    (:func:`data_fingerprint`), naming each seed's. Rows from before the recipe's fingerprint
    merge only with each other (one that does not say cannot be checked against one that
    does); a row from before the data's is taken as it is."""
    for key, words in (("recipe", "by different recipes"), ("data", "on different data")):
        said = {str(seed): row.get(key) for seed, row in seeds.items()}
        values = set(said.values())
        if len(values - {None}) > 1 or (key == "recipe" and None in values and len(values) > 1):
            each = ", ".join(f"seed {seed}: {value or 'not said'}" for seed, value in sorted(said.items()))
            raise ConfigError(f"{what}: the seeds were trained {words} ({each}); merge the seeds of one")


def checkout() -> Path | None:
    """The git checkout mtcli runs from (the directory above the package, when it holds a
    ``.git``), or None for an installed mtcli: a row names the files of mtcli that ran it, never
    those of the directory it was run in (a user's own project, whose git is not mtcli's)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / ".git").exists() else None


def _git(*args: str, env: dict[str, str] | None = None) -> str:
    """``git ARGS`` in mtcli's checkout: its output, stripped (raises on failure, and without a
    checkout: :class:`FileNotFoundError`)."""
    root = checkout()
    if root is None:
        raise FileNotFoundError("mtcli runs from no git checkout")
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True, env=env,
                          cwd=root).stdout.strip()


def package_version() -> str:
    """What an installed mtcli (no checkout) records for a row's commit: ``mtcli <version>``."""
    return f"mtcli {__version__}"


def package_digest() -> str:
    """What an installed mtcli records for a row's tree: ``package:`` and the sha256 of its own
    files (their paths and bytes), which any other version of mtcli changes."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(f"{path.relative_to(root).as_posix()}\0".encode())
        digest.update(path.read_bytes())
    return f"package:{digest.hexdigest()}"


#: What runs write beside the tables, which is not what they run: a smoke test's tables
#: (``results/changed/``) and the benchmarks' JSON (``bench/results/``).
WRITTEN_DIRS = (str(RESULTS_DIR / "changed"), "bench/results")


def generated_paths() -> list[str]:
    """The files a reproduction (or a benchmark) writes itself (``results/<table>.{json,md}``,
    :data:`WRITTEN_DIRS`): they never count as local edits, so a second direction run after the
    first, or after a benchmark, still carries the clean commit."""
    return [*(str(RESULTS_DIR / f"{table}.{ext}") for table in TABLES for ext in ("json", "md")), *WRITTEN_DIRS]


def _without_tables(text: str) -> str:
    """README text with every results block (between its markers) emptied."""
    for table in TABLES:
        start, end = markers(table)
        if start in text and end in text:
            head, rest = text.split(start, 1)
            text = head + start + end + rest.split(end, 1)[1]
    return text


def _own_edits() -> list[str]:
    """Pathspecs of what a reproduction writes and git should not count: the tables, and
    README.md while it differs from HEAD's only inside the results blocks."""
    excluded = generated_paths()
    readme = Path(checkout() or ".") / README
    try:
        committed = _git("show", f"HEAD:{README}")
        edited = readme.read_text(encoding="utf-8") if readme.exists() else None
        if edited is not None and _without_tables(committed).strip() == _without_tables(edited).strip():
            excluded.append(str(README))
    except (OSError, subprocess.CalledProcessError):
        pass
    return [".", *(f":(exclude){path}" for path in excluded)]


def git_commit() -> str:
    """Short hash of mtcli's checkout's HEAD (with ``-dirty`` when files other than the
    reproduction's own tables differ from it); ``mtcli <version>`` for an installed mtcli;
    ``unknown`` when git fails."""
    if checkout() is None:
        return package_version()
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", *_own_edits())
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def source_tree() -> str:
    """The git tree hash of the files as they are on disk (tracked, plus untracked ones git does
    not ignore; the reproduction's own tables as HEAD has them), or ``unknown``.

    It equals ``git rev-parse C^{tree}`` exactly when the files are commit ``C``'s, whatever the
    repository's HEAD says: a copy of a checkout whose ``.git`` is older than its files (as on a
    machine the working tree was copied to) still names the files it ran. The real index is not
    touched (a temporary one is used). An installed mtcli: :func:`package_digest`.
    """
    if checkout() is None:
        return package_digest()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"))
            _git("read-tree", "HEAD", env=env)
            _git("add", "--all", "--", *_own_edits(), env=env)
            return _git("write-tree", env=env)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def commit_of_tree(tree: str) -> str | None:
    """The short hash of the newest commit (on any branch) whose files are ``tree``, or None."""
    try:
        lines = _git("log", "--all", "--format=%h %T").splitlines()
    except (OSError, subprocess.CalledProcessError):
        return None
    return next((commit for commit, t in (line.split() for line in lines) if t == tree), None)


def device_name(device: str) -> str:
    """Human-readable name of the device a run used."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    # bf16 units decide what train.precision bf16 is worth here (1.4x fp32 or ~100x slower): say which
    return f"CPU ({cpu_name()}, {os.cpu_count()} cores{', bf16 units' if cpu_has_bf16_units() else ''})"


def seeds_by_device(seeds: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Each device that trained some of ``seeds`` (seed -> row with a ``device``) with its seeds,
    in seed order. One key when every seed ran on one machine, whose speeds may be averaged."""
    on: dict[str, list[str]] = {}
    for key in sorted(seeds, key=int):
        on.setdefault(seeds[key]["device"], []).append(key)
    return on


def seed_words(keys: list[str]) -> str:
    """``"seed 2"``, ``"seeds 1, 3"``."""
    return f"seed{'s' if len(keys) > 1 else ''} {', '.join(keys)}"


def markers(table: str) -> tuple[str, str]:
    """The README comments that enclose ``table``'s block."""
    return (MARK_START, MARK_END) if table == "multi30k" else (f"<!-- {table}:start -->", f"<!-- {table}:end -->")


def write_table(results: dict[str, Any], table: str, results_dir: Path, table_name: str, readme: Path | None,
                sort_keys: bool = False) -> None:
    """``results_dir/<table_name>.json`` (``results``) and ``.md`` (``table``), each written
    atomically, and ``table`` into the README's block (:func:`refresh_readme`; not with
    ``readme`` None)."""
    with atomic_write(results_dir / f"{table_name}.json", follow=True) as handle:
        handle.write(json.dumps(results, indent=2, sort_keys=sort_keys) + "\n")
    with atomic_write(results_dir / f"{table_name}.md", follow=True) as handle:
        handle.write(table)
    if readme is not None:
        refresh_readme(readme, table_name, table)


def refresh_readme(readme: Path, table_name: str, table: str) -> None:
    """Put ``table`` between ``table_name``'s markers (:func:`markers`) in ``readme``, atomically;
    a README without them is left as it is."""
    start, end = markers(table_name)
    text = readme.read_text(encoding="utf-8") if readme.exists() else ""
    if start in text and end in text:
        head, rest = text.split(start, 1)
        with atomic_write(readme, follow=True) as handle:
            handle.write(f"{head}{start}\n{table}{end}{rest.split(end, 1)[1]}")


def load_results(results_dir: Path = RESULTS_DIR, table_name: str = "multi30k") -> dict[str, dict[str, Any]]:
    """Previously written results (empty when there are none); :class:`DataError` naming the
    file when it is not a JSON object (a merge conflict left in it, a truncated copy)."""
    path = results_dir / f"{table_name}.json"
    if not path.exists():
        return {}
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a results table ({exc}); mend it (a merge conflict?) or move it "
                        "away") from None
    if not isinstance(results, dict):
        raise DataError(f"{path}: not a results table (a JSON {type(results).__name__}, not an object)")
    return results


def checked_seeds(rows: Any, numbers: tuple[str, ...], where: str) -> dict[str, dict[str, Any]]:
    """``rows`` (seed -> row, as a results file holds them) when each seed is a number and each
    row a mapping with a number under each of ``numbers``; else :class:`ConfigError` naming
    ``where`` and the first seed that is not (a file of another shape, or edited by hand)."""
    if not isinstance(rows, dict) or not rows:
        raise ConfigError(f"{where}: holds no seed rows: not a results file of mtcli's (--results DIR)")
    for seed, row in rows.items():
        if not str(seed).isdigit():
            raise ConfigError(f"{where}: seed {shown(seed)} is not a number: not a results file of mtcli's")
        bad = [key for key in numbers if not isinstance(row, dict) or type(row.get(key)) not in (int, float)]
        if bad:
            raise ConfigError(f"{where}: seed {seed} has no number under {', '.join(bad)}: not a results file "
                              "of mtcli's (--results DIR)")
    return rows


def named_commit(row: dict[str, Any], where: str) -> dict[str, Any]:
    """``row`` with a ``-dirty`` commit replaced by the commit whose files it ran (same tree),
    when this repository has one; as it is otherwise."""
    tree = row.get("tree")
    if not str(row.get("commit", "")).endswith("-dirty") or not tree:
        return row
    commit = commit_of_tree(tree)
    if commit is None:
        return row
    get_logger().info("%s: %s ran the files of commit %s (tree %s)", where, row["commit"], commit, tree[:12])
    return {**row, "commit": commit}
