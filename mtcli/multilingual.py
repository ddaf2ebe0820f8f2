"""``make reproduce-multilingual``: one model for six Multi30k directions, beside the bilingual ones.

Run ``mtcli reproduce-multilingual [--seeds 1,2,3] [--config configs/multi30k_multi.yaml]``. For
each seed: prepare -> train -> average the last k step checkpoints, k chosen on the mean
validation BLEU over the directions -> for each direction, the length penalty chosen on its own
validation split -> its test split. The seeds' rows are kept in ``results/multilingual.json``
(a seed run again replaces its row, so seeds may run one at a time; seeds run apart, one
process or machine each with ``--results DIR``, are added with ``--merge DIR...``), and each
direction's mean, sample standard deviation and
per-seed lowercased BLEU are rendered to ``results/multilingual.md`` beside the bilingual
recipes' means of ``results/multi30k.json`` (and into README.md between
``<!-- multilingual:start -->`` and ``<!-- multilingual:end -->``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtcli.config import Config, with_changes
from mtcli.data.prepare import prepare
from mtcli.errors import ConfigError, DataError, one_line
from mtcli.evaluate import NoTestText, evaluate, evaluate_directions
from mtcli.infer.loading import run_directions
from mtcli.logs import get_logger
from mtcli.pipeline import (
    check_run_recipe,
    check_table_place,
    is_the_recipe,
    load_recipe,
    parse_seeds,
    row_is_the_recipe,
    scored_row,
    seed_config,
    write_or_keep,
)
from mtcli.reproduce import SCORES, trained_on
from mtcli.results import (
    README,
    RESULTS_DIR,
    check_one_recipe,
    checked_seeds,
    device_name,
    git_commit,
    load_results,
    markers,
    named_commit,
    recipe_fingerprint,
    seed_words,
    seeds_by_device,
    seeds_of_data,
    seeds_of_recipe,
    source_tree,
    table_place,
    write_table,
)
from mtcli.train import TrainSummary, train
from mtcli.tuning import choose_average, search_length_penalty

RECIPE = "configs/multi30k_multi.yaml"
TABLE = "multilingual"
BILINGUAL_TABLE = "multi30k"
MARKS = markers(TABLE)


def choose_average_all(run_dir: Path, valid_split: str, max_k: int
                       ) -> tuple[Path, int, dict[str, float], dict[str, float]]:
    """:func:`~mtcli.tuning.choose_average` on the mean validation BLEU over every direction.
    Returns the kept average, k, the mean BLEU by k, and the kept average's validation BLEU by
    direction (``"en-de"``: decoded with the recipe's length penalty, so not decoded again)."""
    by_direction: dict[int, dict[str, float]] = {}

    def mean_bleu(path: Path, k: int) -> float:
        reports = evaluate_directions(run_dir, split=valid_split, checkpoint=str(path),
                                      output_dir=run_dir / "eval" / f"avg{k}")
        by_direction[k] = {r["direction"]: round(float(r["bleu"]), 2) for r in reports}
        return statistics.fmean(float(r["bleu"]) for r in reports)

    path, used, scores = choose_average(run_dir, valid_split, max_k, mean_bleu)
    return path, len(used), scores, by_direction[len(used)]


def score_direction(run_dir: Path, config: Config, checkpoint: Path, direction: tuple[str, str],
                    recipe_bleu: float | None = None) -> dict[str, Any]:
    """One direction's test scores, with its length penalty chosen on its validation split
    (``recipe_bleu``: the checkpoint's validation BLEU with the recipe's length penalty, when
    already decoded)."""
    src, tgt = direction
    valid, test = config.data.valid_split, config.data.test_splits[0]

    def valid_bleu(alpha: float) -> float:
        report = evaluate(run_dir, split=valid, checkpoint=str(checkpoint), src_lang=src, tgt_lang=tgt,
                          length_penalty=alpha, output_dir=run_dir / "eval" / f"lp{alpha:g}")
        return round(float(report["bleu"]), 2)

    alpha, by_alpha = search_length_penalty(valid_bleu, config.decode.length_penalty, recipe_bleu)
    report = evaluate(run_dir, split=test, checkpoint=str(checkpoint), src_lang=src, tgt_lang=tgt,
                      length_penalty=alpha)
    keep = (*SCORES, "bleu_signature", "bleu_lc_signature", "chrf_signature", "sentences", "sentences_per_second",
            "device")
    return {**{key: report.get(key) for key in keep}, "length_penalty": alpha, "valid_bleu_by_length_penalty": by_alpha}


def run_seed(config: Config) -> dict[str, Any]:
    """prepare -> train -> choose the average on val -> score every direction's test split."""
    check_run_recipe(config)  # (before prepare: said at once)
    prepared = prepare(config)
    summary = train(config)
    data = trained_on(prepared.directory)
    return scored_row(config, "multilingual", data, lambda: _score_seed(config, summary, data))[0]


def _score_seed(config: Config, summary: TrainSummary, data: str) -> dict[str, Any]:
    """:func:`run_seed`'s average chosen on val and scores on every direction's test split."""
    run_dir = summary.run_dir
    checkpoint, k, by_k, valid_bleu = choose_average_all(run_dir, config.data.valid_split, config.train.keep_last)
    scores = {}
    for direction in run_directions(run_dir, config):
        name = "-".join(direction)
        try:
            scores[name] = score_direction(run_dir, config, checkpoint, direction, valid_bleu.get(name))
        except NoTestText:  # a corpus without validation or test sets (as evaluate skips it)
            get_logger().warning("%s: not scored: it has no text of split '%s' or '%s'", name,
                                 config.data.valid_split, config.data.test_splits[0])
    if not scores:
        raise DataError(f"{run_dir}: no direction has text of split '{config.data.valid_split}' and "
                        f"'{config.data.test_splits[0]}' to score")
    return {"seed": config.train.seed, "directions": scores, "average_last": k, "valid_mean_bleu_by_average": by_k,
            "params": summary.parameters, "train_steps": summary.steps,
            "train_minutes": summary.elapsed_seconds / 60.0, "train_tokens_per_s": summary.tokens_per_second,
            "device": device_name(str(next(iter(scores.values()))["device"])), "commit": git_commit(), "tree": source_tree(),
            "run_dir": str(run_dir), "recipe": recipe_fingerprint(config), "data": data}


def merge_seeds(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """The seed rows of results written apart (``--results DIR`` per process or machine):
    ``DIR`` or ``DIR/multilingual.json`` each; a seed found twice is an error."""
    seeds: dict[str, dict[str, Any]] = {}
    for path in paths:
        file = path / f"{TABLE}.json" if path.is_dir() else path
        try:
            table = json.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{file}: results file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: not a multilingual results file ({one_line(exc)})") from None
        found = checked_seeds(table.get("seeds") if isinstance(table, dict) else None, (), str(file))
        for seed, row in found.items():
            directions = row.get("directions")
            if not isinstance(directions, dict) or not directions:
                raise ConfigError(f"{file}: seed {seed} has no directions: not a multilingual results file")
            for name, scores in directions.items():
                checked_seeds({seed: scores}, SCORES, f"{file} (direction {name})")
            if seed in seeds:
                raise ConfigError(f"{file}: seed {seed} is in two of the merged files")
            seeds[seed] = named_commit(row, f"{file} seed {seed}")
    return seeds


def combine(seeds: dict[str, dict[str, Any]], bilingual: dict[str, Any]) -> dict[str, Any]:
    """Each direction's mean, sample standard deviation and per-seed scores over ``seeds``, with
    the bilingual recipe's mean lowercased BLEU (and its number of seeds) beside it where
    ``results/multi30k.json`` has one."""
    order = sorted(seeds, key=int)
    names = list(seeds[order[0]]["directions"])
    directions: dict[str, Any] = {}
    for name in names:
        rows = [seeds[s]["directions"][name] for s in order if name in seeds[s]["directions"]]
        entry: dict[str, Any] = {key: statistics.fmean(float(r[key]) for r in rows) for key in SCORES}
        entry["bleu_lc_std"] = statistics.stdev(float(r["bleu_lc"]) for r in rows) if len(rows) > 1 else None
        entry["bleu_lc_per_seed"] = [float(r["bleu_lc"]) for r in rows]
        entry["bleu_lc_signature"] = rows[0].get("bleu_lc_signature")
        mono = bilingual.get(name) or {}
        if mono and not _same_test_set(mono, rows[0]):  # (a smaller or other copy of the test set: no comparison)
            entry["bilingual_other_test_set"] = f"{mono.get('test_set')}; these: {rows[0].get('sentences')} sentences"
            mono = {}
        entry["bilingual_bleu_lc"] = mono.get("bleu_lc")
        entry["bilingual_seeds"] = len(mono.get("seeds") or {}) or int(bool(mono))
        directions[name] = entry
    return {"directions": directions, "seeds": seeds}


def _same_test_set(bilingual: dict[str, Any], scored: dict[str, Any]) -> bool:
    """Whether a bilingual row (its ``test_set``: ``test_2016_flickr (1000 sentences)``) was scored
    on as many sentences as a multilingual direction: what the rows record of their test sets."""
    count = re.search(r"\((\d+) sentences\)", str(bilingual.get("test_set", "")))
    return count is None or scored.get("sentences") is None or int(count[1]) == int(scored["sentences"])


def _training_time(seeds: dict[str, dict[str, Any]]) -> str:
    """The seeds' training minutes and tok/s, averaged over the seeds that ran on one machine: a
    mean over two machines is no speed figure, so each machine gets its own, with its seeds."""
    on = seeds_by_device(seeds)
    parts = []
    for device, keys in on.items():
        label = f"; {seed_words(keys)}" if len(on) > 1 else ""
        parts.append(f"{statistics.fmean(seeds[k]['train_minutes'] for k in keys):.1f} min of training each on "
                     f"{device} ({statistics.fmean(seeds[k]['train_tokens_per_s'] for k in keys):,.0f} tok/s{label})")
    return "; ".join(parts)


def render(results: dict[str, Any]) -> str:
    """The markdown table: one row per direction, the multilingual model beside the bilingual one."""
    lines = ["| direction | multilingual BLEU (lc) | ± sd | per seed | bilingual (same test set; seeds) "
             "| difference |",
             "|---|---|---|---|---|---|"]
    for name, d in results["directions"].items():
        sd = "–" if d["bleu_lc_std"] is None else f"{d['bleu_lc_std']:.2f}"
        each = " / ".join(f"{b:.2f}" for b in d["bleu_lc_per_seed"])
        bi = d["bilingual_bleu_lc"]
        diff = "–" if bi is None else f"{d['bleu_lc'] - bi:+.2f}"
        n = d.get("bilingual_seeds", 0)
        mono = "–" if bi is None else f"{bi:.2f}" + (f" ({n} seed{'s' if n != 1 else ''})" if n else "")
        lines.append(f"| {name} | {d['bleu_lc']:.2f} | {sd} | {each} | {mono} | {diff} |")
    seeds = results["seeds"]
    first = seeds[sorted(seeds, key=int)[0]]
    lines += ["", f"- {len(seeds)} seed(s); {first['params'] / 1e6:.1f}M parameters, {first['train_steps']:,} steps, "
              f"{_training_time(seeds)}; commit {' / '.join(dict.fromkeys(s['commit'] for s in seeds.values()))}"]
    other = [f"{name} ({d['bilingual_other_test_set']})" for name, d in results["directions"].items()
             if d.get("bilingual_other_test_set")]
    if other:
        lines.append(f"- not beside the bilingual rows, scored on other test sets: {', '.join(other)}")
    scored: dict[str, list[str]] = {}  # each target language's tokeniser (zh, ja-mecab, 13a) is in its signature
    for name, d in results["directions"].items():
        scored.setdefault(d["bleu_lc_signature"], []).append(name)
    for signature, names in scored.items():
        lines.append(f"- lowercased BLEU `{signature}`" + (f": {', '.join(names)}" if len(scored) > 1 else ""))
    return "\n".join(lines) + "\n"


def write(results: dict[str, Any], results_dir: Path, readme: Path | None) -> None:
    """``results/multilingual.{json,md}``, atomically, and the README's block when it has one."""
    write_table(results, render(results), results_dir, TABLE, readme)


def read_from(config: Config, directory: str | None) -> Config:
    """``config`` with every corpus read from ``directory`` (``--data``: a local copy), not its
    own source; unchanged without one."""
    if directory is None:
        return config
    if not config.data.sources:
        return with_changes(config, "data", source=directory)
    return with_changes(config, "data", sources=[dataclasses.replace(c, source=directory) for c in config.data.sources])


def reproduce_multilingual(*, config_path: str | Path = RECIPE, data: str | None = None, seeds: str = "1,2,3",
                           results: Path = RESULTS_DIR, readme: Path | None = README, overrides: Sequence[str] = (),
                           merge: Sequence[Path] = ()) -> str:
    """Train and score each of ``seeds`` (``"1,2,3"``) of the multilingual recipe (``config_path``;
    every corpus read from ``data``, a directory of Multi30k's files, when given), or with
    ``merge`` train nothing and add the seeds of these results directories (or
    ``multilingual.json`` files); write the table and return it in markdown. Raises
    :class:`~mtcli.pipeline.Unsaved` with the results when the table cannot be written."""
    if merge and (str(config_path) != RECIPE or data or overrides):
        raise ConfigError("--merge trains nothing: --config, --data and --set would change nothing")
    seed_list = parse_seeds(seeds)
    config = None if merge else read_from(load_recipe(config_path, list(overrides)), data)
    merged = merge_seeds(list(merge)) if merge else {}
    changed = (not row_is_the_recipe({"seeds": merged}, RECIPE, []) if merge  # (a smoke test's seeds:
               else not is_the_recipe(config, RECIPE))  # into results/changed/, not the README's table)
    home, readme = table_place(results, readme, TABLE, changed)
    previous = load_results(home, TABLE).get("seeds", {})
    check_table_place(home, TABLE)
    bilingual = load_results(results, BILINGUAL_TABLE)  # read now, not after the training
    if merge:
        previous.update(merged)
        check_one_recipe(previous, "--merge")
    else:
        previous = seeds_of_recipe(previous, recipe_fingerprint(config))
    fresh = {str(seed): run_seed(seed_config(config, seed)) for seed in (seed_list if config else [])}
    if fresh:
        previous = {**seeds_of_data(previous, next(iter(fresh.values()))["data"]), **fresh}
    if not previous:
        raise ConfigError("no seed to tabulate: give --seeds (e.g. 1,2,3) or --merge results with seeds")
    table = combine(previous, bilingual)
    write_or_keep(lambda: write(table, home, readme), table)
    return render(table)
