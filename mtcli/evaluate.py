"""``mtcli evaluate``: decode a test set, score it (:mod:`mtcli.metrics`), write a report.

The hypotheses and a JSON report (scores with their sacreBLEU signatures, the checkpoint, the
decode settings, speed and peak memory) go to ``<run_dir>/eval/`` by default, both atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtcli.config import Config, DecodeConfig, check_language_code
from mtcli.data.cache import PreparedCorpus, array_name, eval_split_name
from mtcli.data.coverage import round_trip_step, warn_of_unwritable
from mtcli.data.overlap import overlap_of
from mtcli.data.textio import lines_sha256, read_lines, read_lines_hashed
from mtcli.device import peak_memory_mb
from mtcli.errors import ConfigError, DataError, signals_held
from mtcli.fileio import (
    atomic_write,
    check_writable_directory,
    names_an_open_file,
    sha256_file,
)
from mtcli.infer.files import warn_of_unused_sampling
from mtcli.infer.loading import InferenceModel, check_run_dir, run_directions
from mtcli.infer.translate import override_keys
from mtcli.infer.translator import Translator
from mtcli.logs import get_logger, progress
from mtcli.metrics import BOM_NOTE, metric_names, phrase_bleu_note, score, scorer
from mtcli.rundir import MANIFEST_NAME, TEXT_DIR, checkpoint_dir

try:
    import fcntl
except ImportError:  # not on Windows: evaluations into one directory are not kept apart there
    fcntl = None  # type: ignore[assignment]


def _safe_name(name: str) -> str:
    """A file-name-safe form of a checkpoint or split name (``checkpoint_best.pt`` -> ``best``)."""
    stem = Path(name).name
    stem = re.sub(r"\.pt$", "", stem)
    stem = re.sub(r"^checkpoint_", "", stem)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem) or "model"


class NoTestText(DataError):
    """A split with no text in a direction (a corpus without test sets, such as back-translations)."""


def _split_files(run_dir: Path, config: Config, split: str, direction: tuple[str, str]) -> tuple[Path, Path]:
    """Source and reference text of ``split`` in ``direction``: ``run_dir/text/`` first, then the
    prepared cache."""
    src_lang, tgt_lang = direction
    text_dir = run_dir / TEXT_DIR
    name = eval_split_name(split, src_lang, tgt_lang, lambda name, lang: (text_dir / f"{name}.{lang}").is_file())
    src, ref = text_dir / f"{name}.{src_lang}", text_dir / f"{name}.{tgt_lang}"
    if src.is_file() and ref.is_file():
        records = _file_records(run_dir)
        _check_as_prepared(run_dir, records, [(name, src_lang, src), (name, tgt_lang, ref)])
        _warn_of_newer_text(records, config.data.prepared_path(), name, (src_lang, tgt_lang), (src, ref))
        return src, ref
    prepared = config.data.prepared_path()
    try:
        corpus = PreparedCorpus.open(prepared, verify=False)
    except (DataError, OSError):
        corpus = None
    name = corpus.eval_split(split, src_lang, tgt_lang) if corpus is not None else split
    if corpus is not None and name in corpus.splits and {src_lang, tgt_lang} <= set(corpus.split_langs[name]):
        src, ref = corpus.text_path(name, src_lang), corpus.text_path(name, tgt_lang)
        if src.is_file() and ref.is_file():
            return src, ref
    raise NoTestText(
        f"split '{split}': no text at {text_dir}/{split}.{src_lang}|{tgt_lang} nor in the "
        f"prepared cache {prepared} (the config's test splits: {', '.join(config.data.test_splits) or 'none'}); "
        "give the files instead: --src FILE --ref FILE"
    )


def _file_records(directory: Path) -> dict[str, Any]:
    """The ``files`` of a cache's (or a run's copy of its) ``manifest.json``: name -> size and
    sha256; empty where there is none to read (an import, no cache)."""
    try:
        files = json.loads((directory / MANIFEST_NAME).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return files if isinstance(files, dict) else {}


def _check_as_prepared(run_dir: Path, records: dict[str, Any], texts: list[tuple[str, str, Path]]) -> None:
    """Refuse a run's copy of a split's text (split, language, path) that is not the text its
    ``manifest.json`` records (``records``: its files): edited, or cut short within a line, it
    would be scored as if it were, with no line count to tell."""
    for split, lang, path in texts:
        record = records.get(f"{array_name(split, lang)}.txt")
        if isinstance(record, dict) and record.get("sha256") and sha256_file(path) != record["sha256"]:
            raise DataError(f"{path}: not the text the run was prepared with (its sha256 is not the one "
                            f"{run_dir / MANIFEST_NAME} records); restore it, or give the files as --src and --ref")


def _warn_of_newer_text(ours: dict[str, Any], prepared: Path, split: str, langs: tuple[str, str],
                        copies: tuple[Path, Path]) -> None:
    """Warn when the prepared cache holds another text of ``split`` than the run's copy (whose
    manifest's files are ``ours``: a reference mended and prepared again since the run began):
    the run's copy is what is scored, and the warning gives the ``--src``/``--ref`` that score
    the cache's."""
    theirs = _file_records(prepared)
    changed = []
    for lang in langs:
        name = f"{array_name(split, lang)}.txt"
        mine, now = ours.get(name), theirs.get(name)
        if isinstance(mine, dict) and isinstance(now, dict) and None not in (mine.get("sha256"), now.get("sha256")) \
                and mine["sha256"] != now["sha256"]:
            changed.append(name)
    if changed:
        new = [prepared / f"{array_name(split, lang)}.txt" for lang in langs]
        get_logger().warning("%s: %s prepared again since this run began, with other text (%s); scoring the run's "
                             "copy, %s and %s (to score the new text: --src %s --ref %s)", prepared, split,
                             ", ".join(changed), copies[0], copies[1], new[0], new[1])


