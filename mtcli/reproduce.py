"""``make reproduce``: prepare -> train -> average checkpoints -> evaluate, then the BLEU table.

Run one recipe with ``mtcli reproduce de_en [--data DIR] [--seeds 1,2,3]`` (``en_de``;
``en_fr``, ``fr_en``, ``en_cs``, ``cs_en``; ``wmt_news_en_de`` for the WMT news smoke benchmark). With ``--seeds`` every seed trains its
own run (``train.seed``, run directory ``<run_dir>-seed<N>``) and is scored on its own; seeds run
apart (one per machine, each ``--seeds N --results DIR``) are combined with ``--merge DIR...``. The
direction's row holds the mean of each score, its sample standard deviation (``<score>_std``) and
every seed's row under ``seeds``. Results are merged into ``results/<table>.json`` (``multi30k``
or ``wmt_news``; one object per direction, keyed ``"de-en"`` / ``"en-de"``), rendered to
``results/<table>.md``, and that table replaces the block between the table's markers in
README.md, so every number in the README comes from this command. The first test split fills a
direction's main row; further test splits (newstest2014 and its filtered subset) are scored too
and rendered as rows of their own.

Each row names the commit it ran (``commit``, ``-dirty`` when files differ from it; the tables
this command writes itself do not count) and the git tree hash of its files (``tree``). A machine that got a copy of the working tree with an older
``.git`` labels its rows ``<older>-dirty``; ``--merge``, run in the repository, names such a row
by the commit whose tree it is, when there is one.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtcli.checkpoint import load_checkpoint
from mtcli.config import Config, load_config, with_changes
from mtcli.data.cache import PreparedCorpus
from mtcli.data.corpora import plan_corpora
from mtcli.data.prepare import prepare
from mtcli.errors import ConfigError, MtcliError
from mtcli.evaluate import evaluate
from mtcli.fileio import FileHasher, atomic_write
from mtcli.infer.averaging import average_run_checkpoints
from mtcli.logs import get_logger
from mtcli.pipeline import (
    Unsaved,
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
from mtcli.results import (
    README,
    RESULTS_DIR,
    check_one_recipe,
    checked_seeds,
    data_fingerprint,
    device_name,
    git_commit,
    load_results,
    named_commit,
    recipe_fingerprint,
    results_home,
    seed_words,
    seeds_by_device,
    seeds_of_data,
    seeds_of_recipe,
    source_tree,
    table_place,
    write_table,
)
from mtcli.rundir import CONFIG_NAME, TEXT_DIR, step_checkpoints
from mtcli.train import TrainSummary, train
from mtcli.train.parent import parent_checkpoints
from mtcli.tuning import AVERAGE_LAST, choose_average, choose_length_penalty

ADAPTED_ROW = "en-de adapted"
# recipe name -> (config, results table, row); the table names results/<table>.{json,md}
RECIPES = {
    "de_en": ("configs/multi30k_de_en.yaml", "multi30k", "de-en"),
    "en_de": ("configs/multi30k_en_de.yaml", "multi30k", "en-de"),
    "wmt_news_en_de": ("configs/wmt_news_en_de.yaml", "wmt_news", "en-de"),
    "wmt_news_en_de_adapt": ("configs/wmt_news_en_de_adapt.yaml", "wmt_news", ADAPTED_ROW),
}
#: Multi30k's other directions (the multilingual table's bilingual rows): the en-de recipe with
#: the pair's languages, and a cache and run directory of its own (:func:`pair_overrides`)
PAIRS = {f"{s}_{t}": (s, t) for s, t in (("en", "fr"), ("fr", "en"), ("en", "cs"), ("cs", "en"))}
RECIPES.update({name: ("configs/multi30k_en_de.yaml", "multi30k", f"{s}-{t}") for name, (s, t) in PAIRS.items()})


SCORES = ("bleu", "bleu_lc", "chrf")
#: the numbers of the seeds' rows that a direction's row holds the mean of (:func:`combine_seeds`)
_MEANS = (*SCORES, "decode_sents_per_s", "train_minutes", "train_tokens_per_s")
#: the numbers of a seed's row that its direction's row is combined from
SEED_NUMBERS = (*_MEANS, "train_steps", "average_last", "length_penalty")


def _seed_cells(run: dict[str, Any]) -> tuple[str, str]:
    """The table's ``± sd`` and per-seed cells (lowercased BLEU) of a direction's row."""
    seeds = run.get("seeds") or {}
    sd = run.get("bleu_lc_std")
    spread = "–" if sd is None else f"{sd:.2f}"
    each = " / ".join(f"{seeds[s]['bleu_lc']:.2f}" for s in sorted(seeds, key=int)) or "–"
    return spread, each


def _seed_speeds(run: dict[str, Any], split: str | None) -> tuple[str, str, str, str] | None:
    """The train min, train tok/s, decode sent/s and device cells of a row whose seeds ran on
    different machines: each seed's own figures, seed order, since a mean over two machines is
    no speed figure. None when every seed ran on one machine."""
    on = seeds_by_device(run.get("seeds") or {})
    if len(on) < 2:
        return None
    seeds = [run["seeds"][key] for key in sorted(run["seeds"], key=int)]
    decode = [(r if split is None else r["more_tests"][split])["decode_sents_per_s"] for r in seeds]
    return (" / ".join(f"{r['train_minutes']:.1f}" for r in seeds),
            " / ".join(f"{r['train_tokens_per_s']:,.0f}" for r in seeds),
            " / ".join(f"{d:.1f}" for d in decode),
            " / ".join(f"{device} ({seed_words(keys)})" for device, keys in on.items()))


def _table_row(label: str, scores: dict[str, Any], run: dict[str, Any], split: str | None = None) -> str:
    """One table row: ``scores`` (BLEU, chrF, decode speed) of ``run``'s test split, or of its
    extra test ``split``."""
    spread, each = _seed_cells(run) if split is None else ("–", "–")
    steps = run.get("train_steps", "?")
    steps = f"{steps:,}" if isinstance(steps, int) else str(steps)
    minutes, tokens, decode, device = _seed_speeds(run, split) or (
        f"{run['train_minutes']:.1f}", f"{run['train_tokens_per_s']:,.0f}",
        f"{scores['decode_sents_per_s']:.1f}", run["device"])
    return (
        f"| {label} | {scores['bleu_lc']:.2f} | {spread} | {each} | {scores['bleu']:.2f} "
        f"| {scores['chrf']:.2f} | {run['params'] / 1e6:.1f}M | {steps} | {minutes} "
        f"| {tokens} | {decode} | {device} | {run['commit']} |"
    )


def render_markdown(results: dict[str, dict[str, Any]]) -> str:
    """The results table (one row per direction and test split) and the sacreBLEU signatures.

    Scores of a row trained with several seeds are their means; ``± sd`` is the sample standard
    deviation of the lowercased BLEU and "per seed" each seed's lowercased BLEU, seed order. Speeds
    are means too, unless the seeds ran on different machines: then each seed's, seed order."""
    lines = [
        "| direction | BLEU (lc, 13a) | ± sd | per seed | BLEU | chrF | params | steps | train min "
        "| train tok/s | decode sent/s | device | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(results):
        r = results[key]
        lines.append(_table_row(key, r, r))
        for split, scores in sorted((r.get("more_tests") or {}).items()):
            lines.append(_table_row(f"{key} {split}", scores, r, split))
    lines.append("")
    for key in sorted(results):
        r = results[key]
        lines.append(f"- {key} {r.get('test_set', '')}, {r.get('decode', '')}:")
        lines.append(f"  BLEU `{r['bleu_signature']}`; chrF `{r['chrf_signature']}`;")
        lines.append(f"  lowercased BLEU `{r.get('bleu_lc_signature', '')}`")
    lines.extend(_adaptation_table(results))
    return "\n".join(lines) + "\n"


def write_results(results: dict[str, dict[str, Any]], results_dir: Path = RESULTS_DIR,
                  readme: Path | None = README, table_name: str = "multi30k") -> None:
    """Write ``<table_name>.json`` and ``.md`` atomically and refresh the README's block (not
    with ``readme`` None)."""
    write_table(results, render_markdown(results), results_dir, table_name, readme, sort_keys=True)


def _test_scores(run_dir: Path, splits: list[str], checkpoint: Path, alpha: float
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The report of the first test split, and the scores of the others by split."""
    split, *more_splits = splits
    report = evaluate(run_dir, split=split, checkpoint=str(checkpoint), length_penalty=alpha)
    more_tests = {}
    for other in more_splits:
        scored = evaluate(run_dir, split=other, checkpoint=str(checkpoint), length_penalty=alpha)
        more_tests[other] = {key: scored[key] for key in ("bleu", "bleu_lc", "chrf", "sentences")}
        more_tests[other]["decode_sents_per_s"] = float(scored["sentences_per_second"])
    return report, more_tests


def run_recipe(config: Config, valid_only: bool = False) -> dict[str, Any]:
    """prepare -> train -> average the last checkpoints -> pick the length penalty -> evaluate on
    test (the averaging window and the length penalty are chosen on the validation split).

    With ``valid_only`` (a tuning run) it stops before the test split: the returned row holds
    only the validation choices, and it is also written to ``run_dir/tuning.json``.
    """
    check_run_recipe(config)  # (before prepare: said at once)
    prepared = prepare(config)
    summary = train(config)
    data, kind = trained_on(prepared.directory), "tuning" if valid_only else "recipe"
    row, kept = scored_row(config, kind, data, lambda: _score_run(config, summary, data, valid_only))
    if kept:  # what scoring leaves beside the row, made again if removed since
        chosen = summary.run_dir / "checkpoints" / f"checkpoint_avg_last{row['average_last']}.pt"
        if not chosen.exists():  # (the adaptation decodes it; each is a full model, which a user may remove)
            average_run_checkpoints(summary.run_dir, chosen, last=int(row["average_last"]))
        if valid_only and not (config.run_path() / "tuning.json").exists():
            _write_tuning(config, row)
    return row


def _write_tuning(config: Config, row: dict[str, Any]) -> None:
    """A tuning run's row, in ``run_dir/tuning.json`` (bench/tune_sweep.py reads it)."""
    with atomic_write(config.run_path() / "tuning.json") as handle:
        handle.write(json.dumps(row, indent=2) + "\n")


def _score_run(config: Config, summary: TrainSummary, data: str, valid_only: bool) -> dict[str, Any]:
    """:func:`run_recipe`'s choices on val and scores on test of the trained run."""
    valid, run_dir = config.data.valid_split, summary.run_dir
    averaged, used, valid_by_average = choose_average(run_dir, valid, min(AVERAGE_LAST, config.train.keep_last))
    alpha, valid_by_alpha = choose_length_penalty(run_dir, valid, averaged, config.decode.length_penalty,
                                                  valid_by_average[str(len(used))])
    # what the training run and the choices on val give, for a tuning row and a results row alike
    common = {"seed": config.train.seed, "train_steps": summary.steps,
              "train_tokens_per_s": summary.tokens_per_second, "average_last": len(used),
              "length_penalty": alpha,
              "valid_bleu_by_average": valid_by_average,
              "valid_bleu_by_length_penalty": valid_by_alpha, "commit": git_commit(), "tree": source_tree(),
              "recipe": recipe_fingerprint(config), "data": data}
    if valid_only:
        row = {"valid_split": valid, "best_valid_bleu_greedy": summary.best_valid_bleu,
               "valid_bleu": valid_by_alpha[str(alpha)], "config": config.to_dict(), **common}
        _write_tuning(config, row)
        return row
    report, more_tests = _test_scores(run_dir, config.data.test_splits, averaged, alpha)
    return {
        "bleu": report["bleu"],
        "bleu_signature": report["bleu_signature"],
        "bleu_lc": report["bleu_lc"],
        "bleu_lc_signature": report.get("bleu_lc_signature", ""),
        "chrf": report["chrf"],
        "chrf_signature": report["chrf_signature"],
        # the summary holds what checkpoint_last holds (the elapsed time is saved with it)
        "params": summary.parameters,
        "train_minutes": summary.elapsed_seconds / 60.0,
        "decode_sents_per_s": float(report["sentences_per_second"]),
        "device": device_name(str(report.get("device", "cpu"))),
        "test_set": f"{config.data.test_splits[0]} ({report.get('sentences', '?')} sentences)",
        "decode": f"beam {config.decode.beam_size}, length penalty {alpha:g}, average of the last {len(used)} checkpoints (both chosen "
                  f"on {valid})",
        "more_tests": more_tests,
        **common,
    }


def trained_on(prepared: Path) -> str:
    """The data a run read (:func:`~mtcli.results.data_fingerprint`), from its prepared cache."""
    return data_fingerprint(PreparedCorpus.open(prepared, verify=False).manifest.get("inputs") or {})


def reads(config: Config) -> str:
    """The data ``config`` would read (:func:`trained_on` of the cache ``prepare`` would make),
    from its input files' hashes, without preparing it."""
    return data_fingerprint(plan_corpora(config.data).fingerprint(FileHasher()))


def _limit_words(limit: float) -> str:
    """How a results row made before the length-penalty limit was dropped names it (nothing
    when it was off)."""
    return f", length counted up to {limit:g} x the source's in the penalty" if limit else ""


def combine_seeds(rows: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A direction's row from its seeds' rows (seed -> row as :func:`run_recipe` returns it):
    the mean of every score and speed under the same keys, the sample standard deviation of each
    score as ``<score>_std`` (None for one seed), the training steps (one number when every seed
    made the same), and each seed's row under ``seeds``."""
    ordered = [rows[s] for s in sorted(rows)]
    first = ordered[0]
    if len(ordered) == 1:  # one seed: its row as it is, plus the seed layout
        return {**first, **{f"{key}_std": None for key in SCORES}, "seeds": {str(first["seed"]): first}}
    out: dict[str, Any] = {k: first[k] for k in ("bleu_signature", "bleu_lc_signature", "chrf_signature",
                                                   "params", "test_set") if k in first}
    for key in _MEANS:
        out[key] = statistics.fmean(r[key] for r in ordered)
    for key in SCORES:
        out[f"{key}_std"] = statistics.stdev(r[key] for r in ordered) if len(ordered) > 1 else None
    steps = sorted({r["train_steps"] for r in ordered})
    out["train_steps"] = steps[0] if len(steps) == 1 else [r["train_steps"] for r in ordered]
    out["device"] = " / ".join(dict.fromkeys(r["device"] for r in ordered))
    out["commit"] = " / ".join(dict.fromkeys(r["commit"] for r in ordered))
    windows = "/".join(str(r["average_last"]) for r in ordered)
    alphas = "/".join(f"{r['length_penalty']:g}" for r in ordered)
    beam = first["decode"].split(",")[0] + _limit_words(first.get("length_penalty_limit", 0.0))
    out["decode"] = (f"{beam}; for seed {'/'.join(map(str, sorted(rows)))}: the average of the last "
                     f"{windows} checkpoints and length penalty {alphas} (chosen on val)")
    splits = (first.get("more_tests") or {}).keys()
    out["more_tests"] = {split: {key: statistics.fmean(r["more_tests"][split][key] for r in ordered)
                                 for key in (*SCORES, "decode_sents_per_s")} for split in splits}
    for split in splits:
        out["more_tests"][split]["sentences"] = first["more_tests"][split]["sentences"]
    out["seeds"] = {str(s): rows[s] for s in sorted(rows)}
    return out


def run_seeds(config: Config, seeds: list[int] | None, valid_only: bool = False) -> dict[str, Any]:
    """:func:`run_recipe` once per seed (each in its own run directory) and their combined row;
    without ``seeds`` one run of the recipe as it is (its seed, its run directory)."""
    if seeds is None:
        row = run_recipe(config, valid_only)
        return row if valid_only else combine_seeds({row["seed"]: row})
    rows = {seed: run_recipe(seed_config(config, seed), valid_only) for seed in seeds}
    if valid_only:
        return {"seeds": {str(s): r for s, r in rows.items()},
                "valid_bleu_mean": statistics.fmean(r["valid_bleu"] for r in rows.values())}
    return combine_seeds(rows)


def with_earlier_seeds(earlier: dict[str, Any] | None, row: dict[str, Any]) -> dict[str, Any]:
    """``row`` (:func:`combine_seeds`) with the seeds of ``earlier``, the row it replaces, that
    were not run again and were trained by the same recipe (``recipe``): ``SEEDS=1`` run again
    keeps seeds 2 and 3. Seeds of another recipe, or of a row that does not say, are dropped."""
    seeds = row.get("seeds") or {}
    recipes, data = {r.get("recipe") for r in seeds.values()}, {r.get("data") for r in seeds.values()}
    others = {s: r for s, r in ((earlier or {}).get("seeds") or {}).items() if s not in seeds}
    kept = seeds_of_recipe(others, next(iter(recipes)) if len(recipes) == 1 else None)
    kept = seeds_of_data(kept, next(iter(data)) if len(data) == 1 else None)
    if not kept:
        return row
    get_logger().info("seed(s) %s of the same recipe kept from the earlier row", ", ".join(kept))
    return combine_seeds({int(s): r for s, r in {**kept, **seeds}.items()})


def merge_seed_results(paths: list[Path], row_key: str, table_name: str) -> dict[str, Any]:
    """One direction's row from results files written by separate runs of the same recipe (for
    example one seed per machine, each with ``--results DIR``): every seed row of ``row_key`` in
    ``paths`` (``DIR`` or ``DIR/<table>.json``), combined as :func:`combine_seeds` does."""
    rows: dict[int, dict[str, Any]] = {}
    for path in paths:
        file = path / f"{table_name}.json" if path.is_dir() else path
        try:
            table = json.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{file}: results file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: not a results file ({exc})") from None
        row = table.get(row_key) if isinstance(table, dict) else None
        if not isinstance(row, dict):
            raise ConfigError(f"{file}: no {row_key!r} row")
        if not row.get("seeds") and "seed" not in row:
            raise ConfigError(f"{file}: its {row_key!r} row names no seed (a table from an older mtcli): "
                              "train that seed again with --results DIR, and merge DIR")
        found = checked_seeds(row.get("seeds") or {str(row["seed"]): row}, SEED_NUMBERS, f"{file} ({row_key!r})")
        for seed, seed_row in found.items():
            if int(seed) in rows:
                raise ConfigError(f"{file}: seed {seed} of {row_key!r} is in two of the merged files")
            rows[int(seed)] = named_commit(seed_row, f"{file} seed {seed}")
    check_one_recipe(rows, f"--merge {row_key}")
    return combine_seeds(rows)


def _scores(report: dict[str, Any]) -> dict[str, Any]:
    return {key: report[key] for key in (*SCORES, *(f"{score}_signature" for score in SCORES), "sentences")}


def run_adaptation(config: Config) -> dict[str, Any]:
    """The adapted row of a recipe with ``train.init_from``: the parent scored as it is, the child
    trained and scored as any recipe (:func:`run_recipe`: averaging window and length penalty
    chosen on the child's validation split), and the parent's own test set before and after.

    The parent is decoded with the weights the child starts from (the average of its last
    ``train.init_average`` step checkpoints) and its run's decode settings, on the child's first
    test split and on its own first test split; the adapted model is decoded on the parent's
    test split with the parent's length penalty, so that "before" and "after" differ only in
    the weights."""
    parent, k = Path(config.train.init_from or ""), config.train.init_average
    try:
        last = parent_checkpoints(str(parent), k)[-1]
    except ConfigError as exc:
        hint = (f"give train.init_average at most its {len(step_checkpoints(parent))}, or train the parent longer"
                if step_checkpoints(parent) else "train the parent first: make reproduce-en-de SEEDS=1")
        raise ConfigError(f"{exc} ({hint})") from None
    check_run_recipe(config)  # (before prepare: said at once)
    prepare(config)
    corpus = PreparedCorpus.open(config.data.prepared_path(), verify=False)
    test, (src, tgt) = config.data.test_splits[0], (config.data.src_lang, config.data.tgt_lang)
    test = corpus.eval_split(test, src, tgt)
    news = {"src_file": corpus.text_path(test, src), "ref_file": corpus.text_path(test, tgt)}
    parent_config = load_config(parent / CONFIG_NAME, lenient=True)
    own_test = parent_config.data.test_splits[0]
    row = run_recipe(config)  # first: the child's run directory is made by its training
    child = config.run_path()
    out = child / "eval" / "parent"
    before_news = evaluate(parent, average_last=k, output_dir=out, **news)
    before_own = evaluate(parent, split=own_test, average_last=k, output_dir=out)
    after_own = evaluate(child, checkpoint=str(child / "checkpoints" / f"checkpoint_avg_last{row['average_last']}.pt"),
                         src_file=parent / TEXT_DIR / f"{own_test}.{src}",
                         ref_file=parent / TEXT_DIR / f"{own_test}.{tgt}",
                         length_penalty=parent_config.decode.length_penalty)
    row["parent"] = {
        "run_dir": str(parent), "average_last": k, "step": load_checkpoint(last).get("step"),
        "test": test, "scores": _scores(before_news), "own_test": own_test, "own_scores": _scores(before_own),
        "decode": f"beam {parent_config.decode.beam_size}, length penalty "
                  f"{parent_config.decode.length_penalty:g}, average of its last {k} checkpoints",
    }
    row["own_scores_after"] = _scores(after_own)
    return row


def _adaptation_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The (a) parent / (b) from scratch / (c) adapted comparison, when the adapted row exists."""
    adapted = results.get(ADAPTED_ROW) or {}
    parent = adapted.get("parent")
    if not parent:
        return []
    test, own = parent["test"], parent["own_test"]

    def row(label: str, steps: Any, scores: dict[str, Any], own_scores: dict[str, Any] | None) -> str:
        mine = f"{own_scores['bleu_lc']:.2f}" if own_scores else "–"
        return (f"| {label} | {steps:,} | {scores['bleu_lc']:.2f} | {scores['bleu']:.2f} | "
                f"{scores['chrf']:.2f} | {mine} |")

    lines = ["", f"Adaptation: the Multi30k en-de model ({parent['run_dir']}) before and after "
             f"training on news, on {test} and on its own {own}:", "",
             f"| model | steps | {test} BLEU (lc) | BLEU | chrF | {own} BLEU (lc) |",
             "|---|---|---|---|---|---|",
             row("(a) parent, as it is", parent["step"], parent["scores"], parent["own_scores"])]
    if "en-de" in results:
        lines.append(row("(b) from scratch on news", results["en-de"]["train_steps"], results["en-de"], None))
    lines.append(row("(c) parent adapted to news", adapted["train_steps"], adapted, adapted["own_scores_after"]))
    lines.append(f"\n(a): {parent['decode']}; {own} of (c) with the parent's length penalty.")
    lines += ["", _adaptation_signatures([parent["scores"], parent["own_scores"], adapted["own_scores_after"]])]
    return lines


def _adaptation_signatures(scores: list[dict[str, Any]]) -> str:
    """The line that gives the sacreBLEU signatures of the adaptation table's own scores, or says
    they were not kept (the rows of an older mtcli)."""
    names = {"bleu": "BLEU", "chrf": "chrF", "bleu_lc": "lowercased BLEU"}  # (the order of the notes above)
    signed = {"; ".join(f"{name} `{one[f'{score}_signature']}`" for score, name in names.items())
              for one in scores if all(f"{score}_signature" in one for score in SCORES)}
    if not signed:
        return "Signatures of (a) and of the parent's test set: not kept with these scores (a table from an older mtcli)."
    return f"Signatures of (a) and of the parent's test set: {' / '.join(sorted(signed))}."


def pair_overrides(direction: str) -> list[str]:
    """The ``--set`` items that make the en-de recipe the recipe of ``direction`` in :data:`PAIRS`."""
    if direction not in PAIRS:
        return []
    src, tgt = PAIRS[direction]
    return [f"data.src_lang={src}", f"data.tgt_lang={tgt}", f"data.name=multi30k_{direction}",
            f"train.run_dir=data/runs/multi30k_{direction}"]


def check_row(config: Config, table_name: str, row_key: str) -> None:
    """Raise :class:`ConfigError` when ``config`` trains the direction of another row of the
    table (``de_en --config`` an en-de recipe): its scores would be filed as ``row_key``'s. A
    pair of no row is filed as ``row_key``, with a warning (a changed recipe: never the README's)."""
    trains = f"{config.data.src_lang}-{config.data.tgt_lang}"
    rows = {row for _, table, row in RECIPES.values() if table == table_name}
    if trains in rows and trains != row_key.split()[0]:
        mine = next(name for name, (_, table, row) in RECIPES.items() if table == table_name and row == trains)
        raise ConfigError(f"the config trains {trains}, whose row is not {row_key!r}: give the direction {mine}")
    if trains != row_key.split()[0]:  # a pair of no row (a toy corpus's, say): a changed recipe's table
        get_logger().warning("the config trains %s, a pair of no row: its scores are filed as the %r row of a "
                             "changed recipe's table", trains, row_key)


@dataclass(frozen=True)
class Reproduced:
    """What :func:`reproduce` gives: the direction's ``row``, and the results table as written
    (``markdown``; None for a tuning run, which writes no table)."""

    row: dict[str, Any]
    markdown: str | None


def reproduce(direction: str, *, data: str | None = None, config_path: str | Path | None = None,
              results: Path = RESULTS_DIR, readme: Path | None = README, overrides: Sequence[str] = (),
              seeds: str | None = None, merge: Sequence[Path] = (), valid_only: bool = False) -> Reproduced:
    """Run ``direction``'s recipe (:data:`RECIPES`; ``config_path`` another) from the corpus
    (``data``: a directory of ``<split>.<lang>`` files) to its row of the results table, and
    write the table (see the module docstring); each of ``seeds`` (``"1,2,3"``) its own run.
    ``merge``: train nothing, combine the seed rows of these results directories (or
    ``<table>.json`` files). ``valid_only``: a tuning run, chosen on val; no table written.
    Raises :class:`~mtcli.pipeline.Unsaved` with the row when the table cannot be written."""
    if direction not in RECIPES:
        raise ConfigError(f"{direction}: no such recipe; give one of {', '.join(RECIPES)}")
    recipe, table_name, row_key = RECIPES[direction]
    changed = False
    if merge:
        row = merge_seed_results(list(merge), row_key, table_name)
    else:
        config = load_recipe(config_path or recipe, pair_overrides(direction) + list(overrides))
        if data is not None and config.data.sources:
            raise ConfigError(f"--data {data}: {config.path} reads several corpora (data.sources): give "
                              "each its directory with --set data.sources=[...], or their pinned files in "
                              "MTCLI_DATA=DIR (DIR/<corpus>/)")
        config = with_changes(config, "data", source=data)
        check_row(config, table_name, row_key)
        changed = not is_the_recipe(config, recipe, pair_overrides(direction))
        if not valid_only:  # the table the row goes to, read now: not after hours of training
            load_results(results_home(results, changed), table_name)
            check_table_place(results_home(results, changed), table_name)
        if row_key == ADAPTED_ROW and not valid_only:
            if seeds is not None:
                raise ConfigError(f"--seeds {seeds}: {direction} adapts one parent run, with its seed; "
                                  "leave --seeds out")
            row = run_adaptation(config)
        else:
            row = run_seeds(config, parse_seeds(seeds), valid_only)
    if valid_only:
        return Reproduced(row, None)
    changed = changed or not row_is_the_recipe(row, recipe, pair_overrides(direction))
    results_dir, readme = table_place(results, readme, table_name, changed)
    try:
        table = load_results(results_dir, table_name)
    except (MtcliError, OSError) as exc:  # changed during the training: the row is kept, not lost
        raise Unsaved(row) from exc
    if not merge and "seeds" in row:
        row = with_earlier_seeds(table.get(row_key), row)
    table[row_key] = row
    write_or_keep(lambda: write_results(table, results_dir, readme, table_name), row)
    return Reproduced(row, render_markdown(table))
