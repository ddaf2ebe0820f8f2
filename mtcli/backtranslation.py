"""``make reproduce-bt``: back-translation end to end on Multi30k (Sennrich et al. 2016; sampled
back-translation, Edunov et al. 2018).

Run ``mtcli reproduce-bt [--seed 1]``. The steps, each a recipe run as
``make reproduce`` makes it (:func:`mtcli.reproduce.run_recipe`: the average and the length
penalty chosen on val, then test2016):

1. the training pairs are cut in two halves: the even-numbered pairs stay parallel data, the
   odd-numbered ones give only their German side, as monolingual text (``data/bt/``);
2. a de->en model (``configs/multi30k_de_en.yaml``) trains on the parallel half and translates the
   monolingual German twice: with beam search, and by sampling from its whole distribution;
3. en->de (``configs/multi30k_en_de.yaml``) trains four times: on the parallel half alone; on it
   plus the beam back-translations; on it plus the sampled ones (each back-translation's English
   side starts with the tag ``<bt>``, so the model knows which sources are synthetic); and on
   every pair real (the en-de row of ``results/multi30k.json`` with this seed when there is one,
   else trained here);
4. ``results/bt.{json,md}``: test2016 lowercased BLEU of the four, and how much of the real
   pairs' gain over the half each back-translation recovers (and into README.md between
   ``<!-- bt:start -->`` and ``<!-- bt:end -->``).

Stopped and started again, it goes on where it stopped: a training run resumes from its last
checkpoint, and a finished run's scores (``<run>.row.json`` beside its run directory) and each
back-translation (``made_by.json`` beside it) are kept while the config, the model and the
settings are the same; a run whose input corpora changed since stops it with one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtcli.checkpoint import sha256_of_loaded
from mtcli.config import Config, CorpusConfig, DataConfig, with_changes
from mtcli.data.corpora import split_names
from mtcli.data.sources import open_source
from mtcli.data.textio import read_lines
from mtcli.errors import ConfigError, DataError
from mtcli.fileio import atomic_write, sha256_file
from mtcli.infer.averaging import average_run_checkpoints
from mtcli.infer.translator import Translator
from mtcli.logs import get_logger
from mtcli.pipeline import (
    check_run_recipe,
    check_table_place,
    is_the_recipe,
    load_recipe,
    seed_config,
    write_or_keep,
)
from mtcli.reproduce import reads, run_recipe
from mtcli.results import (
    README,
    RESULTS_DIR,
    load_results,
    recipe_fingerprint,
    table_place,
    write_table,
)

FORWARD, REVERSE = "configs/multi30k_en_de.yaml", "configs/multi30k_de_en.yaml"
TABLE = "bt"
TAG = "<bt>"
ROWS = ("half", "half + BT (beam)", "half + BT (sampling)", "all pairs real")


def split_halves(data: DataConfig, out: Path) -> tuple[Path, Path]:
    """Write ``out/parallel`` (the even-numbered training pairs, and the validation and test
    splits whole) and ``out/mono`` (the German side, ``data.tgt_lang``, of the odd-numbered
    ones, as ``train.<tgt>``); return both directories."""
    parallel, mono = out / "parallel", out / "mono"
    source = open_source(data.source, data.src_lang, data.tgt_lang, data.hub_config)
    source.check(split_names(data))
    for split in split_names(data):
        pairs = list(source.pairs(split))
        kept = pairs[0::2] if split == data.train_split else pairs
        for side, lang in enumerate((data.src_lang, data.tgt_lang)):
            with atomic_write(parallel / f"{split}.{lang}") as handle:
                handle.writelines(pair[side] + "\n" for pair in kept)
        if split == data.train_split:
            with atomic_write(mono / f"{split}.{data.tgt_lang}") as handle:
                handle.writelines(tgt + "\n" for _, tgt in pairs[1::2])
    return parallel, mono


def back_translate(run_dir: Path, checkpoint: Path, mono: Path, out: Path, data: DataConfig,
                   length_penalty: float, **settings: Any) -> Path:
    """Translate the monolingual text ``mono/train.<tgt>`` back into ``data.src_lang`` with the
    reverse model, and write the synthetic pairs as ``out/train.{src,tgt}`` (atomically).

    What was translated, and how, is kept beside them (``out/made_by.json``): a restarted run
    that finds the same checkpoint, text and settings there keeps the files."""
    text = mono / f"{data.train_split}.{data.tgt_lang}"
    made_by = {"checkpoint_sha256": sha256_file(checkpoint), "text_sha256": sha256_file(text),
               "length_penalty": length_penalty, "settings": settings}
    outputs = [out / f"{data.train_split}.{lang}" for lang in (data.src_lang, data.tgt_lang)]
    record = out / "made_by.json"
    if all(path.is_file() for path in (*outputs, record)) and \
            json.loads(record.read_text(encoding="utf-8")) == made_by:
        get_logger().info("%s: back-translated earlier with the same model and settings, kept", out)
        return out
    translator = Translator.from_run(run_dir, checkpoint, length_penalty=length_penalty, **settings)
    made_by["checkpoint_sha256"] = sha256_of_loaded(checkpoint, translator.bundle.payload_sha256)  # as translated
    targets = list(read_lines(text))  # at newlines only, as the corpus reader splits (not at U+2028 or NEL)
    sources = translator.translate(targets)
    for path, lines in zip(outputs, (sources, targets), strict=True):
        with atomic_write(path) as handle:
            handle.writelines(line + "\n" for line in lines)
    with atomic_write(record) as handle:
        handle.write(json.dumps(made_by, indent=2) + "\n")
    get_logger().info("back-translated %d sentences into %s (%s)", len(targets), out, settings or "beam")
    return out


def _inputs(config: Config) -> list[str | None]:
    """A sha256 over the files of each corpus of ``config`` that is a local directory (the halves
    and back-translations this pipeline writes), None for one that is not (a named corpus)."""
    found: list[str | None] = []
    for source in [config.data.source] + [c.source for c in config.data.sources]:
        path = Path(source) if source else None
        if path is not None and path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file())
            found.append(hashlib.sha256("".join(f"{p.name}:{sha256_file(p)};" for p in files).encode()).hexdigest())
        elif source:
            found.append(None)
    return found


def _changed(saved: Any, now: list[str | None]) -> bool:
    """Whether a corpus hashed then and now differs (a corpus not hashed either time is not)."""
    if not isinstance(saved, list) or len(saved) != len(now):
        return False
    return any(a is not None and b is not None and a != b for a, b in zip(saved, now, strict=True))


def recipe_row(config: Config) -> dict[str, Any]:
    """:func:`~mtcli.reproduce.run_recipe`'s row for ``config``, kept beside its run directory
    (``<run>.row.json``, with the config and a checksum of its input corpora, written before it
    trains too), so that a restarted ``make reproduce-bt`` does not train, average and score a
    finished run again. A config changed but for its decoding scores it again; one that trains
    otherwise, or changed inputs (the data, or a reverse model that back-translates
    differently), stop it with one line, its record kept: its run is of another recipe or other
    data, and only the user removes it."""
    run_dir = config.run_path()
    record = run_dir.with_name(f"{run_dir.name}.row.json")
    earlier = record if record.is_file() else run_dir / "row.json"  # where an older mtcli kept it
    wanted = json.loads(json.dumps(config.to_dict()))  # as it reads back from JSON
    inputs = _inputs(config)
    if earlier.is_file():
        saved = json.loads(earlier.read_text(encoding="utf-8"))
        changed = _changed(saved.get("inputs"), inputs)
        if changed and run_dir.exists():
            raise DataError(f"{run_dir}: trained on other data than its corpora hold now (they were written "
                            "again, or back-translated by another model); remove it to train it afresh")
        if not changed and saved.get("config") == wanted and saved.get("row") is not None:
            get_logger().info("%s: finished earlier, its scores kept (%s)", run_dir, earlier)
            return saved["row"]
    check_run_recipe(config)  # (before its record is replaced)
    with atomic_write(record) as handle:  # the inputs it trains on, before it trains
        handle.write(json.dumps({"config": wanted, "inputs": inputs, "row": None}, indent=2) + "\n")
    row = run_recipe(config)
    with atomic_write(record) as handle:
        handle.write(json.dumps({"config": wanted, "inputs": inputs, "row": row}, indent=2) + "\n")
    return row


def _variant(config: Config, name: str, sources: list[CorpusConfig], run_dir: Path) -> Config:
    """``config`` on other corpora, with its own cache and run directory."""
    data = dataclasses.replace(config.data, name=f"{config.data.name}_{name}", source="", sources=sources,
                               prepared_dir=str(run_dir.parent / "prepared" / name))
    if len(sources) == 1 and sources[0].tag is None:
        data = dataclasses.replace(data, source=sources[0].source, sources=[])
    changed = dataclasses.replace(config, data=data, overrides=None)  # no command line of its file says it
    return with_changes(changed, "train", run_dir=str(run_dir / name))


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    keep = ("bleu", "bleu_lc", "chrf", "bleu_signature", "bleu_lc_signature", "chrf_signature", "train_steps",
            "average_last", "length_penalty", "seed", "commit", "device", "train_minutes")
    return {key: row.get(key) for key in keep}


def run_bt(forward: Config, reverse: Config, work: Path, real: dict[str, Any] | None = None) -> dict[str, Any]:
    """The four en->de rows of the table (see the module docstring); ``real``: an existing row
    for every pair real, trained here when None."""
    parallel, mono = split_halves(forward.data, work / "data")
    runs = work / "runs"
    half_reverse = _variant(reverse, "reverse_half", [CorpusConfig(source=str(parallel))], runs)
    reverse_row = recipe_row(half_reverse)
    reverse_run = Path(half_reverse.run_path())
    averaged = reverse_run / "checkpoints" / f"checkpoint_avg_last{reverse_row['average_last']}.pt"
    if not averaged.is_file():  # removed since the run: its checkpoints make the same file again
        average_run_checkpoints(reverse_run, averaged, last=int(reverse_row["average_last"]))
    alpha = float(reverse_row["length_penalty"])
    beam = back_translate(reverse_run, averaged, mono, work / "data" / "bt_beam", forward.data, alpha)
    sampled = back_translate(reverse_run, averaged, mono, work / "data" / "bt_sampling", forward.data, alpha,
                             sampling="topp", topp=1.0, seed=forward.train.seed)
    rows = {
        ROWS[0]: recipe_row(_variant(forward, "half", [CorpusConfig(source=str(parallel))], runs)),
        ROWS[1]: recipe_row(_variant(forward, "bt_beam", [CorpusConfig(source=str(parallel)),
                                                          CorpusConfig(source=str(beam), tag=TAG)], runs)),
        ROWS[2]: recipe_row(_variant(forward, "bt_sampling", [CorpusConfig(source=str(parallel)),
                                                              CorpusConfig(source=str(sampled), tag=TAG)], runs)),
        ROWS[3]: real if real is not None else recipe_row(with_changes(forward, "train", run_dir=str(runs / "real"))),
    }
    table = {name: _summary(row) for name, row in rows.items()}
    half, full = table[ROWS[0]]["bleu_lc"], table[ROWS[3]]["bleu_lc"]
    for name in ROWS[1:3]:
        gain = full - half
        table[name]["recovered"] = (table[name]["bleu_lc"] - half) / gain if gain > 0 else None
    table["reverse (de-en, half)"] = _summary(reverse_row)
    return table


def render(table: dict[str, Any]) -> str:
    """The markdown table of :func:`run_bt`'s rows."""
    lines = ["| en->de training data | test2016 BLEU (lc, 13a) | BLEU | chrF | share of the real pairs' gain "
             "| train min | device | commit |",
             "|---|---|---|---|---|---|---|---|"]
    for name in (*ROWS, "reverse (de-en, half)"):
        row = table[name]
        share = row.get("recovered")
        cell = "–" if share is None else f"{100 * share:.0f}%"
        minutes = row.get("train_minutes")
        lines.append(f"| {name} | {row['bleu_lc']:.2f} | {row['bleu']:.2f} | {row['chrf']:.2f} | {cell} "
                     f"| {'–' if minutes is None else f'{minutes:.0f}'} | {row.get('device')} | {row.get('commit')} |")
    first = table[ROWS[0]]
    lines += ["", f"- seed {first['seed']}; each row's checkpoint average and length penalty chosen on val",
              f"- lowercased BLEU `{first['bleu_lc_signature']}`"]
    for key, metric in (("bleu_signature", "BLEU"), ("chrf_signature", "chrF")):
        signatures = {table[name].get(key) for name in ROWS}
        lines.append(f"- {metric} `{signatures.pop()}`" if len(signatures) == 1 and None not in signatures else
                     f"- {metric}: its signature was not kept with these rows (a table from an older mtcli)")
    return "\n".join(lines) + "\n"


