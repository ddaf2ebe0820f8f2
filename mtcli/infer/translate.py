"""Streamed, length-batched translation of lines, and the ``mtcli translate`` command's body.

:func:`translate_lines` is the one decoding path used by ``translate``, ``evaluate`` and the
in-training validation BLEU. It reads its input a *window* of lines at a time, so memory stays
bounded however long the input is:

1. each line is encoded with the run's SentencePiece model; a source longer than the model's
   limit (``max_positions - 1`` pieces, leaving room for ``</s>``) is truncated with a warning
   naming the line, never dropped; an empty line is not sent to the model at all and gives an
   empty translation;
2. the window is sorted by source length and cut into batches whose padded size
   ``B * S_max * beam_size`` stays within ``decode.max_tokens`` (at least one sentence a batch);
3. every batch is decoded with :func:`mtcli.infer.search.generate` (greedy or beam, under bf16
   autocast when ``decode.bf16``; with an int8 copy of the model when ``decode.int8``, see
   :mod:`mtcli.infer.quantize`); with ``decode.workers`` = N > 1, N batches at a time on N threads,
   each with 1/N of torch's intra-op threads (small decoder steps scale better across batches
   than inside one matrix product);
4. results are put back in input order and yielded as soon as a contiguous prefix of the window
   is complete: one list of n-best :class:`Translation` per input line, line count in equals
   line count out.

:func:`translate_files` reads files (or stdin) strictly as UTF-8, writes stdout line by line or a
file atomically, shows a progress bar for file inputs and can plot cross-attention heatmaps.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import stat
import sys
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from mtcli.config import Config, DecodeConfig, config_from_dict
from mtcli.data.batching import collate_sources, source_batches
from mtcli.data.textio import ArrivingLines, count_lines, iter_binary_lines, read_lines
from mtcli.data.tokenizer import Tokenizer
from mtcli.device import autocast, resolve_device
from mtcli.errors import ConfigError, DataError
from mtcli.fileio import atomic_write
from mtcli.infer.ensemble import Ensemble, add_members, decoding_members
from mtcli.infer.loading import InferenceModel, load_for_inference
from mtcli.infer.quantize import quantize_for_decoding
from mtcli.infer.search import Hypothesis, generate
from mtcli.logs import get_logger, progress
from mtcli.plots import plot_attention_png

#: Lines read (and sorted by length) at a time; bounds memory independently of input length.
DEFAULT_WINDOW = 2000


@dataclass
class Translation:
    """One hypothesis for one input line.

    ``text`` is the detokenised output, ``tokens`` its SentencePiece ids (no bos/eos),
    ``score`` the length-penalised log-probability the search ranked by and ``logprob`` the
    plain sum of token log-probabilities (including ``</s>``). ``attention`` is the
    head-averaged cross-attention ``[layers, T, S]`` when it was asked for, else ``None``;
    ``source_tokens`` are the source ids actually decoded (after truncation, no ``</s>``).
    """

    text: str
    score: float
    tokens: list[int]
    logprob: float = 0.0
    attention: torch.Tensor | None = None
    source_tokens: list[int] | None = None


def _empty_translation() -> Translation:
    return Translation(text="", score=0.0, tokens=[], logprob=0.0, attention=None)


def source_limit(bundle: InferenceModel) -> int:
    """Longest source (in pieces, before ``</s>``) the model accepts: ``max_positions - 1``."""
    return int(bundle.model.max_positions) - 1


def _encode_window(tokenizer: Tokenizer, chunk: list[str], limit: int, name: str, offset: int
                   ) -> tuple[dict[int, list[int]], list[list[Translation] | None]]:
    """The source ids of a window's non-empty lines (truncated to ``limit`` with a warning naming
    the line), and the window's results with the empty lines' already filled in."""
    results: list[list[Translation] | None] = [None] * len(chunk)
    sources: dict[int, list[int]] = {}
    nonempty = [i for i, line in enumerate(chunk) if line.strip()]
    encoded = dict(zip(nonempty, tokenizer.encode_batch([chunk[i] for i in nonempty]), strict=True))
    for i in range(len(chunk)):
        ids = encoded.get(i) or []
        if not ids:
            results[i] = [_empty_translation()]
            continue
        if len(ids) > limit:
            get_logger().warning("%s: line %d: source has %d pieces, truncated to the model limit of %d",
                                 name, offset + i + 1, len(ids), limit)
            ids = ids[:limit]
        sources[i] = ids
    return sources, results


def _translations(tokenizer: Tokenizer, nbest: list[Hypothesis], source: list[int]) -> list[Translation]:
    """The search's n-best list of one line as :class:`Translation` s (detokenised)."""
    return [
        Translation(
            text=tokenizer.decode(h.tokens),
            score=float(h.score),
            tokens=list(h.tokens),
            logprob=float(h.logprob),
            attention=h.attention.float().cpu() if h.attention is not None else None,
            source_tokens=source,
        )
        for h in nbest
    ]