def _check_test_args(split: str | None, src_file: str | Path | None, ref_file: str | Path | None,
                     more_refs: Sequence[str | Path] = ()) -> None:
    """A split, or a source and a reference file, or neither (the first test split)."""
    if (src_file is None) != (ref_file is None):
        raise ConfigError("--src and --ref must be given together")
    if src_file is not None and split is not None:
        raise ConfigError("give either --split or --src/--ref, not both")
    if any(str(path) == "-" for path in (src_file, ref_file, *more_refs) if path is not None):
        raise ConfigError("-: evaluate reads a source and its references as files; give standard input as /dev/stdin")


def _test_files(run_dir: Path, config: Config, split: str | None, src_file: str | Path | None,
                ref_file: str | Path | None, direction: tuple[str, str]) -> tuple[Path, Path, str, str | None]:
    """``(source, reference, name, split)`` of what to score: the given files, or a split's text
    in ``direction`` (default: the first of ``data.test_splits``; a direction other than the
    run's ``data.src_lang -> data.tgt_lang`` is added to the name, ``test.de-fr``)."""
    other = _direction_suffix(config, direction)
    if src_file is not None and ref_file is not None:
        return Path(src_file), Path(ref_file), _safe_name(Path(src_file).name + other), None
    split = split or (config.data.test_splits[0] if config.data.test_splits else None)
    if not split:
        raise ConfigError(f"{run_dir}: data.test_splits is empty; pass --split or --src/--ref")
    src_path, ref_path = _split_files(run_dir, config, split, direction)
    return src_path, ref_path, _safe_name(split + other), split


def _direction_suffix(config: Config, direction: tuple[str, str]) -> str:
    """What an output's name adds for a direction other than the run's (``.de-fr``)."""
    return "" if direction == (config.data.src_lang, config.data.tgt_lang) else f".{'-'.join(direction)}"


def _read_test(src_path: Path, ref_paths: list[Path]) -> tuple[list[str], list[str], list[list[str]], str]:
    """The source lines, the first reference's and the further references' (each as many lines
    as the source: else a :class:`DataError` naming the file), and the first reference's sha256
    (of the bytes read: a stream such as ``<(zcat ref.gz)`` is read once)."""
    sources = list(read_lines(src_path))
    if not sources:
        raise NoTestText(f"{src_path}: empty; there is nothing to translate and score")
    if not any(line.strip() for line in sources):
        raise NoTestText(f"{src_path}: blank lines only; there is nothing to translate and score")
    first, digest = read_lines_hashed(ref_paths[0], BOM_NOTE)
    streams = [first, *(list(read_lines(path, BOM_NOTE)) for path in ref_paths[1:])]
    for path, stream in zip(ref_paths, streams, strict=True):
        if len(sources) != len(stream):
            raise DataError(f"{src_path} has {len(sources)} lines but {path} has {len(stream)}: "
                            "source and reference line counts must match")
    return sources, streams[0], streams[1:], digest