def reproduce_bt(*, forward: str | Path = FORWARD, reverse: str | Path = REVERSE, seed: int = 1,
                 work: Path = Path("data/bt"), results: Path = RESULTS_DIR, readme: Path | None = README,
                 overrides: Sequence[str] = ()) -> str:
    """Back-translation end to end (the module docstring) with the ``forward`` (en->de) and
    ``reverse`` (de->en, back-translating) recipes, ``overrides`` applied to both, seed ``seed``,
    the halves and runs under ``work``; write the table and return it in markdown. Raises
    :class:`~mtcli.pipeline.Unsaved` with the table when it cannot be written."""
    forward_config = seed_config(load_recipe(forward, list(overrides)), seed)
    reverse_config = seed_config(load_recipe(reverse, list(overrides)), seed)
    ahead, back = ((c.data.src_lang, c.data.tgt_lang) for c in (forward_config, reverse_config))
    if back != ahead[::-1]:  # its translations of the target half would be read as the source language's
        raise ConfigError(f"--reverse {reverse}: translates {'->'.join(back)}; it must translate {'->'.join(ahead[::-1])} "
                          f"(the --forward recipe's target into its source)")
    real = (load_results(results, "multi30k").get("en-de") or {}).get("seeds", {}).get(str(seed))
    if real is not None and real.get("recipe") not in (None, recipe_fingerprint(forward_config)):
        # (a row from before the fingerprint, which does not say, is the recipe's, as a merge takes it)
        get_logger().info("the en-de row of %s was trained by another recipe: every pair real is trained here",
                          results / "multi30k.json")
        real = None
    if real is not None and real.get("data") not in (None, reads(forward_config)):
        get_logger().info("the en-de row of %s was trained on other data: every pair real is trained here",
                          results / "multi30k.json")
        real = None
    changed = not (is_the_recipe(forward_config, FORWARD) and is_the_recipe(reverse_config, REVERSE))
    home, readme = table_place(results, readme, TABLE, changed)
    check_table_place(home, TABLE)
    table = run_bt(forward_config, reverse_config, work / f"seed{seed}", real)
    markdown = render(table)
    write_or_keep(lambda: write_table(table, markdown, home, TABLE, readme), table)
    return markdown