def translate_lines(
    bundle: InferenceModel,
    lines: Iterable[str],
    decode: DecodeConfig,
    device: torch.device | str = "cpu",
    *,
    return_attention: bool = False,
    window: int = DEFAULT_WINDOW,
    name: str = "input",
    use_cache: bool = True,
    on_done: Callable[[int], None] | None = None,
) -> Iterator[list[Translation]]:
    """Translate ``lines`` lazily; yield one n-best list of :class:`Translation` per line, in order.

    The model of ``bundle`` is put in eval mode while decoding and its previous mode restored
    afterwards. Lines are read ``window`` at a time (sorted by length inside the window only), so
    memory does not grow with the input; from an :class:`~mtcli.data.textio.ArrivingLines` (stdin
    from a pipe or a terminal) a window is whatever has arrived, up to ``window`` lines, so each
    line of a slow producer is answered before the next is written. ``name`` prefixes the line
    numbers of truncation warnings. ``on_done(n)``, when given, is called as soon as ``n`` more
    lines are translated (empty lines, then batch by batch), before they can be yielded in order:
    a progress bar fed by it moves with the decoding instead of waiting for the window's first
    lines.
    """
    device = torch.device(device)
    model, tokenizer = bundle.model, bundle.tokenizer
    limit = source_limit(bundle)
    was_training = model.training
    model.eval()
    if decode.int8:
        members = [quantize_for_decoding(m) for m in decoding_members(model)]
        model = Ensemble(members) if len(members) > 1 else members[0]
    threads = torch.get_num_threads()
    pool = None
    if decode.workers > 1:
        pool = ThreadPoolExecutor(decode.workers, thread_name_prefix="mtcli-decode")
        torch.set_num_threads(max(1, threads // decode.workers))

    def decode_batch(sources: list[list[int]]) -> list[list[Hypothesis]]:
        src = collate_sources(sources, device)
        with torch.inference_mode(), autocast(device, decode.bf16):  # both are per thread
            return generate(
                model, src, beam_size=decode.beam_size, length_penalty=decode.length_penalty,
                max_len_a=decode.max_len_a, max_len_b=decode.max_len_b, nbest=decode.nbest,
                use_cache=use_cache, return_attention=return_attention,
                ensemble_mode=decode.ensemble_mode,
            )

    offset = 0
    try:
        for chunk in _windows(lines, window):
            sources, results = _encode_window(tokenizer, chunk, limit, name, offset)
            keys = list(sources)
            if on_done is not None and len(chunk) > len(keys):
                on_done(len(chunk) - len(keys))
            groups = [[keys[b] for b in batch]
                      for batch in source_batches([len(sources[k]) for k in keys], decode.max_tokens,
                                                  decode.beam_size)]
            batches = [[sources[i] for i in group] for group in groups]
            decoded = pool.map(decode_batch, batches) if pool is not None else map(decode_batch, batches)
            emitted = yield from _ready(results, 0)  # the empty lines before the first source
            for indices, hyps in zip(groups, decoded, strict=True):
                if on_done is not None:
                    on_done(len(indices))
                for i, nbest in zip(indices, hyps, strict=True):
                    results[i] = _translations(tokenizer, nbest, sources[i])
                emitted = yield from _ready(results, emitted)
            offset += len(chunk)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
            torch.set_num_threads(threads)
        bundle.model.train(was_training)


def _ready(results: list[list[Translation] | None], start: int
           ) -> Generator[list[Translation], None, int]:
    """Yield the finished results from ``start`` on, up to the first unfinished one; return the
    index of that one (how far the window's results have been handed over, in order)."""
    while start < len(results) and results[start] is not None:
        yield results[start]  # type: ignore[misc]
        start += 1
    return start


def _windows(lines: Iterable[str], window: int) -> Iterator[list[str]]:
    """``lines`` in lists of ``window`` (the last shorter); an :class:`ArrivingLines` hands over
    what has arrived instead of waiting for a full window."""
    if isinstance(lines, ArrivingLines):
        yield from lines.windows(window)
        return
    iterator = iter(lines)
    while chunk := list(itertools.islice(iterator, max(1, window))):
        yield chunk


def translate_texts(
    bundle: InferenceModel, lines: list[str], decode: DecodeConfig, device: torch.device | str = "cpu"
) -> list[str]:
    """List in, list out: the best translation of every line (e.g. validation BLEU in training)."""
    return [nbest[0].text for nbest in translate_lines(bundle, lines, decode, device, window=len(lines) or 1)]


def decoding_device(decode: DecodeConfig) -> torch.device:
    """Where to decode: the CPU under ``decode.int8`` (its int8 kernels are CPU kernels), else
    the first CUDA device when there is one, else the CPU."""
    return torch.device("cpu") if decode.int8 else resolve_device("auto")


def decode_config(config: Config, overrides: list[str]) -> Config:
    """Apply ``decode.*`` ``--set`` overrides to a run's config (other sections are refused)."""
    for text in overrides:
        key = text.split("=", 1)[0].strip()
        if not key.startswith("decode."):
            raise ConfigError(f"--set {text!r}: only decode.* keys can be set when decoding")
    return config_from_dict(config.to_dict(), config.path, overrides)


def format_nbest(nbest: list[Translation], n: int, scored: bool) -> list[str]:
    """Output lines for one input: the best text, or exactly ``n`` ``score<TAB>text`` lines.

    With scores, lines come best first with the score printed to 4 decimals; an empty input (or
    a search that found fewer than ``n`` hypotheses) is padded with ``-inf<TAB>`` lines, except
    that an empty input's first line reads ``0.0000<TAB>``.
    """
    if not scored:
        return [nbest[0].text if nbest else ""]
    out = [f"{t.score:.4f}\t{t.text}" for t in nbest[:n]]
    out.extend("-inf\t" for _ in range(n - len(out)))
    return out


def _stdin_lines() -> Iterable[str]:
    """Standard input's lines: a redirected file read straight through, a pipe or terminal as its
    lines arrive (each translated without waiting for a full window, see :class:`ArrivingLines`)."""
    stdin = sys.stdin.buffer
    try:
        regular = stat.S_ISREG(os.fstat(stdin.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):  # no descriptor (a test's stand-in stream)
        regular = True
    return iter_binary_lines(stdin, "<stdin>") if regular else ArrivingLines(stdin, "<stdin>")


def _is_regular(path: Path) -> bool:
    """A regular file (read straight through, counted for the progress bar), not a stream."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def open_inputs(inputs: Sequence[str | Path], stack: contextlib.ExitStack) -> list[tuple[str, Iterable[str]]]:
    """``(name, lines)`` of each input, or of standard input when there is none; every input is
    checked before any is read, with one line naming it (not found, a directory).

    A regular file is read as text (``.gz`` gunzipped); anything else a shell can name is read as
    the stream it is, its lines handed over as they arrive (:class:`ArrivingLines`): ``<(zcat
    news.gz)``, a named pipe, ``/dev/stdin``, ``/dev/null``. Streams are opened here (a named
    pipe's open waits for its writer) and closed by ``stack``."""
    for path in map(Path, inputs):
        if path.is_dir():
            raise DataError(f"{path}: is a directory, expected a text file")
        if not path.exists():
            raise DataError(f"{path}: input file not found")
    if not inputs:
        return [("<stdin>", _stdin_lines())]
    opened: list[tuple[str, Iterable[str]]] = []
    for path in map(Path, inputs):
        if _is_regular(path):
            opened.append((str(path), read_lines(path)))
            continue
        try:
            handle = stack.enter_context(open(path, "rb", buffering=0))
        except OSError as exc:
            raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None
        opened.append((str(path), ArrivingLines(handle, str(path))))
    return opened


def translate_files(
    run_dir: str | Path,
    inputs: list[Path],
    output: Path | None,
    checkpoint: str = "best",
    overrides: list[str] | None = None,
    plot_attention: Path | None = None,
    ensemble: Sequence[str | Path] = (),
) -> dict:
    """Translate files (or stdin when ``inputs`` is empty) to ``output`` (or stdout).

    Output format: one line per input line with the best translation; when ``--nbest N`` is
    given (a ``decode.nbest`` override), exactly ``N`` lines per input line instead, best first,
    each ``score<TAB>text`` with the length-penalised log-probability to 4 decimals (empty input
    lines give ``0.0000<TAB>`` then ``-inf<TAB>`` padding). Stdout gets each line as soon as it
    is ready; a file output is written to a temporary name and renamed at the end, so an error
    (e.g. invalid UTF-8 at some input line: :class:`DataError` naming file and line) leaves no
    partial file. ``plot_attention`` writes ``<DIR>/<line:06d>.png`` per non-empty input line.
    ``ensemble``: more members decoded with the run's model (run directories or checkpoint
    files, see :func:`mtcli.infer.ensemble.add_members`).
    Returns a summary dict (lines, checkpoint, seconds, sentences_per_s, output).
    """
    overrides = list(overrides or [])
    bundle = add_members(load_for_inference(run_dir, checkpoint), ensemble)
    decode = decode_config(bundle.config, overrides).decode
    device = decoding_device(decode)
    bundle.model.to(device)
    scored = any(o.split("=", 1)[0].strip() == "decode.nbest" for o in overrides)
    stack = contextlib.ExitStack()
    sources = open_inputs(inputs, stack)
    regular = bool(inputs) and all(_is_regular(Path(p)) for p in inputs)
    total = sum(count_lines(p) for p in inputs) if regular else None
    bar = progress(total=total, enabled=bool(inputs), unit="line", desc="translate")
    n_lines = 0
    start = time.perf_counter()

    def run(handle: IO[str], flush: bool) -> None:
        nonlocal n_lines
        for name, lines in sources:
            for nbest in translate_lines(bundle, lines, decode, device, name=name, on_done=bar.update,
                                         return_attention=plot_attention is not None):
                n_lines += 1
                handle.writelines(text + "\n" for text in format_nbest(nbest, decode.nbest, scored))
                if flush:
                    handle.flush()
                if plot_attention is not None and nbest[0].attention is not None:
                    _plot(bundle.tokenizer, nbest[0], Path(plot_attention) / f"{n_lines:06d}.png")

    try:
        if output is None:
            run(sys.stdout, flush=True)
        else:
            with atomic_write(output) as handle:
                run(handle, flush=False)
    finally:
        bar.close()
        stack.close()
    seconds = time.perf_counter() - start
    summary = {
        "lines": n_lines,
        "checkpoint": bundle.name,
        "seconds": round(seconds, 3),
        "sentences_per_s": round(n_lines / seconds, 2) if seconds > 0 else None,
        "output": str(output) if output is not None else "<stdout>",
    }
    get_logger().info("translated %d lines in %.1fs (%s sent/s) with %s", n_lines, seconds,
                      summary["sentences_per_s"], bundle.name)
    return summary


def _plot(tokenizer: Tokenizer, best: Translation, path: Path) -> None:
    """The cross-attention heatmap of one translation (:func:`mtcli.plots.plot_attention_png`)."""
    plot_attention_png(path, [tokenizer.id_to_piece(t) for t in best.source_tokens or []],
                       [tokenizer.id_to_piece(t) for t in best.tokens], best.attention)