def _checkpoint_name(bundle: InferenceModel, average_last: int, average_best: int, members: int,
                     run_dir: Path, checkpoint: str) -> str:
    """The checkpoint's part of the output file names (``best``, ``avg_last3``, ``...ensemble2``;
    ``otherrun.100`` for a checkpoint file outside the run's ``checkpoints/``, whose outputs
    would replace those of the run's own checkpoint of that name)."""
    if average_last > 0:
        name = f"avg_last{average_last}"
    elif average_best > 0:
        name = f"avg_best{average_best}"
    else:
        name = _safe_name(str(bundle.name).split(" (")[0])
        folder = Path(checkpoint).resolve().parent
        if Path(checkpoint).is_file() and folder != checkpoint_dir(run_dir).resolve():
            name = f"{_safe_name(folder.parent.name if folder.name == 'checkpoints' else folder.name)}.{name}"
    return name + (f".ensemble{members}" if members > 1 else "")


@contextlib.contextmanager
def _directory_locked(directory: Path) -> Iterator[None]:
    """An ``flock`` on ``directory`` while a block runs: another evaluation writing its outputs
    there waits for it. Nothing is locked where the directory cannot be (NFS, Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        if fcntl is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_outputs(hyp_path: Path, report_path: Path, hypotheses: list[str], report: dict[str, Any]) -> None:
    """The hypotheses are written and synced before the report is written and renamed, and
    renamed right after it: a failed write (disk full, file-size limit) leaves the previous
    hypotheses and report, never a new one beside an old one. A stop (Ctrl-C, SIGTERM, a
    hang-up) that comes while they are written is acted on once both are in place. Two
    evaluations of one name into one directory (a run's best, decoded on either side of a new
    best) write their pairs one after the other, never one's hypotheses beside the other's
    report."""
    report_text = json.dumps(report, indent=2, ensure_ascii=False) + "\n"
    with _directory_locked(hyp_path.parent), signals_held(), atomic_write(hyp_path) as hyp_handle:
        for text in hypotheses:
            hyp_handle.write(text + "\n")
        hyp_handle.flush()
        os.fsync(hyp_handle.fileno())  # (what is left to do after the report's rename is a rename)
        with atomic_write(report_path) as report_handle:
            report_handle.write(report_text)


def _decode(translator: Translator, decode: DecodeConfig, sources: list[str], name: str, where: str
            ) -> tuple[list[str], int]:
    """The best translation of every source line (with a progress bar), and their token count."""
    hypotheses: list[str] = []
    target_tokens = 0
    bar = progress(total=len(sources), unit="sent", desc=f"evaluate {name}")
    try:
        for nbest in translator.stream(sources, decode=decode, name=where, on_done=bar.update):
            hypotheses.append(nbest[0].text)
            target_tokens += len(nbest[0].tokens)
    finally:
        bar.close()
    return hypotheses, target_tokens


@dataclass
class _Test:
    """What one evaluation reads and how its outputs are named."""

    split: str | None
    src_file: str | Path | None
    ref_files: list[Path]
    metrics: Sequence[str]
    output_dir: str | Path | None
    ckpt: str
    model: dict[str, Any]  # how the weights were made: averages, ensemble members (for the report)


@dataclass
class _Input:
    """One direction's test text, read and checked before any decoding."""

    direction: tuple[str, str]
    src_path: Path
    ref_paths: list[Path]
    name: str
    split: str | None
    sources: list[str]
    references: list[str]
    more_references: list[list[str]]
    reference_sha256: str  # what mtcli compare matches a run's hypotheses by


