"""What the reproduction pipelines (:mod:`mtcli.reproduce`, :mod:`mtcli.multilingual`,
:mod:`mtcli.backtranslation`) share: their seeds, read from ``--seeds`` and made runs of their
own; a results table whose place is checked before the training, and whose row is kept for the
command line to print when it cannot be written (:class:`Unsaved`); a finished run's row kept
for a rerun; and whether a run is the recipe whose table the README shows."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mtcli.config import MAX_SEED, Config, load_config, with_changes
from mtcli.data.corpora import plan_corpora
from mtcli.data.download import CORPORA, cache_root, located, unpinned
from mtcli.errors import ConfigError, Terminated
from mtcli.fileio import FileHasher, atomic_write, check_file_target
from mtcli.logs import get_logger
from mtcli.results import recipe_fingerprint, source_tree
from mtcli.rundir import CONFIG_NAME, checkpoint_dir, step_checkpoints
from mtcli.train.resume import INEXACT_KEYS


def seed_config(config: Config, seed: int) -> Config:
    """``config`` made a run of its own for seed ``seed``: ``train.seed`` and the run directory
    ``<the recipe's run dir>-seed<seed>``."""
    return with_changes(config, "train", seed=seed, run_dir=f"{config.run_path()}-seed{seed}")


def check_run_recipe(config: Config) -> None:
    """:class:`ConfigError` when ``config``'s run directory holds checkpoints trained with other
    settings of those a resume lets change (:data:`~mtcli.train.resume.INEXACT_KEYS`: the learning
    rate, dropout, label smoothing...; its ``config.yaml`` says): training would go on under the
    new ones, a finished run train nothing, and the row it gave be filed under this recipe. The
    batch size (``train.max_tokens``, ``update_freq``: what out-of-memory advice changes) and the
    precision may change; what a resume refuses, training refuses itself."""
    run = config.run_path()
    if not (run / CONFIG_NAME).is_file() or not any(checkpoint_dir(run).glob("checkpoint_*.pt")):
        return  # nothing trained yet: it starts afresh
    was, now = (_settings(c) for c in (load_config(run / CONFIG_NAME, lenient=True), config))
    differ = [f"{key}: {was[key]} -> {now[key]}" for key in sorted(was) if was[key] != now[key]]
    if differ:
        raise ConfigError(f"{run}: trained to another recipe ({'; '.join(differ[:4])}{'; ...' if len(differ) > 4 else ''}"
                          "); a row of the table is one recipe's: remove that directory to train anew, or give the "
                          "settings it was trained with")


#: A finished run's row, kept in its run directory with what it was scored from: a pipeline
#: run again (after an interruption, or to write its table again) takes it, instead of
#: averaging and decoding that run again.
ROW_RECORD = "pipeline_row.json"


def _scored_from(config: Config, data: str) -> dict[str, Any]:
    """What a run's row depends on: mtcli's files (:func:`~mtcli.results.source_tree`: another
    version may decode or score otherwise), the whole config (decoding and test splits too),
    the data it read (:func:`~mtcli.results.data_fingerprint`), and its step checkpoints
    (name, size, time written: trained on, or anew, they differ)."""
    checkpoints = [[path.name, stat.st_size, stat.st_mtime_ns]
                   for _, path in step_checkpoints(config.run_path()) for stat in (path.stat(),)]
    return {"tree": source_tree(), "config": json.loads(json.dumps(config.to_dict(), default=str)), "data": data,
            "checkpoints": checkpoints}


def _rows_kept(record: Path) -> dict[str, Any]:
    """The rows ``record`` keeps by pipeline step; {} when there is none, or it is unreadable
    (then the rows are scored again, and it is written anew)."""
    try:
        saved = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def scored_row(config: Config, kind: str, data: str, score: Callable[[], dict[str, Any]]
               ) -> tuple[dict[str, Any], bool]:
    """The row of the pipeline step ``kind`` (a recipe's scoring, a tuning run's) for
    ``config``'s trained run, and whether it was kept: the one ``score()`` gave earlier, when
    nothing it depends on (:func:`_scored_from`) changed since; else ``score()``'s, recorded
    beside the rows of other steps. A record that cannot be written is a warning (the row
    still goes to the table; a rerun scores the run again). Call it after training: a run
    that trains further has other checkpoints."""
    record = config.run_path() / ROW_RECORD
    basis, rows = _scored_from(config, data), _rows_kept(record)
    saved = rows.get(kind)
    if isinstance(saved, dict) and saved.get("row") is not None and \
            {key: saved.get(key) for key in basis} == basis:
        get_logger().info("%s: scored earlier, its row kept (%s; remove that file to score it again)",
                          config.run_path(), record)
        return saved["row"], True
    row = score()
    try:
        with atomic_write(record) as handle:
            handle.write(json.dumps({**rows, kind: {**basis, "row": row}}, indent=2, default=str) + "\n")
    except OSError as exc:
        get_logger().warning("%s: cannot keep the row for a rerun (%s)", record, exc.strerror or exc)
    return row, False


#: Settings a pipeline's run may resume under: the batch size, for memory, and the precision.
_MAY_CHANGE = frozenset({"train.max_tokens", "train.update_freq", "train.precision", "train.compile"})


def _settings(config: Config) -> dict[str, Any]:
    """``config``'s values of the keys :func:`check_run_recipe` compares, as JSON reads them back."""
    data = json.loads(json.dumps(config.to_dict(), default=str))
    return {dotted: (data.get(dotted.split(".")[0]) or {}).get(dotted.split(".", 1)[1])
            for dotted in INEXACT_KEYS - _MAY_CHANGE}


