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
3. every batch is decoded with :func:`mtcli.search.generate` (greedy or beam, under bf16
   autocast when ``decode.bf16``; with an int8 copy of the model when ``decode.int8``, see
   :mod:`mtcli.quantize`); with ``decode.workers`` = N > 1, N batches at a time on N threads,
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from mtcli.allocator import keep_freed_memory
from mtcli.config import Config, DecodeConfig, config_from_dict
from mtcli.corpus import ArrivingLines, count_lines, iter_binary_lines, read_lines
from mtcli.device import resolve_device
from mtcli.errors import ConfigError, DataError
from mtcli.fileio import atomic_write
from mtcli.logs import get_logger, progress

if TYPE_CHECKING:
    from mtcli.search import Hypothesis

#: Lines read (and sorted by length) at a time; bounds memory independently of input length.
DEFAULT_WINDOW = 2000
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3  # same values as mtcli.tokenizer (fixed convention)


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


# --------------------------------------------------------------------------------------------
# Reading input strictly
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------


def source_limit(bundle: Any) -> int:
    """Longest source (in pieces, before ``</s>``) the model accepts: ``max_positions - 1``."""
    return int(bundle.model.max_positions) - 1


def make_batches(lengths: list[int], max_tokens: int, beam_size: int = 1) -> list[list[int]]:
    """Group indices sorted by length (longest first) so ``B * S_max * beam <= max_tokens``.

    ``S_max`` is the longest source in the batch counting ``</s>``; a sentence too long for the
    budget on its own still gets a batch of one. Every index appears in exactly one batch.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        size = lengths[i] + 1
        width = max(longest, size)
        if current and width * (len(current) + 1) * beam_size > max_tokens:
            batches.append(current)
            current, width = [], size
        current.append(i)
        longest = width
    if current:
        batches.append(current)
    return batches


def collate_sources(sources: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """Pad ``ids + [eos]`` sequences into a ``[B, S]`` long tensor (pad id 0)."""
    width = max(len(s) for s in sources) + 1
    batch = torch.full((len(sources), width), PAD_ID, dtype=torch.long)
    for row, ids in enumerate(sources):
        batch[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        batch[row, len(ids)] = EOS_ID
    return batch.to(device)


# --------------------------------------------------------------------------------------------
# Translating lines
# --------------------------------------------------------------------------------------------


def _autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _encode_all(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Ids of many lines at once when the tokenizer can batch them, else one by one."""
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode(text) for text in texts]