def _read_input(run_dir: Path, config: Config, test: _Test, direction: tuple[str, str], instead: str = "") -> _Input:
    """The test text of ``direction``: its files found and read, their line counts checked, and
    BLEU's tokeniser for its target loaded (a missing package is said now, not after a decoding;
    its message offers ``instead``, and chrF alone)."""
    src_path, ref_path, name, split = _test_files(run_dir, config, test.split, test.src_file,
                                                  test.ref_files[0] if test.ref_files else None, direction)
    ref_paths = [ref_path, *test.ref_files[1:]]
    sources, references, more_references, digest = _read_test(src_path, ref_paths)
    if split is None and names_an_open_file(src_path):
        # <(zcat a.gz), a pipe: named by its text, not by a descriptor's number every such call shares
        name = f"stream-{lines_sha256(sources)[:12]}{_direction_suffix(config, direction)}"
    if "bleu" in test.metrics:
        ways = [*([instead] if instead else []), "or --metrics chrf: chrF needs no tokeniser"]
        scorer("bleu", direction[1], instead=f" ({'; '.join(ways)})")
    return _Input(direction, src_path, ref_paths, name, split, sources, references, more_references, digest)


def _output_paths(run_dir: Path, test: _Test, name: str) -> tuple[Path, Path]:
    """Where one direction's hypotheses and report go: ``<output_dir>/<name>.<ckpt>.hyp`` and
    ``.report.json`` (``output_dir`` defaults to ``run_dir/eval``)."""
    out_dir = Path(test.output_dir) if test.output_dir is not None else run_dir / "eval"
    return out_dir / f"{name}.{test.ckpt}.hyp", out_dir / f"{name}.{test.ckpt}.report.json"


def _check_output_dir(run_dir: Path, output_dir: str | Path | None) -> None:
    """Refuse an output directory that cannot be written: ``--output``'s, or ``RUN/eval`` of a
    run shared read-only, which evaluate found only after it had decoded and scored the test set."""
    out_dir = Path(output_dir) if output_dir is not None else run_dir / "eval"
    try:
        check_writable_directory(out_dir)
    except OSError as exc:
        if output_dir is not None:
            raise
        raise ConfigError(f"{out_dir}: {exc.strerror}: evaluate writes the hypotheses and the report there; "
                          "give --output DIR") from None


def _check_outputs(run_dir: Path, test: _Test, inputs: list[_Input]) -> None:
    """Refuse, before decoding, outputs that would overwrite a file read: another system's
    hypotheses given as the reference, in the same output directory under the same name."""
    reads = [path for given in inputs for path in (given.src_path, *given.ref_paths)]
    for given in inputs:  # one direction's outputs against every direction's inputs (a shared --output)
        for output in _output_paths(run_dir, test, given.name):
            for read in reads:
                try:
                    same = os.path.samefile(output, read)
                except OSError:  # not there yet
                    same = False
                if same:
                    raise ConfigError(f"{output}: evaluate would write its output over {read}, which it reads; "
                                      "give another --output directory")
        _warn_of_another_test_set(_output_paths(run_dir, test, given.name)[1], given)


def _warn_of_another_test_set(report_path: Path, given: _Input) -> None:
    """Warn, before decoding, when the report this evaluation replaces is of another test set
    (``--src`` files of one name in two directories are named alike): its scores are lost."""
    try:
        old = json.loads(report_path.read_text(encoding="utf-8"))
        was = Path(old["source"]), old["reference_lines_sha256"]
    except (OSError, ValueError, KeyError, TypeError):  # none there, or not a report of this form
        return
    try:
        same_source = os.path.samefile(was[0], given.src_path)
    except OSError:  # moved away since
        same_source = was[0] == given.src_path
    if not same_source or was[1] != lines_sha256(given.references):
        what = f"source {was[0]}" if not same_source else "another reference text"
        get_logger().warning("%s: holds the scores of %s, which this evaluation replaces (give --output DIR to keep "
                             "both)", report_path, what)


