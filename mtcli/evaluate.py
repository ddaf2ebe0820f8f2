"""Scoring with sacreBLEU and ``mtcli evaluate``: decode a test set, score it, write a report.

Scores (Post, 2018, "A Call for Clarity in Reporting BLEU Scores"), all on detokenised text:

* **BLEU** with sacreBLEU's defaults (13a tokenisation, cased, exponential smoothing):
  ``BLEU = BP * exp(sum_n 1/4 * log p_n)`` with ``BP = min(1, exp(1 - r/c))``;
* **chrF** (Popović, 2015): character n-gram F-score, ``beta = 2``;
* **lowercased BLEU** (``-lc``, 13a): only for comparison with papers that report it.

Every score comes with its sacreBLEU signature, so a number in a table says exactly how it was
computed.
"""

from __future__ import annotations

import json
import re
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mtcli.errors import ConfigError, DataError
from mtcli.fileio import atomic_write
from mtcli.logs import get_logger, progress


def score(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """Corpus BLEU, chrF and lowercased BLEU of ``hypotheses`` against one reference each.

    Returns ``bleu``, ``chrf``, ``bleu_lc`` (floats, 0-100), their signatures as
    ``bleu_signature``/``chrf_signature``/``bleu_lc_signature`` (also grouped under
    ``signatures``), and BLEU's details (``bleu_precisions``, ``bleu_bp``, ``sys_len``,
    ``ref_len``). Raises :class:`DataError` if the two lists differ in length.
    """
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise DataError(
            f"{len(hypotheses)} hypotheses but {len(references)} references: counts must match"
        )
    refs = [list(references)]
    bleu, chrf, bleu_lc = BLEU(), CHRF(), BLEU(lowercase=True)
    b = bleu.corpus_score(list(hypotheses), refs)
    c = chrf.corpus_score(list(hypotheses), refs)
    lc = bleu_lc.corpus_score(list(hypotheses), refs)
    signatures = {
        "bleu": str(bleu.get_signature()),
        "chrf": str(chrf.get_signature()),
        "bleu_lc": str(bleu_lc.get_signature()),
    }
    return {
        "bleu": round(float(b.score), 4),
        "chrf": round(float(c.score), 4),
        "bleu_lc": round(float(lc.score), 4),
        "bleu_signature": signatures["bleu"],
        "chrf_signature": signatures["chrf"],
        "bleu_lc_signature": signatures["bleu_lc"],
        "signatures": signatures,
        "bleu_precisions": [round(float(p), 4) for p in b.precisions],
        "bleu_bp": round(float(b.bp), 4),
        "sys_len": int(b.sys_len),
        "ref_len": int(b.ref_len),
    }


def _safe_name(name: str) -> str:
    """A file-name-safe form of a checkpoint or split name (``checkpoint_best.pt`` -> ``best``)."""
    stem = Path(name).name
    stem = re.sub(r"\.pt$", "", stem)
    stem = re.sub(r"^checkpoint_", "", stem)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem) or "model"


def _split_files(run_dir: Path, config: Any, split: str) -> tuple[Path, Path]:
    """Source and reference text of ``split``: ``run_dir/text/`` first, then the prepared cache."""
    src_lang, tgt_lang = config.data.src_lang, config.data.tgt_lang
    text_dir = run_dir / "text"
    src, ref = text_dir / f"{split}.{src_lang}", text_dir / f"{split}.{tgt_lang}"
    if src.is_file() and ref.is_file():
        return src, ref
    prepared = config.data.prepared_path()
    try:
        from mtcli.cache import PreparedCorpus

        corpus = PreparedCorpus.open(prepared, verify=False)
    except (ImportError, DataError, OSError):
        corpus = None
    if corpus is not None and split in corpus.splits:
        src, ref = corpus.text_path(split, src_lang), corpus.text_path(split, tgt_lang)
        if src.is_file() and ref.is_file():
            return src, ref
    raise DataError(
        f"split '{split}': no text at {text_dir}/{split}.{src_lang}|{tgt_lang} nor in the "
        f"prepared cache {prepared} (known test splits: {', '.join(config.data.test_splits)})"
    )


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and bytes on macOS.
    return round(rss / (2**20 if sys.platform == "darwin" else 2**10), 1)


