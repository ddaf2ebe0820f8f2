"""``mtcli compare``: do systems A and B really differ? sacreBLEU's paired significance tests.

Each system is a hypothesis file, or a run directory (its newest ``eval/*.hyp`` that ``mtcli
evaluate`` scored against the first reference); the first system is the baseline. Every other
system is compared with it on the same references (``--ref``, repeatable: several references per
sentence). Both tests are two-sided, as sacreBLEU's are: a small p-value says the two scores
differ beyond chance, in either direction (the scores say which is higher):

* **paired bootstrap resampling** (Koehn, 2004): the sentences are resampled ``n`` times (1,000
  by default); each system's score gets its bootstrap mean and 95% confidence interval, and the
  p-value is the share of resamples whose absolute difference from the baseline, less the
  resamples' mean one, exceeds the real absolute difference;
* **approximate randomization** (Riezler and Maxwell, 2005): the two systems' outputs are
  swapped sentence by sentence at random ``n`` times (10,000 by default); the p-value is the
  share of swaps whose absolute score difference exceeds the real one.

A system whose score equals the baseline's gets p = 1 (no difference to test).

Metrics: BLEU, chrF and TER (sacreBLEU's defaults, BLEU's tokeniser chosen by the references'
language as :func:`mtcli.metrics.scorer` does: ``tgt_lang``, else the language ``mtcli evaluate``
recorded beside a system's hypotheses; lower TER is better). The report holds every
score, mean, interval and p-value with each metric's sacreBLEU signature (which records the test
and its number of samples), and is written atomically to ``report.json``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtcli.allocator import available_host_bytes
from mtcli.config import check_language_code
from mtcli.data.textio import lines_sha256, read_lines, read_lines_hashed
from mtcli.errors import ConfigError, DataError, shown
from mtcli.fileio import atomic_write, check_file_target, is_stream, sha256_file
from mtcli.languages import known_code
from mtcli.logs import get_logger
from mtcli.metrics import (
    BOM_NOTE,
    METRICS,
    check_one_language,
    metric_names,
    phrase_bleu_note,
    scorer,
    warn_if_tokenised,
)

TESTS = {"bs": "paired bootstrap resampling", "ar": "approximate randomization"}
DEFAULT_SAMPLES = {"bs": 1000, "ar": 10000}


def hypothesis_file(system: str | Path, reference: str | Path | None = None, *, digest: str | None = None,
                    lines: str | None = None) -> Path:
    """``system`` itself when it is a file (or a stream: ``<(zcat hyp.gz)``); for a run
    directory, its newest ``eval/*.hyp`` scored against ``reference`` (by the ``report.json``
    beside it): a run holds the hypotheses of every split and direction it was evaluated on. A
    run none of whose hypotheses was scored against ``reference`` is a :class:`DataError`;
    hypotheses whose report does not say (written by hand, or by an older mtcli) are taken only
    when none matches. ``digest``: the reference's sha256 when it was read already (a stream
    cannot be read again); ``lines``: its text's (:func:`~mtcli.data.textio.lines_sha256`),
    which also finds hypotheses scored against its ``.gz`` or CRLF copy."""
    path = Path(system)
    if path.is_file() or is_stream(path):
        return path
    if not path.is_dir():
        raise DataError(f"{path}: no such hypothesis file or run directory")
    found = sorted(path.glob("eval/**/*.hyp"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise DataError(f"{path}: no hypotheses under {path / 'eval'} (run mtcli evaluate {path} first)")
    if reference is None:
        return found[-1]
    if digest is None:
        text, digest = read_lines_hashed(reference, BOM_NOTE)
        lines = lines_sha256(text)
    scored = {hyp: _scored_against(hyp, digest, lines) for hyp in found}
    matching = [hyp for hyp, same in scored.items() if same] or [hyp for hyp, same in scored.items() if same is None]
    if not matching:
        listed = ", ".join(str(hyp.relative_to(path)) for hyp in found[:-6:-1])
        raise DataError(f"{path}: none of its hypotheses was scored against {reference} (its newest: {listed}); "
                        f"give the .hyp file itself, or run mtcli evaluate {path} with that reference first")
    return matching[-1]