def _shared_with_training(run_dir: Path, split: str, direction: tuple[str, str]) -> dict[str, Any] | None:
    """What ``prepare`` counted of ``split``'s pairs in ``direction`` that are also pairs the run
    trained on (:func:`~mtcli.data.overlap.overlap_of`, from the run's copy of the cache's
    manifest); None when not known: files given as ``--src``/``--ref``, or a cache prepared
    before it counted them. Each training split that shares some is warned of."""
    try:
        manifest = json.loads((run_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
        record, files = manifest["shared_with_training"], manifest["files"]
        name = eval_split_name(split, *direction, lambda n, lang: f"{array_name(n, lang)}.txt" in files)
        shared = overlap_of(record, name, direction)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # no split; an older or edited manifest
        return None
    for train_name, counts in shared.items():
        get_logger().warning("%s %s: %d of its %d pairs are also pairs the model trained on (of %s, as prepare "
                             "counted them): its scores overstate how the model translates text it has not seen",
                             split, "-".join(direction), counts["shared"], counts["pairs"], train_name)
    return shared


def _evaluate_with(translator: Translator, run_dir: Path, test: _Test, given: _Input) -> dict[str, Any]:
    """Decode and score one direction's test set with a loaded translator; write its outputs."""
    bundle, device, direction = translator.bundle, translator.device, given.direction
    decode = dataclasses.replace(translator.decode, tgt_lang=direction[1])
    src_path, ref_path, name, split, sources = given.src_path, given.ref_paths[0], given.name, given.split, given.sources
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    hypotheses, target_tokens = _decode(translator, decode, sources, name, str(src_path))
    seconds = time.perf_counter() - start
    scores = score(hypotheses, given.references, more_references=given.more_references, metrics=test.metrics,
                   tgt_lang=direction[1])
    if note := phrase_bleu_note(direction[1]):
        get_logger().warning("%s %s: %s%s", split or name, "-".join(direction), note,
                             "" if "chrf" in test.metrics else " (--metrics bleu,chrf)")
    hyp_path, report_path = _output_paths(run_dir, test, name)
    report: dict[str, Any] = {
        **scores,
        "split": split,
        "direction": "-".join(direction),
        "src_lang": direction[0],
        "tgt_lang": direction[1],
        "source": str(src_path),
        "reference": str(ref_path),
        "reference_sha256": given.reference_sha256,
        "shared_with_training": _shared_with_training(run_dir, split, direction) if split is not None else None,
        "reference_lines_sha256": lines_sha256(given.references),  # its text: also a .gz or CRLF copy's
        "references": [str(path) for path in given.ref_paths],
        "checkpoint": str(bundle.name),
        "weights_sha256": bundle.weights_sha256,  # an ensemble's: of its members' (ensemble_sha256)
        "engine": "ctranslate2" if translator.engine is not None else "torch",
        "decode": dict(vars(decode)),
        "sentences": len(sources),
        "seconds": round(seconds, 3),
        "sentences_per_second": round(len(sources) / seconds, 2) if seconds > 0 else 0.0,
        "target_tokens": target_tokens,
        "target_tokens_per_second": round(target_tokens / seconds, 1) if seconds > 0 else 0.0,
        "device": str(device),
        "peak_memory_mb": round(peak_memory_mb(device), 1),
        "hypotheses": str(hyp_path),
        "report": str(report_path),
        **test.model,
    }
    _write_outputs(hyp_path, report_path, hypotheses, report)
    shown = "  ".join(f"{label} {scores[key]:.2f}" for key, label in
                      (("bleu", "BLEU"), ("chrf", "chrF"), ("ter", "TER"), ("bleu_lc", "BLEU(lc)")) if key in scores)
    get_logger().info("%s %s (%s, %d sentences): %s  [%.1f sent/s]", split or name, report["direction"], bundle.name,
                      len(sources), shown, report["sentences_per_second"])
    return report


def _one_direction(trained: list[tuple[str, str]], default: tuple[str, str], src_lang: str | None,
                   tgt_lang: str | None) -> list[tuple[str, str]]:
    """The trained direction one evaluation scores: the run's own (``default``: its source
    language, the model's default target) with the languages given put in, else the one trained
    direction that has them (``--src-lang de`` alone: de's), or, no target given, the one into
    the default target (an en<->de model whose decode.tgt_lang is en: de->en); none when no
    trained direction has them; :class:`ConfigError` when several do and neither is the default
    (a file's language cannot be guessed)."""
    fits = [d for d in trained if src_lang in (None, d[0]) and tgt_lang in (None, d[1])]
    wanted = (src_lang or default[0], tgt_lang or default[1])
    if wanted in fits or len(fits) < 2:
        return [wanted] if wanted in fits else fits
    into_default = [d for d in fits if d[1] == default[1]]
    if tgt_lang is None and len(into_default) == 1:
        return into_default
    raise ConfigError(f"{', '.join('->'.join(d) for d in fits)}: several trained directions fit; name both languages "
                      "(--src-lang, --tgt-lang)")


def _zero_shot(trained: list[tuple[str, str]], src_lang: str | None, tgt_lang: str | None) -> list[tuple[str, str]]:
    """Given files in ``src_lang`` to score into ``tgt_lang``, both languages the run knows but
    not as a trained direction (fr->de of a model of en<->de and en<->fr): that direction, with a
    warning that it is zero-shot (``translate --tgt-lang`` decodes it too); else none."""
    if src_lang is None or tgt_lang is None or src_lang not in {s for s, _ in trained} \
            or tgt_lang not in {t for _, t in trained}:
        return []
    get_logger().warning("%s->%s was not trained (zero-shot): scored as the run translates it (trained: %s)",
                         src_lang, tgt_lang, ", ".join("->".join(d) for d in trained))
    return [(src_lang, tgt_lang)]


def evaluate(run_dir: str | Path, **options: Any) -> dict[str, Any]:
    """Decode a split (or a ``src_file``/``ref_file`` pair, ``more_refs`` adding references),
    score it (:func:`mtcli.metrics.score` with ``metrics``), write hypotheses + report.

    The split defaults to the first of ``data.test_splits`` (text from ``run_dir/text/`` or the
    prepared cache). Hypotheses go to ``<output_dir>/<name>.<ckpt>.hyp`` and the report (scores,
    signatures, checkpoint, decode settings, speed, device, peak memory) to
    ``<name>.<ckpt>.report.json``, both atomically; ``output_dir`` defaults to ``run_dir/eval``.
    ``settings``: typed decode settings (as :class:`~mtcli.infer.translator.Translator` takes
    them); ``overrides``: ``--set decode.*`` strings. ``average_last``/``average_best``: average
    that many checkpoints first; ``ensemble``: more members (:func:`mtcli.infer.ensemble.add_members`;
    file names then end ``.ensemble<M>``); ``engine``: ``torch`` or ``ctranslate2``.
    ``src_lang`` and the setting ``tgt_lang``: the direction of a split to score, for a model of
    several (default: the run's ``data.src_lang`` and the model's default target,
    ``decode.tgt_lang`` where set, else ``data.tgt_lang``). ``options``: the
    keywords of :func:`evaluate_directions` (one direction here: the one asked for).
    """
    return evaluate_directions(run_dir, every_direction=False, **options)[0]


def evaluate_directions(
    run_dir: str | Path,
    *,
    split: str | None = None,
    src_file: str | Path | None = None,
    ref_file: str | Path | None = None,
    checkpoint: str = "best",
    average_last: int = 0,
    average_best: int = 0,
    overrides: list[str] | None = None,
    output_dir: str | Path | None = None,
    ensemble: Sequence[str | Path] = (),
    engine: str = "torch",
    more_refs: Sequence[str | Path] = (),
    metrics: Sequence[str] = ("bleu", "chrf"),
    src_lang: str | None = None,
    every_direction: bool = True,
    **settings: Any,
) -> list[dict[str, Any]]:
    """:func:`evaluate` for every direction the run was trained on (one model loaded once), or
    those with the given ``src_lang`` / setting ``tgt_lang``: one report each. A run of one
    direction, or given files, gives one report."""
    run_dir = Path(run_dir)
    _check_test_args(split, src_file, ref_file, more_refs)
    metrics = metric_names(metrics)  # before the model is loaded
    if src_lang is not None:
        check_language_code("--src-lang", src_lang)
    if more_refs and src_file is None:
        raise ConfigError("several references (--ref ... --ref) need --src files, not a split")
    check_run_dir(run_dir)  # (a config given for the run: its eval/ was said to be unwritable)
    _check_output_dir(run_dir, output_dir)  # before the model loads (and is converted, for CTranslate2)
    translator = Translator.from_run(run_dir, checkpoint, average_last=average_last,
                                     average_best=average_best, ensemble=ensemble, engine=engine,
                                     overrides=overrides or (), **settings)
    warn_of_unused_sampling(overrides or (), translator.decode, "evaluate decodes by search")
    data, tgt_lang = translator.bundle.config.data, settings.get("tgt_lang")
    if tgt_lang is None and "decode.tgt_lang" in override_keys(overrides or ()):  # asked by --set: as --tgt-lang
        tgt_lang = translator.decode.tgt_lang
    trained, every = run_directions(run_dir, translator.bundle.config), every_direction and src_file is None
    if every:
        directions = [d for d in trained if src_lang in (None, d[0]) and tgt_lang in (None, d[1])]
    else:  # the model's default target: decode.tgt_lang where the run or --set names one
        directions = _one_direction(trained, (data.src_lang, translator.target_languages[0]), src_lang, tgt_lang)
    if not directions and src_file is not None:
        directions = _zero_shot(trained, src_lang, tgt_lang)
    if not directions:
        zero_shot = src_file is None and src_lang in {s for s, _ in trained} and tgt_lang in {t for _, t in trained}
        raise ConfigError(f"{run_dir}: no direction {src_lang or '*'}->{tgt_lang or '*'} among those it was "
                          f"trained on ({', '.join('->'.join(d) for d in trained)})"
                          + ("; a direction it was not trained on is scored zero-shot on files: --src FILE --ref FILE"
                             if zero_shot else ""))
    sources = sorted({d[0] for d in trained})
    if src_file is not None and src_lang is None and len(sources) > 1:  # a file's language cannot be told
        get_logger().warning("%s: scored as %s (the run translates from %s; --src-lang names the file's language)",
                             src_file, "->".join(directions[0]), ", ".join(sources))
    if not every:
        if tgt_lang is None and len(translator.target_languages) > 1:
            get_logger().warning("%s translates into %s: scoring into %s, its default (--tgt-lang chooses)",
                                 run_dir, ", ".join(translator.target_languages), directions[0][1])
    refs = [Path(ref_file)] if ref_file is not None else []
    ckpt = _checkpoint_name(translator.bundle, average_last, average_best, len(ensemble) + 1, Path(run_dir),
                            str(checkpoint))
    model = {"average_last": average_last, "average_best": average_best, "ensemble": [str(p) for p in ensemble]}
    test = _Test(split, src_file, [*refs, *map(Path, more_refs)], metrics, output_dir, ckpt, model)
    inputs = _inputs(run_dir, translator.bundle.config, test, directions, every)  # all, before decoding
    _check_outputs(run_dir, test, inputs)
    _warn_of_unwritable_references(translator, inputs)
    return [_evaluate_with(translator, run_dir, test, given) for given in inputs]


def _warn_of_unwritable_references(translator: Translator, inputs: list[_Input]) -> None:
    """Warn of references the model's tokenizer does not give back as written (its normalisation,
    characters it lacks): scores against them are capped (:func:`~mtcli.data.coverage.warn_of_unwritable`)."""
    rule = translator.bundle.config.data.spm_normalization
    for given in inputs:
        for path, lines in zip(given.ref_paths, [given.references, *given.more_references], strict=True):
            step = round_trip_step(len(lines))
            name = f"{given.split}.{given.direction[1]}" if given.split else str(path)
            warn_of_unwritable(name, lines[::step], translator.bundle.tokenizer, rule, step, len(lines))


def _inputs(run_dir: Path, config: Config, test: _Test, directions: list[tuple[str, str]], every: bool) -> list[_Input]:
    """Each direction's test text (:func:`_read_input`). Scoring every direction, one without
    text (its corpus had no test sets, or empty ones) is left out with a warning, unless none
    has any."""
    inputs, missing = [], []
    for direction in directions:
        others = every and any(tgt != direction[1] for _, tgt in directions)
        try:
            inputs.append(_read_input(run_dir, config, test, direction,
                                      "or --tgt-lang: score the directions into another language" if others else ""))
        except NoTestText as exc:
            if not every:
                raise
            missing.append(("->".join(direction), exc))
    if not inputs:
        raise missing[0][1]
    for direction, exc in missing:
        get_logger().warning("%s: not scored (%s)", direction, exc)
    return inputs