def parse_seeds(text: str | None) -> list[int] | None:
    """The seeds ``--seeds 1,2,3`` names (None without it); :class:`ConfigError` for anything but
    distinct whole numbers from 0 to :data:`MAX_SEED`, before any work."""
    if text is None:
        return None
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: expected integers separated by commas, e.g. 1,2,3") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r}: give one or more distinct seeds, e.g. 1,2,3")
    if not all(0 <= seed <= MAX_SEED for seed in seeds):
        raise ConfigError(f"--seeds {text!r}: each seed must be between 0 and {MAX_SEED}")
    return seeds


class Unsaved(Exception):  # noqa: N818 - a state, as Terminated is
    """A pipeline's results, finished but not written (a full disk, a results table changed
    while it trained, a Ctrl-C during the writes): ``row`` holds them, so that the command line
    can print them and the work is not lost; ``__cause__`` is why."""

    def __init__(self, row: Any) -> None:
        super().__init__("the results were not written")
        self.row = row


def check_table_place(results_dir: Path, table_name: str) -> None:
    """Raise what writing ``results_dir``'s table would (:class:`OSError` naming the file in the
    way), before hours of training rather than after them."""
    for kind in ("json", "md"):
        check_file_target(results_dir / f"{table_name}.{kind}")


def write_or_keep(write: Callable[[], None], row: Any) -> None:
    """``write()`` the results; when that fails (:class:`OSError`) or is interrupted (the files,
    each written whole, may then disagree), :class:`Unsaved` with ``row``, from why."""
    try:
        write()
    except (OSError, KeyboardInterrupt, Terminated) as exc:
        raise Unsaved(row) from exc


__all__ = ["Unsaved", "check_table_place", "is_the_recipe", "parse_seeds", "row_is_the_recipe", "scored_row",
           "seed_config", "write_or_keep"]


def _file_fingerprint(recipe: str, overrides: list[str] | None) -> str | None:
    """The fingerprint of the recipe file ``recipe`` (with ``overrides``); None where it is not
    found, as when run outside a checkout."""
    try:
        return recipe_fingerprint(load_config(recipe, overrides))
    except ConfigError:
        return None


def load_recipe(path: str | Path, overrides: list[str]) -> Config:
    """:func:`~mtcli.config.load_config` of a recipe. One of mtcli's own (``configs/...``) not
    found from here is said to be read from an mtcli checkout, where the reproduce commands run
    (its ``configs/`` holds the recipes, ``results/`` and ``README.md`` the tables)."""
    if str(path).startswith("configs/") and not Path(path).is_file():
        raise ConfigError(f"{path}: not found in {Path.cwd()}; the reproduce commands run from an mtcli checkout, "
                          "whose configs/ holds the recipes (or give the path of a recipe file)")
    return load_config(path, overrides)


def row_is_the_recipe(row: dict[str, Any], recipe: str, overrides: list[str]) -> bool:
    """Whether the seeds of ``row`` trained the recipe file ``recipe`` (with ``overrides``): rows
    from before the fingerprint, which do not say, are taken as the recipe's."""
    recipes = {seed.get("recipe") for seed in (row.get("seeds") or {"": row}).values()} - {None}
    return recipes <= {_file_fingerprint(recipe, overrides)}  # (one that says another recipe: not)


def is_the_recipe(config: Config, recipe: str, overrides: list[str] | None = None) -> bool:
    """Whether ``config`` trains what the recipe file ``recipe`` (with ``overrides``) trains, as
    :func:`~mtcli.results.recipe_fingerprint` says, on the recipe's data: a run changed by
    ``--set``/``--config``, or reading other text from its own directory (``--data``), does not
    refresh the README's table, whose rows are the recipes' (False where the file is not found)."""
    return recipe_fingerprint(config) == _file_fingerprint(recipe, overrides) and \
        _reads_the_recipes_data(config, recipe, overrides)


def _in_place(source: str, own: str) -> bool:
    """Whether ``source`` reads other text in place of the public corpus ``own`` the recipe
    names: a directory given instead, or a local copy that the name finds (``../shared/data``,
    ``MTCLI_DATA``), which no download verified (a subset or a lowercased copy there wrote the
    README's table as the recipe's)."""
    if own not in CORPORA:
        return False
    if source != own:
        return True
    where = located(own)
    return where is not None and Path(where).resolve() != (cache_root() / own).resolve()


def _reads_the_recipes_data(config: Config, recipe: str, overrides: list[str] | None) -> bool:
    """Whether each corpus ``config`` reads from a directory in place of the public corpus the
    recipe names (a local copy) holds that corpus's pinned files; a warning names one that does not."""
    pairs = list(zip(config.data.corpora(), load_config(recipe, overrides).data.corpora(), strict=False))
    if not any(_in_place(corpus.source, own.source) for corpus, own in pairs):
        return True  # nothing read in place of a public corpus: nothing to hash
    found = plan_corpora(config.data).fingerprint(FileHasher())
    for (corpus, own), files in zip(pairs, found.get("corpora", [found]), strict=False):
        if _in_place(corpus.source, own.source):
            other = unpinned(own.source, files["files"]) if "files" in files else ["(not a directory of files)"]
            if other:
                where = corpus.source if corpus.source != own.source else located(own.source)  # (a local copy)
                get_logger().warning("%s: %s is not the text of %s the recipe reads: the scores are not the "
                                     "recipe's", where, other[0], own.source)
                return False
    return True
