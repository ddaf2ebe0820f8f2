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
   autocast when ``decode.bf16``; with the copy of the model :func:`model_for_decoding` makes:
   int8 when ``decode.int8`` (:mod:`mtcli.infer.quantize`), on a CPU in fp32 with its weights
   packed for oneDNN (:mod:`mtcli.infer.packed`)); with ``decode.workers`` = N > 1, N batches at a time on N threads,
   each with 1/N of torch's intra-op threads (small decoder steps scale better across batches
   than inside one matrix product); a batch that runs out of the device's memory is decoded
   again in halves (:func:`decode_fitting`);
4. results are put back in input order and yielded as soon as a contiguous prefix of the window
   is complete: one list of n-best :class:`Translation` per input line, line count in equals
   line count out.

Files and streams (``mtcli translate``) are read in :mod:`mtcli.infer.files`, and the Python API
over this module is :class:`mtcli.infer.translator.Translator`.
"""

from __future__ import annotations

import itertools
import re
import sys
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from mtcli.config import Config, DecodeConfig, config_from_dict, parse_override
from mtcli.data.batching import collate_sources, source_batch_tokens, source_batches
from mtcli.data.textio import ArrivingLines
from mtcli.data.tokenizer import Tokenizer
from mtcli.device import (
    MemoryBudget,
    autocast,
    in_budget_halves,
    memory_text,
    resolve_device,
)
from mtcli.errors import ConfigError
from mtcli.fileio import sha256_file
from mtcli.infer.ensemble import Ensemble, decoding_members
from mtcli.infer.loading import InferenceModel, source_prefix
from mtcli.infer.packed import pack_for_decoding
from mtcli.infer.quantize import quantize_for_decoding
from mtcli.infer.search import Hypothesis, Sampling, generate
from mtcli.infer.shortlist import Shortlist, shortlist_for
from mtcli.logs import get_logger
from mtcli.model import Transformer

#: Lines read (and sorted by length) at a time; bounds memory independently of input length.
DEFAULT_WINDOW = 2000


class _SharedThreads:
    """torch's intra-op threads, divided among ``decode.workers`` while any decoding with
    workers runs, and restored when the last one ends (the setting is the process's: decodings
    that overlap, from threads or from generators left open, must not restore it out of order)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved = 0

    def enter(self, workers: int) -> None:
        with self._lock:
            if self._users == 0:
                self._saved = torch.get_num_threads()
                torch.set_num_threads(max(1, self._saved // workers))
            self._users += 1

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                torch.set_num_threads(self._saved)


_SHARED_THREADS = _SharedThreads()


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


#: A source line longer than this many characters (or 64 a piece the model reads) is encoded
#: from its start only: far more than the pieces it is cut to, where encoding all of it took
#: some forty times its size in memory (a 190 MB line, a small .gz, ended the process).
HUGE_LINE_CHARS = 1_000_000


#: How many truncated lines of a window are said one by one; the rest in one line.
TRUNCATIONS_SAID = 3


def line_cap(limit: int) -> int:
    """The characters of a line encoded (:data:`HUGE_LINE_CHARS`, or 64 a piece the model reads)."""
    return max(HUGE_LINE_CHARS, 64 * limit)


def cut_size(text: str, ids: Sequence[int], cap: int) -> str:
    """How long a line cut short is, as its warning says it: in characters past ``cap``, else in pieces."""
    return f"{len(text):,} characters" if len(text) > cap else f"{len(ids)} pieces"


def warn_of_some(rows: Sequence[int], one: Callable[[int], str], rest: Callable[[int, str], str],
                 shown: Callable[[int], int] = int) -> None:
    """Warn of each of ``rows`` (lines cut short, say): the first :data:`TRUNCATIONS_SAID` one by
    one (``one(row)``), the rest in one line (``rest(how many, the first ten listed)``, each
    listed as ``shown(row)``)."""
    for row in rows[:TRUNCATIONS_SAID]:
        get_logger().warning("%s", one(row))
    more = rows[TRUNCATIONS_SAID:]
    if more:
        get_logger().warning("%s", rest(len(more), ", ".join(str(shown(row)) for row in more[:10])
                                        + (", ..." if len(more) > 10 else "")))

#: A target-language tag typed into a source line (``<2fr>``, Marian's ``>>fr<<``): text to the
#: tokenizer, which makes no tag of it.
_TYPED_TAG = re.compile(r"\s*(<2[A-Za-z][\w-]*>|>>[A-Za-z][\w-]*<<)")


def encode_window(tokenizer: Tokenizer, chunk: list[str], limit: int, name: str, offset: int,
                  prefix: Sequence[int] = ()) -> tuple[dict[int, list[int]], list[list[Translation] | None]]:
    """The source ids of a window's non-empty lines, after ``prefix`` (a target-language tag),
    truncated to ``limit`` with a warning naming the line, and the window's results with the
    empty lines' already filled in. A line of a window put after a tag that starts with a tag
    typed as text is warned of, once a window."""
    results: list[list[Translation] | None] = [None] * len(chunk)
    sources: dict[int, list[int]] = {}
    nonempty = [i for i, line in enumerate(chunk) if line.strip()]
    typed = next(((i, tag) for i in nonempty if (tag := _TYPED_TAG.match(chunk[i][:64]))), None) if prefix else None
    if typed is not None:
        get_logger().warning("%s: line %d starts with %s, which is read as text: the target language is chosen by "
                             "--tgt-lang (decode.tgt_lang; a request's tgt_lang)", name, offset + typed[0] + 1,
                             typed[1].group(1))
    cap = line_cap(limit)
    encoded = dict(zip(nonempty, tokenizer.encode_batch([chunk[i][:cap] for i in nonempty]), strict=True))
    cut: dict[int, str] = {}  # line number -> how long it was
    for i in range(len(chunk)):
        ids = encoded.get(i) or []
        if not ids:
            results[i] = [_empty_translation()]
            continue
        ids = [*prefix, *ids]
        if len(ids) > limit or len(chunk[i]) > cap:
            cut[offset + i + 1] = cut_size(chunk[i], ids, cap)
            ids = ids[:limit]
        sources[i] = ids
    warn_of_some(list(cut), lambda n: f"{name}: line {n}: source has {cut[n]}, truncated to the model limit of "
                 f"{limit} pieces", lambda k, listed: f"{name}: {k} more lines truncated to the model limit of "
                 f"{limit} pieces (lines {listed})")
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
    budget: MemoryBudget | None = None,
    offset: int = 0,
) -> Iterator[list[Translation]]:
    """Translate ``lines`` lazily; yield one n-best list of :class:`Translation` per line, in order.

    The model of ``bundle`` is put in eval mode while decoding and its previous mode restored
    afterwards. Lines are read ``window`` at a time (sorted by length inside the window only), so
    memory does not grow with the input; from an :class:`~mtcli.data.textio.ArrivingLines` (stdin
    from a pipe or a terminal) a window is whatever has arrived, up to ``window`` lines, so each
    line of a slow producer is answered before the next is written. ``name`` prefixes the line
    numbers of truncation warnings, counted from ``offset + 1`` (``lines`` without the first
    ``offset`` lines of that input). ``on_done(n)``, when given, is called as soon as ``n`` more
    lines are translated (empty lines, then batch by batch), before they can be yielded in order:
    a progress bar fed by it moves with the decoding instead of waiting for the window's first
    lines. ``budget``, when given, cuts the batches to at most its tokens (and
    ``decode.max_tokens``), and drops when a batch does not fit, so a caller that passes the same
    one to every call (a :class:`~mtcli.infer.translator.Translator` does) pays for a failed
    batch once; without it, the lowered size lasts this call.
    """
    device = torch.device(device)
    model, tokenizer = bundle.model, bundle.tokenizer
    limit = source_limit(bundle)
    prefix = source_prefix(bundle, decode)
    was_training = model.training
    model.eval()
    model = model_for_decoding(model, decode, device)
    shortlist = run_shortlist(bundle, decode)
    pool = None
    if decode.workers > 1:
        pool = ThreadPoolExecutor(decode.workers, thread_name_prefix="mtcli-decode")
        _SHARED_THREADS.enter(decode.workers)

    search = _search(model, decode, device, shortlist, use_cache=use_cache, return_attention=return_attention)
    budget = budget if budget is not None else MemoryBudget()  # lowered when a batch does not fit

    def decode_batch(sources: list[list[int]]) -> list[list[Hypothesis]]:
        return decode_fitting(search, sources, decode, device, budget)

    try:
        for chunk in line_windows(lines, window):
            sources, results = encode_window(tokenizer, chunk, limit, name, offset, prefix)
            keys = list(sources)
            if on_done is not None and len(chunk) > len(keys):
                on_done(len(chunk) - len(keys))
            groups = [[keys[b] for b in batch]
                      for batch in source_batches([len(sources[k]) for k in keys],
                                                  min(budget.tokens, decode.max_tokens), decode.beam_size)]
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
        if pool is not None and not sys.is_finalizing():  # (a generator left open until the interpreter's
            pool.shutdown(wait=True, cancel_futures=True)  # exit: concurrent.futures joins its threads then)
            _SHARED_THREADS.leave()
        if was_training:  # (a translator's model is in eval mode: nothing to do, at exit either)
            bundle.model.train()


def _search(model: torch.nn.Module, decode: DecodeConfig, device: torch.device, shortlist: Shortlist | None, *,
            use_cache: bool, return_attention: bool) -> Callable[[torch.Tensor], list[list[Hypothesis]]]:
    """The search of ``decode`` over a collated batch of sources (beam, greedy or sampling)."""
    sample = None if decode.sampling == "none" else Sampling(
        decode.sampling, decode.topk, decode.topp, decode.temperature, decode.seed)

    def search(src: torch.Tensor) -> list[list[Hypothesis]]:
        with torch.inference_mode(), autocast(device, decode.bf16):  # both are per thread
            return generate(
                model, src, beam_size=decode.beam_size, length_penalty=decode.length_penalty,
                max_len_a=decode.max_len_a, max_len_b=decode.max_len_b, nbest=decode.nbest,
                use_cache=use_cache, return_attention=return_attention,
                ensemble_mode=decode.ensemble_mode, shortlist=shortlist, sample=sample,
            )

    return search


def decode_fitting(search: Callable[[torch.Tensor], list[list[Hypothesis]]], sources: list[list[int]],
                   decode: DecodeConfig, device: torch.device, budget: MemoryBudget) -> list[list[Hypothesis]]:
    """``search`` over ``sources`` collated on ``device``. A batch that runs out of the device's
    memory is decoded again in two halves, each in turn, so that a long job goes on (a warning
    names ``decode.max_tokens``, which made the batch), and ``budget``, the tokens the next
    batches are cut to, drops to half the failed batch's (:class:`~mtcli.device.MemoryBudget`); one sentence that does not fit alone
    raises :class:`~mtcli.errors.DeviceMemoryError` naming the beam. A batch over the budget
    (cut before it dropped: the failed batch's other half, the rest of its window) is cut to it
    before it is tried, so once a batch has fitted no other fails. A sentence's hypotheses do not
    depend on the batch it is decoded in (up to floating-point rounding)."""
    def failed(part: list[list[int]]) -> str:
        return (f"out of memory on {memory_text(device)} decoding {len(part)} sentence(s) of up to "
                f"{max(map(len, part))} pieces with beam {decode.beam_size}")

    def halving(part: list[list[int]], where: str) -> None:
        get_logger().warning("%s: decoding them in two halves (a lower decode.max_tokens, now %d, avoids this)",
                             where, decode.max_tokens)

    return in_budget_halves(lambda part: search(collate_sources(part, device)), sources, budget,
                            lambda part: source_batch_tokens([len(ids) for ids in part], decode.beam_size),
                            lambda part, tokens: source_batches([len(ids) for ids in part], tokens, decode.beam_size),
                            failed, "lower the beam (decode.beam_size, --beam)", halving)


def _ready(results: list[list[Translation] | None], start: int
           ) -> Generator[list[Translation], None, int]:
    """Yield the finished results from ``start`` on, up to the first unfinished one; return the
    index of that one (how far the window's results have been handed over, in order)."""
    while start < len(results) and results[start] is not None:
        yield results[start]  # type: ignore[misc]
        start += 1
    return start


def line_windows(lines: Iterable[str], window: int) -> Iterator[list[str]]:
    """``lines`` in lists of ``window`` (the last shorter); an :class:`ArrivingLines` hands over
    what has arrived instead of waiting for a full window."""
    if isinstance(lines, ArrivingLines):
        yield from lines.windows(window)
        return
    iterator = iter(lines)
    while chunk := list(itertools.islice(iterator, max(1, window))):
        yield chunk


def translate_texts(
    bundle: InferenceModel, lines: list[str], decode: DecodeConfig, device: torch.device | str = "cpu",
    name: str = "input",
) -> list[str]:
    """List in, list out: the best translation of every line (e.g. validation BLEU in training;
    ``name``: the file the lines came from, which a truncation warning names)."""
    return [nbest[0].text for nbest in translate_lines(bundle, lines, decode, device, window=len(lines) or 1,
                                                       name=name)]


def model_for_decoding(
    model: Transformer | Ensemble, decode: DecodeConfig, device: torch.device | str
) -> Transformer | Ensemble:
    """The model as decoding runs it: an int8 copy under ``decode.int8``; on a CPU a copy with
    every weight packed for oneDNN's kernels, in fp32 (same products, faster) or, under
    ``decode.bf16``, in bf16; else ``model`` itself.

    A model already made for decoding (its output product replaced) is returned as it is, so a
    caller can make the copy once and keep it (:class:`~mtcli.infer.translator.Translator`)."""
    members = decoding_members(model)
    if not all(isinstance(m, Transformer) and m.output_product is None for m in members):
        return model
    if decode.int8:
        members = [quantize_for_decoding(m) for m in members]
    elif torch.device(device).type == "cpu":
        members = [pack_for_decoding(m, torch.bfloat16 if decode.bf16 else torch.float32)
                   for m in members]
    else:
        return model
    return Ensemble(members) if len(members) > 1 else members[0]


def run_shortlist(bundle: InferenceModel, decode: DecodeConfig) -> Shortlist | None:
    """The lexical shortlist ``decode.shortlist`` asks for (None when it is 0), built once per
    run and setting from the run's training data and kept on ``bundle``."""
    if decode.shortlist <= 0:
        return None
    key = (decode.shortlist, decode.shortlist_frequent)
    if key not in bundle.shortlists:
        bundle.shortlists[key] = shortlist_for(bundle.config, *key, sha256_file(bundle.tokenizer.model_path))
    return bundle.shortlists[key]


def decoding_device(decode: DecodeConfig) -> torch.device:
    """Where to decode: the CPU under ``decode.int8`` (its int8 kernels are CPU kernels), else
    the first CUDA device when there is one, else the CPU."""
    return torch.device("cpu") if decode.int8 else resolve_device("auto")


def override_keys(overrides: Sequence[str]) -> set[str]:
    """The dotted keys ``--set`` strings name (``decode.beam_size=4`` -> ``decode.beam_size``)."""
    return {text.split("=", 1)[0].strip() for text in overrides}


def decode_config(config: Config, overrides: list[str]) -> Config:
    """Apply ``decode.*`` ``--set`` overrides to a run's config (other sections are refused).
    A ``decode.nbest`` wider than the beam, given without a beam, widens it, as ``--nbest`` does."""
    given: dict[str, Any] = {}
    for text in overrides:
        section, key, value = parse_override(text)
        if section != "decode":  # a malformed one is said as train says it
            raise ConfigError(f"--set {text!r}: only decode.* keys can be set when decoding")
        given[key] = value
    n = given.get("nbest")
    if "beam_size" not in given and type(n) is int and n > config.decode.beam_size and \
            given.get("sampling", config.decode.sampling) == "none":
        overrides = [*overrides, f"decode.beam_size={n}"]
    return config_from_dict(config.to_dict(), config.path, overrides)