def translate_lines(
    bundle: Any,
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

    ``bundle`` is an :class:`mtcli.checkpoint.InferenceModel` or anything with ``.model`` (a
    :class:`mtcli.model.Transformer`) and ``.tokenizer`` (a :class:`mtcli.tokenizer.Tokenizer`),
    e.g. ``types.SimpleNamespace(model=m, tokenizer=t)`` during training. The model is put in
    eval mode while decoding and its previous mode restored afterwards. Lines are read
    ``window`` at a time (sorted by length inside the window only), so memory does not grow with
    the input; from an :class:`~mtcli.corpus.ArrivingLines` (stdin from a pipe or a terminal) a
    window is whatever has arrived, up to ``window`` lines, so each line of a slow producer is
    answered before the next is written. ``name`` prefixes the line numbers of truncation warnings. ``on_done(n)``, when
    given, is called as soon as ``n`` more lines are translated (empty lines, then batch by
    batch), before they can be yielded in order: a progress bar fed by it moves with the
    decoding instead of waiting for the window's first lines.
    """
    from mtcli.search import generate

    log = get_logger()
    device = torch.device(device)
    keep_freed_memory()
    model, tokenizer = bundle.model, bundle.tokenizer
    limit = source_limit(bundle)
    was_training = model.training
    model.eval()
    if decode.int8:
        from mtcli.ensemble import Ensemble, decoding_members
        from mtcli.quantize import quantize_for_decoding

        members = [quantize_for_decoding(m) for m in decoding_members(model)]
        model = Ensemble(members) if len(members) > 1 else members[0]
    threads = torch.get_num_threads()
    pool = None
    if decode.workers > 1:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(decode.workers, thread_name_prefix="mtcli-decode")
        torch.set_num_threads(max(1, threads // decode.workers))

    def decode_batch(indices: list[int]) -> list[list[Hypothesis]]:
        src = collate_sources([sources[i] for i in indices], device)
        with torch.inference_mode(), _autocast(device, decode.bf16):  # both are per thread
            return generate(
                model, src, beam_size=decode.beam_size, length_penalty=decode.length_penalty,
                max_len_a=decode.max_len_a, max_len_b=decode.max_len_b, nbest=decode.nbest,
                use_cache=use_cache, return_attention=return_attention,
                ensemble_mode=decode.ensemble_mode,
            )

    offset = 0
    try:
        for chunk in _windows(lines, window):
            results: list[list[Translation] | None] = [None] * len(chunk)
            sources: dict[int, list[int]] = {}
            nonempty = [i for i, line in enumerate(chunk) if line.strip()]
            encoded = dict(zip(nonempty, _encode_all(tokenizer, [chunk[i] for i in nonempty]), strict=True))
            for i in range(len(chunk)):
                ids = encoded.get(i) or []
                if not ids:
                    results[i] = [_empty_translation()]
                    continue
                if len(ids) > limit:
                    log.warning(
                        "%s: line %d: source has %d pieces, truncated to the model limit of %d",
                        name, offset + i + 1, len(ids), limit,
                    )
                    ids = ids[:limit]
                sources[i] = ids
            keys = list(sources)
            if on_done is not None and len(chunk) > len(keys):
                on_done(len(chunk) - len(keys))
            batches = make_batches([len(sources[k]) for k in keys], decode.max_tokens, decode.beam_size)
            emitted = 0
            while emitted < len(chunk) and results[emitted] is not None:
                yield results[emitted]  # type: ignore[misc]
                emitted += 1
            groups = [[keys[b] for b in batch] for batch in batches]
            decoded = pool.map(decode_batch, groups) if pool is not None else map(decode_batch, groups)
            for indices, hyps in zip(groups, decoded, strict=True):
                if on_done is not None:
                    on_done(len(indices))
                for i, nbest in zip(indices, hyps, strict=True):
                    results[i] = [
                        Translation(
                            text=tokenizer.decode(h.tokens),
                            score=float(h.score),
                            tokens=list(h.tokens),
                            logprob=float(h.logprob),
                            attention=h.attention.float().cpu() if h.attention is not None else None,
                            source_tokens=sources[i],
                        )
                        for h in nbest
                    ]
                while emitted < len(chunk) and results[emitted] is not None:
                    yield results[emitted]  # type: ignore[misc]
                    emitted += 1
            offset += len(chunk)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
            torch.set_num_threads(threads)
        bundle.model.train(was_training)


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
    bundle: Any, lines: list[str], decode: DecodeConfig, device: torch.device | str = "cpu"
) -> list[str]:
    """List in, list out: the best translation of every line (e.g. validation BLEU in training)."""
    return [nbest[0].text for nbest in translate_lines(bundle, lines, decode, device, window=len(lines) or 1)]


# --------------------------------------------------------------------------------------------
# The CLI command
# --------------------------------------------------------------------------------------------


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




def plot_attention_png(
    path: Path, src_pieces: list[str], tgt_pieces: list[str], attention: torch.Tensor
) -> None:
    """Write a PNG heatmap of cross-attention: one panel per decoder layer, head-averaged.

    ``attention`` is ``[layers, T, S]``; rows are target pieces (the output, then ``</s>``),
    columns source pieces (then ``</s>``); batch padding beyond them is dropped.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    att = attention.float().cpu().numpy()
    # Drop batch padding columns (and rows) beyond the pieces plus </s>.
    att = att[:, : len(tgt_pieces) + 1, : len(src_pieces) + 1]
    layers, t_len, s_len = att.shape
    xs = (src_pieces + ["</s>"] * s_len)[:s_len]
    ys = (tgt_pieces + ["</s>"] * t_len)[:t_len]
    fig, axes = plt.subplots(
        1, layers, figsize=(max(3.0, 0.35 * s_len + 1.5) * layers, max(2.5, 0.35 * t_len + 1.5)),
        squeeze=False,
    )
    for layer, ax in enumerate(axes[0]):
        image = ax.imshow(att[layer], aspect="auto", cmap="viridis", vmin=0.0)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        ax.set_title(f"decoder layer {layer + 1}")
        ax.set_xticks(range(s_len), xs, rotation=90, fontsize=7)
        ax.set_yticks(range(t_len), ys, fontsize=7)
        ax.set_xlabel("source")
        if layer == 0:
            ax.set_ylabel("target")
    fig.tight_layout()
    with atomic_write(path, "wb", encoding=None) as handle:
        fig.savefig(handle, format="png", dpi=100)
    plt.close(fig)


def _stdin_lines() -> Iterable[str]:
    """Standard input's lines: a redirected file read straight through, a pipe or terminal as its
    lines arrive (each translated without waiting for a full window, see :class:`ArrivingLines`)."""
    stdin = sys.stdin.buffer
    try:
        regular = stat.S_ISREG(os.fstat(stdin.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):  # no descriptor (a test's stand-in stream)
        regular = True
    return iter_binary_lines(stdin, "<stdin>") if regular else ArrivingLines(stdin, "<stdin>")


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
    files, see :func:`mtcli.ensemble.add_members`).
    Returns a summary dict (lines, checkpoint, seconds, sentences_per_s, output).
    """
    from mtcli.checkpoint import load_for_inference
    from mtcli.ensemble import add_members

    overrides = list(overrides or [])
    bundle = add_members(load_for_inference(run_dir, checkpoint), ensemble)
    config = decode_config(bundle.config, overrides)
    decode = config.decode
    device = decoding_device(decode)
    bundle.model.to(device)
    scored = any(o.split("=", 1)[0].strip() == "decode.nbest" for o in overrides)
    tokenizer = bundle.tokenizer
    for path in inputs:
        if not Path(path).is_file():
            raise DataError(f"{path}: input file not found")

    def sources() -> Iterator[tuple[str, Iterable[str], int]]:
        if not inputs:
            yield "<stdin>", _stdin_lines(), DEFAULT_WINDOW
        for path in inputs:
            yield str(path), read_lines(path), DEFAULT_WINDOW

    total = sum(count_lines(p) for p in inputs) if inputs else None
    bar = progress(total=total, enabled=bool(inputs), unit="line", desc="translate")
    n_lines = 0
    start = time.perf_counter()

    def run(handle: IO[str], flush: bool) -> None:
        nonlocal n_lines
        for name, lines, window in sources():
            for nbest in translate_lines(
                bundle, lines, decode, device,
                return_attention=plot_attention is not None, window=window, name=name,
                on_done=bar.update,
            ):
                n_lines += 1
                for text in format_nbest(nbest, decode.nbest, scored):
                    handle.write(text + "\n")
                if flush:
                    handle.flush()
                best = nbest[0]
                if plot_attention is not None and best.attention is not None:
                    plot_attention_png(
                        Path(plot_attention) / f"{n_lines:06d}.png",
                        [tokenizer.id_to_piece(t) for t in best.source_tokens or []],
                        [tokenizer.id_to_piece(t) for t in best.tokens],
                        best.attention,
                    )

    try:
        if output is None:
            run(sys.stdout, flush=True)
        else:
            with atomic_write(output) as handle:
                run(handle, flush=False)
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    summary = {
        "lines": n_lines,
        "checkpoint": bundle.name,
        "seconds": round(seconds, 3),
        "sentences_per_s": round(n_lines / seconds, 2) if seconds > 0 else None,
        "output": str(output) if output is not None else "<stdout>",
    }
    get_logger().info(
        "translated %d lines in %.1fs (%s sent/s) with %s", n_lines, seconds,
        summary["sentences_per_s"], bundle.name,
    )
    return summary