def _scored_against(hyp: Path, digest: str, lines: str | None = None) -> bool | None:
    """Whether the report beside ``hyp`` names a reference of sha256 ``digest``, or of text
    ``lines`` (None: it does not say, or its reference file is gone)."""
    try:
        report = json.loads(hyp.with_suffix(".report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict):
        return None
    if lines is not None and report.get("reference_lines_sha256") == lines:
        return True
    if isinstance(report.get("reference_sha256"), str):
        return report["reference_sha256"] == digest
    try:  # an older report: its reference's path, as evaluate was given it
        return sha256_file(str(report["reference"])) == digest
    except (KeyError, OSError):
        return None


def _lines(path: Path, count: int | None, what: str) -> list[str]:
    lines = list(read_lines(path, BOM_NOTE))
    if count is not None and len(lines) != count:
        raise DataError(f"{path} has {len(lines)} lines but the {what} has {count}: line counts must match")
    return lines


def recorded_language(files: Sequence[Path]) -> str | None:
    """The target language ``mtcli evaluate`` recorded in the report beside the first of
    ``files`` (``X.hyp`` -> ``X.report.json``) that has one, else None."""
    for path in files:
        try:
            report = json.loads(path.with_suffix(".report.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(report, dict) and isinstance(report.get("tgt_lang"), str):
            return report["tgt_lang"]
    return None


def _check_arguments(systems: Sequence[str | Path], references: Sequence[str | Path], metrics: Sequence[str],
                     tests: Sequence[str], samples: int | None, output: str | Path | None, tgt_lang: str | None) -> None:
    """:func:`compare`'s arguments checked before any file is read (one-line errors)."""
    if len(systems) < 2:
        raise ConfigError("compare needs at least two systems: the baseline first, then the others")
    if not references:
        raise ConfigError("compare needs at least one reference file (--ref)")
    if any(str(path) == "-" for path in (*systems, *references)):
        raise ConfigError("-: compare reads each system's hypotheses and the references as files (or run "
                          "directories); give standard input as /dev/stdin")
    if not metrics or not tests:
        raise ConfigError(f"compare needs at least one metric ({', '.join(METRICS)}) and one test "
                          f"({', '.join(TESTS)}), got metrics {list(metrics)} and tests {list(tests)}")
    for option, given, known in (("--metrics", metrics, METRICS), ("--test", tests, TESTS)):
        unknown = [name for name in given if name not in known]
        if unknown:
            also = ", both" if option == "--test" else ""  # (the command line's name for the two)
            raise ConfigError(f"{option} {', '.join(map(shown, unknown))}: unknown (known: {', '.join(known)}{also})")
    if output is not None:
        check_file_target(Path(output))  # before the tests, not after them
    if samples is not None and samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {samples}")
    if tgt_lang is not None:
        check_language_code("--tgt-lang", tgt_lang)
        check_one_language("--tgt-lang", tgt_lang)
        if not known_code(tgt_lang):
            get_logger().warning("--tgt-lang %s: no language code langcodes knows (a typo?): scored as a language "
                                 "whose words spaces separate (BLEU's 13a)", tgt_lang)


def compare(systems: Sequence[str | Path], references: Sequence[str | Path], *,
            metrics: Sequence[str] = METRICS, tests: Sequence[str] = ("bs", "ar"),
            samples: int | None = None, names: Sequence[str] | None = None,
            output: str | Path | None = None, tgt_lang: str | None = None) -> dict[str, Any]:
    """Compare ``systems`` (the first is the baseline) on ``references`` with each of ``tests``
    (``bs``, ``ar``; see the module docstring), for each of ``metrics``. ``samples``: resamples
    or swaps per test (default 1,000 and 10,000); ``tgt_lang``: the references' language (by
    default the one recorded beside the hypotheses, if any). Returns the report, also written to
    ``output`` (a ``report.json`` path) when given. Raises :class:`ConfigError` or :class:`DataError`."""
    from sacrebleu.significance import PairedTest

    _check_arguments(systems, references, metrics, tests, samples, output, tgt_lang)
    metrics, tests = metric_names(metrics), tuple(dict.fromkeys(tests))
    _check_seed()
    first, digest = read_lines_hashed(references[0], BOM_NOTE)  # once: a stream gives its lines once
    count = len(first)
    if not count:
        raise DataError(f"{references[0]}: empty; there is nothing to compare")
    _check_memory(count, metrics, tests, samples)
    text = lines_sha256(first)
    files = [hypothesis_file(s, references[0], digest=digest, lines=text) for s in systems]
    if output is not None and Path(output).exists() and any(
            Path(output).resolve() == Path(f).resolve() for f in [*files, *references]):
        raise ConfigError(f"-o {output}: is one of the files compared (a system or a reference); give another path")
    names = list(names) if names else _distinct([str(s) for s in systems])
    if len(names) != len(files) or len(set(names)) != len(names):
        raise ConfigError("compare needs one distinct name per system")
    what = f"{'first ' if len(references) > 1 else ''}reference {references[0]}"
    refs = [first] + [_lines(Path(r), count, what) for r in references[1:]]
    hyps = [_lines(f, count, what) for f in files]
    tgt_lang = tgt_lang or recorded_language(files)
    if tgt_lang is None and "bleu" in metrics and (looks := unspaced_script(first)):
        get_logger().warning("%s: no --tgt-lang, nor a language recorded beside the hypotheses, so BLEU splits words "
                             "at spaces (13a), but it looks like %s text: give --tgt-lang %s", references[0], *looks)
    for file, lines in zip(files, hyps, strict=True):
        warn_if_tokenised(lines, str(file))
    if "bleu" in metrics and (note := phrase_bleu_note(tgt_lang)):
        get_logger().warning("%s%s", note, "" if "chrf" in metrics else " (--metrics bleu,chrf)")
    identical = {name for name, lines in zip(names[1:], hyps[1:], strict=True) if lines == hyps[0]}
    # (past log2(swaps + 1) + 1 differing lines, the floor is below any p the test can give)
    enough = math.ceil(math.log2((samples or DEFAULT_SAMPLES["ar"]) + 1)) + 1
    differing = {m: differing_lines(scorer(m, tgt_lang), hyps, refs, enough) for m in metrics} if "ar" in tests else {}
    report: dict[str, Any] = {"baseline": names[0], "sentences": count, "references": [str(r) for r in references],
                              "systems": {n: str(f) for n, f in zip(names, files, strict=True)}, "tgt_lang": tgt_lang,
                              "tests": {}}
    for test in tests:
        n = samples or DEFAULT_SAMPLES[test]
        paired = PairedTest(list(zip(names, hyps, strict=True)), {m: scorer(m, tgt_lang) for m in metrics}, refs,
                            test_type=test, n_samples=n)
        signatures, scores = paired()
        report["tests"][test] = {
            "name": TESTS[test], "samples": n,
            "signatures": {m: str(sig) for m, sig in zip(metrics, signatures.values(), strict=True)},
            "scores": {m: {name: _result(r, results[0], name in identical,
                                         ar_floor(differing[m][i]) if test == "ar" and i else 0.0)
                           for i, (name, r) in enumerate(zip(names, results, strict=True))}
                       for m, results in zip(metrics, list(scores.values())[1:], strict=True)},
        }
    if output is not None:
        with atomic_write(output, follow=True) as handle:
            json.dump(report, handle, indent=2)
            handle.write("\n")
    return report


#: Scripts whose text BLEU's 13a does not split into words as sacreBLEU's ``-l`` for its language
#: would (Chinese, Japanese and Thai have no spaces between words; Korean is split by MeCab), by
#: code point ranges, with that language's code (kana first: Japanese text holds Han too).
_UNSPACED_SCRIPTS = (("Japanese", "ja", ((0x3040, 0x30FF),)),
                     ("Chinese", "zh", ((0x4E00, 0x9FFF), (0x3400, 0x4DBF))),
                     ("Korean", "ko", ((0xAC00, 0xD7AF), (0x1100, 0x11FF), (0x3130, 0x318F))),
                     ("Thai", "th", ((0x0E00, 0x0E7F),)))


def unspaced_script(lines: Sequence[str], sample: int = 1000) -> tuple[str, str] | None:
    """The name and code of the language of a script whose words 13a does not split as that
    language's own tokeniser would (Japanese, Chinese, Korean, Thai), when most of ``lines``
    (``sample`` of them, spread out) are mostly in it; else None."""
    picked = lines[::max(1, len(lines) // sample)]
    for name, code, ranges in _UNSPACED_SCRIPTS:
        mostly = sum(sum(any(low <= ord(c) <= high for low, high in ranges) for c in line) * 4 > len(line)
                     for line in picked if line.strip())
        if mostly * 2 > len(picked):
            return name, code
    return None


#: sacreBLEU's sufficient statistics a line, per metric (what its paired tests resample).
_STATISTICS = {"bleu": 10, "chrf": 18, "ter": 2}


def paired_test_bytes(test: str, lines: int, metrics: Sequence[str], samples: int) -> int:
    """About the most memory sacreBLEU's paired ``test`` takes at once over ``lines`` lines:
    every resample or swap of every line is one array. Approximate randomization holds two
    ``samples x lines`` masks and one cast to 8-byte numbers for a matrix product; bootstrap
    resampling ``samples x lines`` indices (8 bytes) and the statistics they pick (4 bytes each)."""
    if test == "ar":
        return 10 * samples * lines
    return max(8 + 4 * _STATISTICS[m] for m in metrics) * samples * lines


def _check_memory(lines: int, metrics: Sequence[str], tests: Sequence[str], samples: int | None) -> None:
    """:class:`ConfigError` before the tests when one would need more memory than is available
    (:func:`paired_test_bytes`): on a test set of 200,000 lines, sacreBLEU's approximate
    randomization needs about 20 GB, and a process out of memory is killed without a word."""
    available = available_host_bytes()
    for test in tests:
        n = samples or DEFAULT_SAMPLES[test]
        need = paired_test_bytes(test, lines, metrics, n)
        if available is not None and need * 1.2 > available:  # (the process's own memory besides)
            fewer = max(1, int(n * available / (need * 1.2)))
            raise ConfigError(f"--test {test} over {lines:,} lines with {n:,} samples needs about {_size(need)} at once "
                              f"(sacreBLEU holds every sample of every line), and {_size(available)} is available: "
                              f"give --samples {fewer:,} or fewer, or compare a part of the lines")


def _size(size: float) -> str:
    """``size`` bytes in GiB, or MiB below one."""
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"


def _distinct(names: list[str]) -> list[str]:
    """``names`` with a repeat numbered (``a.hyp``, ``a.hyp (2)``): a system given twice is
    compared with itself, not refused."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    return out


def differing_lines(metric: Any, hyps: list[list[str]], refs: list[list[str]], enough: int) -> list[int]:
    """For each system of ``hyps`` (the baseline first), how many lines give ``metric`` other
    sentence statistics than the baseline's (what a swap of approximate randomization
    exchanges), counted up to ``enough`` at least: a line whose text differs only in what the
    metric does not see (``dog.`` and ``dog .`` to BLEU's 13a tokeniser) is no difference to it.
    Only lines whose text differs are scored, a block at a time until every count is enough."""
    rows = [i for i, line in enumerate(hyps[0]) if any(other[i] != line for other in hyps[1:])]
    counts = [0] * len(hyps)
    for start in range(0, len(rows), 256):
        if min(counts[1:]) >= enough:
            break
        block = rows[start:start + 256]
        some = [[stream[i] for i in block] for stream in refs]
        stats = [[list(map(float, row)) for row in metric._extract_corpus_statistics([lines[i] for i in block], some)]
                 for lines in hyps]  # (as sacreBLEU's paired tests read them)
        counts = [n + sum(a != b for a, b in zip(stats[0], theirs, strict=True))
                  for n, theirs in zip(counts, stats, strict=True)]
    return counts


def ar_floor(differing: int) -> float:
    """The smallest p-value approximate randomization can honestly give two systems whose
    outputs differ, to a metric, on ``differing`` lines (:func:`differing_lines`): swapping a
    line both translate alike changes nothing, so of the 2^k swaps of the others, the one that
    swaps none and the one that swaps all give the real difference, up to its sign. sacreBLEU
    counts only samples whose difference exceeds the real one, so it reports 1/(samples+1)
    there too (one differing line read as significant)."""
    return 1.0 if differing <= 1 else min(1.0, 2.0 ** (1 - differing))


def _result(result: Any, baseline: Any, identical: bool = False, floor: float = 0.0) -> dict[str, Any]:
    """A sacreBLEU significance result as plain numbers (``ci``: the half-width of the 95%
    interval), its p-value at least ``floor`` (:func:`ar_floor`). A system whose score equals
    the ``baseline``'s gets p = 1, and says whether its output is ``identical`` to the
    baseline's, line for line: a difference of 0 is no evidence of any difference (sacreBLEU
    counts only samples whose difference exceeds the real one, so when every sample's is also
    0, as with equal sentence scores, it reports 1/(samples+1), which reads as significant)."""
    def num(x: Any) -> float | None:  # unrounded: shown to 2 places as sacreBLEU shows them
        return None if x is None else float(x)

    tied = result.p_value is not None and float(result.score) == float(baseline.score)
    p_value = 1.0 if identical or tied else num(result.p_value)
    extra = {"identical_to_baseline": True} if identical else {"same_score_as_baseline": True} if tied else {}
    if p_value is not None and p_value < floor:
        p_value, extra = floor, {**extra, "p_floor": floor}
    return {"score": num(result.score), "mean": num(result.mean), "ci": num(result.ci), "p_value": p_value, **extra}


def _check_seed() -> None:
    """:class:`ConfigError` for a ``SACREBLEU_SEED`` (the tests' seed; 12345 without it) that
    sacreBLEU would not seed with: 0 and None mean no seed to it, though its signature names one,
    so the p-values could not be repeated; a negative one failed inside the test."""
    given = os.environ.get("SACREBLEU_SEED")
    if given is None:
        return
    try:
        seed = int(given)
    except ValueError:
        seed = -1
    if seed <= 0 or seed >= 2**32:
        raise ConfigError(f"SACREBLEU_SEED={given}: give a seed from 1 to 2^32-1 (sacreBLEU draws unseeded for 0 "
                          "or None, while its signature names a seed: p-values no one could repeat)")


def _p_text(p: float) -> str:
    """A p-value to 4 places, or to 2 significant digits below 0.0001 (1/100,001 is no 0)."""
    return f"{p:.4f}" if p == 0 or p >= 1e-4 else f"{p:.1e}"


def render(report: dict[str, Any]) -> str:
    """The report as a table per test: each system's score (mean ± 95% interval under the
    bootstrap) and p-value against the baseline, per metric; then the signatures."""
    lines = [f"{name}: {file}" for name, file in report["systems"].items() if name != file]
    for body in report["tests"].values():
        lines.append(f"{body['name']} ({body['samples']} samples), baseline {report['baseline']}:")
        for metric, by_system in body["scores"].items():
            for name, r in by_system.items():
                spread = f" (mean {r['mean']:.2f} ± {r['ci']:.2f})" if r["mean"] is not None else ""
                p = "" if r["p_value"] is None else f"  p = {_p_text(r['p_value'])}"
                p += " (the baseline's output, line for line)" if r.get("identical_to_baseline") else ""
                p += " (the baseline's score: no difference to test)" if r.get("same_score_as_baseline") else ""
                p += " (few lines differ: no smaller p is possible)" if r.get("p_floor") else ""
                lines.append(f"  {metric:5s} {name}: {r['score']:.2f}{spread}{p}")
        lines += [f"  {m} signature: {sig}" for m, sig in body["signatures"].items()]
    return "\n".join(lines)


__all__ = ["METRICS", "TESTS", "compare", "hypothesis_file", "render"]