def evaluate(
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
) -> dict[str, Any]:
    """Decode a split (or a ``src_file``/``ref_file`` pair), score it, write hypotheses + report.

    The split defaults to the first of ``data.test_splits``; its raw text comes from
    ``run_dir/text/<split>.<lang>`` (or the prepared cache). Hypotheses are detokenised with the
    run's SentencePiece model and written to ``<output_dir>/<name>.<ckpt>.hyp``; the report
    (scores and signatures, checkpoint, decode settings, sentences, sentences/s, target tokens/s,
    device, peak memory) to ``<output_dir>/<name>.<ckpt>.report.json``; both atomically.
    ``output_dir`` defaults to ``run_dir/eval``. ``overrides`` are ``decode.*`` ``--set``
    strings. ``average_last``/``average_best`` average that many checkpoints before decoding.
    ``ensemble``: more members decoded together with that model (run directories or checkpoint
    files, see :func:`mtcli.ensemble.add_members`); the file names then end ``.ensemble<M>``.
    Returns the report dict.
    """
    from mtcli.checkpoint import load_for_inference
    from mtcli.corpus import read_lines
    from mtcli.ensemble import add_members
    from mtcli.translate import decode_config, decoding_device, translate_lines

    run_dir = Path(run_dir)
    log = get_logger()
    if (src_file is None) != (ref_file is None):
        raise ConfigError("--src and --ref must be given together")
    if src_file is not None and split is not None:
        raise ConfigError("give either --split or --src/--ref, not both")
    bundle = load_for_inference(run_dir, checkpoint, average_last=average_last, average_best=average_best)
    bundle = add_members(bundle, ensemble)
    config = decode_config(bundle.config, list(overrides or []))
    decode = config.decode
    device = decoding_device(decode)
    bundle.model.to(device)
    if src_file is not None:
        src_path, ref_path = Path(src_file), Path(ref_file)  # type: ignore[arg-type]
        name = _safe_name(src_path.name)
    else:
        split = split or (config.data.test_splits[0] if config.data.test_splits else None)
        if not split:
            raise ConfigError(f"{run_dir}: data.test_splits is empty; pass --split or --src/--ref")
        src_path, ref_path = _split_files(run_dir, config, split)
        name = _safe_name(split)
    sources, references = list(read_lines(src_path)), list(read_lines(ref_path))
    if len(sources) != len(references):
        raise DataError(
            f"{src_path} has {len(sources)} lines but {ref_path} has {len(references)}: "
            "source and reference line counts must match"
        )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    hypotheses: list[str] = []
    target_tokens = 0
    bar = progress(total=len(sources), unit="sent", desc=f"evaluate {name}")
    start = time.perf_counter()
    try:
        for nbest in translate_lines(bundle, sources, decode, device, name=str(src_path),
                                     on_done=bar.update):
            best = nbest[0]
            hypotheses.append(best.text)
            target_tokens += len(best.tokens)
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    scores = score(hypotheses, references)
    if average_last > 0:
        ckpt = f"avg_last{average_last}"
    elif average_best > 0:
        ckpt = f"avg_best{average_best}"
    else:
        ckpt = _safe_name(str(bundle.name).split(" (")[0])
    if ensemble:
        ckpt += f".ensemble{len(ensemble) + 1}"
    out_dir = Path(output_dir) if output_dir is not None else run_dir / "eval"
    hyp_path = out_dir / f"{name}.{ckpt}.hyp"
    report_path = out_dir / f"{name}.{ckpt}.report.json"
    report: dict[str, Any] = {
        **scores,
        "split": split,
        "source": str(src_path),
        "reference": str(ref_path),
        "checkpoint": str(bundle.name),
        "average_last": average_last,
        "average_best": average_best,
        "ensemble": [str(p) for p in ensemble],
        "decode": dict(vars(decode)),
        "sentences": len(sources),
        "seconds": round(seconds, 3),
        "sentences_per_second": round(len(sources) / seconds, 2) if seconds > 0 else 0.0,
        "target_tokens": target_tokens,
        "target_tokens_per_second": round(target_tokens / seconds, 1) if seconds > 0 else 0.0,
        "device": str(device),
        "peak_memory_mb": _peak_memory_mb(device),
        "hypotheses": str(hyp_path),
        "report": str(report_path),
    }
    # The hypotheses are written and flushed before the report is written and renamed, and
    # renamed right after it: a failed write (disk full, file-size limit) leaves the previous
    # hypotheses and report, never a new one beside an old one.
    report_text = json.dumps(report, indent=2, ensure_ascii=False) + "\n"
    with atomic_write(hyp_path) as hyp_handle:
        for text in hypotheses:
            hyp_handle.write(text + "\n")
        hyp_handle.flush()
        with atomic_write(report_path) as report_handle:
            report_handle.write(report_text)
    log.info(
        "%s (%s, %d sentences): BLEU %.2f  chrF %.2f  BLEU(lc) %.2f  [%.1f sent/s]",
        name, bundle.name, len(sources), scores["bleu"], scores["chrf"], scores["bleu_lc"],
        report["sentences_per_second"],
    )
    return report
