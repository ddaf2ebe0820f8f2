"""``--engine ctranslate2``: decode a run with CTranslate2 instead of our own search.

The weights loaded from the run's checkpoint are converted once
(:func:`mtcli.infer.export.save_ctranslate2`) into ``<run_dir>/ctranslate2/<sha256 of the
weights, 16 hex digits>/`` (the checkpoint's payload, as its header records it; an average of
checkpoints, its tensors'; for a run this user cannot write, under :func:`user_conversions`) and
reused while the checkpoint holds the same weights; when it changes (a longer run, another checkpoint) the
next use converts it again, and the conversions of the three checkpoints used last are kept.
A kept conversion whose ``model.bin`` is not the file converted (its sha256 is in the record), or
that CTranslate2 cannot read, is converted again (:func:`open_engine`). :class:`CT2Engine` then translates lines
as :func:`mtcli.infer.translate.translate_lines` does: windows of lines, empty lines answered
without the model, sources truncated to the model's limit with a warning, n-best lists of
:class:`~mtcli.infer.translate.Translation` in input order.

What matches and what does not:

* a line's output never depends on the lines decoded with it: CTranslate2 takes one output
  limit a call, so the lines of a window are decoded in groups that share our per-sentence limit
  ``max_len_a * S + max_len_b``;
* greedy search gives our tokens exactly (the model and the argmax are the same);
* beam search may differ: CTranslate2 normalises a hypothesis' score by ``length^alpha``
  (``length_penalty``), ours by GNMT's ``((5 + length) / 6)^alpha``, and the two searches stop
  by different rules, so some lines differ even with alpha = 0 (both rank by log-probability);
* ``decode.int8`` maps to ``compute_type="int8"`` and ``decode.bf16`` to ``"bfloat16"``;
  ``Translation.score`` is what CTranslate2 ranked by, and ``Translation.logprob`` its
  log-probability of the hypothesis: with pad and ``<s>`` suppressed, CTranslate2 leaves them out
  of each step's softmax, so a hypothesis that ended scores slightly higher than the model's own
  log-probability (ours); a hypothesis cut at the length limit is scored by teacher forcing over
  the whole vocabulary (:meth:`CT2Engine._score_cut`). Scoring every hypothesis so would cost
  about one more greedy pass.

CTranslate2 cuts a window into batches of ``decode.max_tokens`` source tokens. When a window runs
out of the device's memory, it is decoded again with half the tokens a batch, and the engine keeps
the smaller batches from then on (a warning names ``decode.max_tokens``), trying larger ones again
after a run of windows that fit (:class:`~mtcli.device.MemoryBudget`); when batches of one
sentence still do not fit, :class:`~mtcli.errors.DeviceMemoryError` names the beam.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from mtcli.config import DecodeConfig
from mtcli.data.tokenizer import EOS_ID
from mtcli.device import MemoryBudget, is_out_of_memory, memory_text
from mtcli.errors import CheckpointError, ConfigError, DeviceMemoryError, one_line
from mtcli.fileio import can_write_into, sha256_file
from mtcli.infer.export import (
    CT2_DIR,
    EXPORT_RECORD,
    check_convertible,
    require_ctranslate2,
    save_ctranslate2,
)
from mtcli.infer.loading import InferenceModel, source_prefix
from mtcli.infer.search import check_beam_width
from mtcli.infer.translate import Translation, encode_window, line_windows, source_limit
from mtcli.logs import get_logger

ENGINES = ("torch", "ctranslate2")


def converted_model(run_dir: Path, bundle: InferenceModel) -> Path:
    """The CTranslate2 conversion of ``bundle``'s weights in ``run_dir/ctranslate2/`` (or, for a
    run this user cannot write, in :func:`user_conversions`), made from them if needed (never from
    the checkpoint file read again, which a training run may have replaced since)."""
    digest = bundle.payload_sha256 or bundle.weights_sha256  # a checkpoint file's, else an average's
    if digest is None:
        raise ConfigError("--engine ctranslate2 decodes one model, not an ensemble")
    key = digest[:16]
    roots = [Path(run_dir) / CT2_DIR, user_conversions(run_dir)]
    for root in roots:
        if _kept(root / key, digest):
            with contextlib.suppress(OSError):  # in use: kept among the newest (a read-only run: as it is)
                os.utime(root / key)
            return root / key
    root = next((root for root in roots if can_write_into(root)), None)
    if root is None:
        raise ConfigError(f"--engine ctranslate2 converts {bundle.name} once, but neither {roots[0]} nor "
                          f"{roots[1]} can be written: set XDG_CACHE_HOME to a writable directory, or "
                          "decode with --engine torch")
    target = root / key
    if target.exists():  # another checkpoint's weights under this one's name (an export there), or an older mtcli's
        shutil.rmtree(target, ignore_errors=True)
    check_convertible(bundle, Path(run_dir))  # before saying it converts
    get_logger().info("converting %s for CTranslate2 into %s (once for these weights)", bundle.name, target)
    save_ctranslate2(bundle, target, Path(run_dir))
    _remove_old_conversions(root)
    return target


def user_conversions(run_dir: Path) -> Path:
    """Where the conversions of a run this user cannot write go (a model shared read-only, a
    container's read-only volume): ``$XDG_CACHE_HOME/mtcli/ctranslate2/<run key>`` (default
    ``~/.cache``), the run key the first 16 hex digits of the sha256 of the run's absolute path."""
    home = os.path.expanduser("~")  # ("~" itself with no HOME and no passwd entry: the temporary directory's)
    cache = os.environ.get("XDG_CACHE_HOME") or (os.path.join(home, ".cache") if home != "~" else
                                                 os.path.join(tempfile.gettempdir(), f"mtcli-{os.getuid()}"))
    run_key = hashlib.sha256(str(Path(run_dir).resolve()).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return Path(cache) / "mtcli" / CT2_DIR / run_key


def _kept(target: Path, digest: str) -> bool:
    """Whether ``target`` holds the conversion of the weights of ``digest``, its ``model.bin``
    the bytes written then (a conversion damaged since, or from before its record held their
    sha256, is converted again: CTranslate2 reads a flipped byte without a word)."""
    try:
        record = json.loads((target / EXPORT_RECORD).read_text("utf-8"))
        if digest not in (record.get("checkpoint_payload_sha256"), record.get("weights_sha256")):
            return False
        if record.get("model_bin_sha256") == sha256_file(target / "model.bin"):
            return True
    except (OSError, ValueError, AttributeError):
        return False
    if "model_bin_sha256" in record:
        get_logger().warning("%s: model.bin is not the file converted (damaged since): converting again", target)
    return False


#: How many conversions a run keeps: those of the checkpoints used last (best and last, say, by
#: two servers), each as large as the model; older ones are removed.
KEPT_CONVERSIONS = 3


def _is_conversion(entry: Path) -> bool:
    """Whether ``entry`` is one of :func:`converted_model`'s (named by the digest its record
    holds), not a directory a user put there (``mtcli export RUN RUN/ctranslate2/mine``)."""
    if not (entry.is_dir() and re.fullmatch(r"[0-9a-f]{16}", entry.name)):
        return False
    try:
        record = json.loads((entry / EXPORT_RECORD).read_text("utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict):
        return False
    # (an average's is named by its weights' sha256; an older mtcli's conversion, by neither)
    digest = record.get("checkpoint_payload_sha256") or record.get("weights_sha256")
    return str(digest).startswith(entry.name) if digest else record.get("format") == "ctranslate2"


def _remove_old_conversions(root: Path) -> None:
    """Remove all but the :data:`KEPT_CONVERSIONS` conversions under ``root`` used last: two
    processes decoding two checkpoints of one run each keep theirs (each removing the other's
    converted it again at every start, or removed it while the other opened it)."""
    found = []
    for entry in root.iterdir():
        with contextlib.suppress(OSError):
            if _is_conversion(entry):
                found.append((entry.stat().st_mtime, entry))
    for _, old in sorted(found, reverse=True)[KEPT_CONVERSIONS:]:
        shutil.rmtree(old, ignore_errors=True)


def open_engine(run_dir: Path, bundle: InferenceModel, device: torch.device, decode: DecodeConfig) -> CT2Engine:
    """A :class:`CT2Engine` over the conversion of ``bundle``'s weights (:func:`converted_model`).
    A kept conversion that CTranslate2 cannot read (a file damaged since, or cut short by a full
    disk) is made again, once, with a warning; it is only ever derived from the weights."""
    _check_compute_type(device, decode)
    with _opening(run_dir):  # threads of one process: one converts, the others then find its conversion
        for again in (False, True):
            model_dir = converted_model(run_dir, bundle)
            try:
                engine = CT2Engine(model_dir, bundle, device, decode, run_dir)
                engine.probe()
                return engine
            except (RuntimeError, ValueError) as exc:
                if is_out_of_memory(exc):
                    raise DeviceMemoryError(f"out of memory on {memory_text(device)} loading the CTranslate2 "
                                            f"conversion of {bundle.name}") from None
                if again:
                    raise CheckpointError(f"{model_dir}: CTranslate2 cannot read the conversion of {bundle.name} "
                                          f"({one_line(exc)})") from None
                get_logger().warning("%s: CTranslate2 cannot read this conversion (%s): converting %s again",
                                     model_dir, one_line(exc), bundle.name)
            shutil.rmtree(model_dir, ignore_errors=True)  # another process may have made it again meanwhile
    raise AssertionError("unreachable")


_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _opening(run_dir: Path) -> threading.Lock:
    """The lock a thread holds while it converts or opens a conversion of ``run_dir``'s (one a
    run: a server opening another run's conversion does not wait out this one's; other processes
    are kept apart by the conversion's build under a name of its own, swapped in whole)."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(str(Path(run_dir).resolve()), threading.Lock())


def _compute_type(decode: DecodeConfig) -> str:
    """CTranslate2's compute type for ``decode``: ``int8`` under ``decode.int8``, ``bfloat16``
    under ``decode.bf16``, else the model's own."""
    return "int8" if decode.int8 else "bfloat16" if decode.bf16 else "default"


def _check_compute_type(device: torch.device, decode: DecodeConfig) -> None:
    """:class:`ConfigError` naming the setting when CTranslate2 cannot compute in its type on
    ``device`` (bf16 on a CPU it has no bf16 kernels for): its error read as a damaged conversion."""
    compute = _compute_type(decode)
    if compute == "default":
        return
    try:
        supported = require_ctranslate2().get_supported_compute_types(device.type, device.index or 0)
    except RuntimeError as exc:  # a CUDA torch sees but CTranslate2 cannot use (its driver too old)
        raise ConfigError(f"--engine ctranslate2 cannot use {device} ({one_line(exc)}); decode with --engine "
                          "torch, or on --device cpu") from None
    if compute not in supported:
        key = "decode.int8" if decode.int8 else "decode.bf16"
        raise ConfigError(f"{key}: CTranslate2 cannot compute in {compute} on this {device.type} (it can in "
                          f"{', '.join(sorted(supported))}); set {key}=false, or decode with --engine torch")


def check_supported(decode: DecodeConfig) -> None:
    """Raise :class:`ConfigError` for a decode setting CTranslate2 cannot honour: our
    ``shortlist`` (it has none)."""
    if decode.shortlist > 0:
        raise ConfigError("decode.shortlist is not available with --engine ctranslate2 "
                          "(add --set decode.shortlist=0, or decode with --engine torch)")


@functools.cache
def _warn_unseeded() -> None:
    get_logger().warning("--engine ctranslate2 samples are not reproducible: decode.seed applies to the "
                         "torch engine only (decode with --engine torch for seeded samples)")


class CT2Engine:
    """A ``ctranslate2.Translator`` over a converted run, with the run's tokenizer."""

    def __init__(self, model_dir: Path, bundle: InferenceModel, device: torch.device, decode: DecodeConfig,
                 run_dir: Path) -> None:
        self.model_dir = Path(model_dir).absolute()  # run_dir/ctranslate2/<key>, or the user's cache
        self.run_dir = Path(run_dir).absolute()  # (what a copy converts for again)
        self.bundle = bundle
        self.device = device
        self.compute = _compute_type(decode)
        self.budget = MemoryBudget()  # the batch size in tokens known to fit, once one did not
        self.translator = self._open()

    def _open(self) -> Any:
        """The ``ctranslate2.Translator`` over :attr:`model_dir`."""
        return require_ctranslate2().Translator(
            str(self.model_dir), device=self.device.type, device_index=self.device.index or 0,
            compute_type=self.compute, intra_threads=torch.get_num_threads() if self.device.type == "cpu" else 0,
        )

    def probe(self) -> None:
        """Decode one token of two sources of two lengths (padded, as real batches are): a
        conversion whose files load but do not fit (a vocabulary without ``<blank>``) fails
        here, where it is converted again, not at the first line."""
        self.translator.translate_batch([["</s>"], ["</s>", "</s>"]], max_decoding_length=1, min_decoding_length=0,
                                        suppress_sequences=[["<blank>"], ["<s>"]])

    def __getstate__(self) -> dict[str, Any]:
        """For pickle and deepcopy (of a :class:`~mtcli.infer.translator.Translator`): CTranslate2's
        translator cannot be serialised, so the copy opens the conversion again (made again from
        the weights, when another checkpoint's conversion has replaced it since)."""
        return {key: value for key, value in self.__dict__.items() if key != "translator"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.model_dir = converted_model(self.run_dir, self.bundle)
        self.translator = self._open()

    def translate_lines(self, lines: Iterable[str], decode: DecodeConfig, *, name: str = "input",
                        window: int = 2000, on_done: Callable[[int], None] | None = None, offset: int = 0
                        ) -> Iterator[list[Translation]]:
        """One n-best list per line of ``lines``, in order (see the module docstring; line numbers
        in warnings count from ``offset + 1``)."""
        check_supported(decode)
        tokenizer, limit = self.bundle.tokenizer, source_limit(self.bundle)
        prefix = source_prefix(self.bundle, decode)
        for chunk in line_windows(lines, window):
            sources, results = encode_window(tokenizer, chunk, limit, name, offset, prefix)
            if sources:
                self._decode_window(sources, results, decode)
            if on_done is not None:
                on_done(len(chunk))
            offset += len(chunk)
            yield from results  # type: ignore[misc]

    def _decode_window(self, sources: dict[int, list[int]], results: list[Any], decode: DecodeConfig) -> None:
        """Fill ``results`` with the n-best lists of a window's ``sources`` (line -> piece ids).
        CTranslate2 takes one output limit a call, so the lines are decoded in groups of one
        limit each: a line's search then ends where ours ends it, whatever lines it is decoded
        with (one limit for a whole batch kept long hypotheses of short lines in the beam). A beam
        search returns its whole beam, ranked again once the hypotheses cut at the limit are
        scored with their end, then cut to ``decode.nbest``: so a line's best translation does not
        depend on how many were asked for (CTranslate2 ranks a cut hypothesis without its end)."""
        tokenizer = self.bundle.tokenizer
        pieces = {k: [tokenizer.id_to_piece(i) for i in ids] for k, ids in sources.items()}
        groups: dict[int, list[int]] = {}
        for k in sources:
            groups.setdefault(self._limit(len(pieces[k]), decode), []).append(k)
        cut: list[tuple[int, int, list[str]]] = []  # (line, hypothesis, source pieces)
        for limit, keys in groups.items():
            outputs = self._translate_fitting(
                [pieces[k] for k in keys], decode,
                num_hypotheses=decode.nbest if decode.sampling != "none" else decode.beam_size,
                length_penalty=decode.length_penalty, max_decoding_length=limit,
                min_decoding_length=0, return_scores=True, return_end_token=True,
                suppress_sequences=[["<blank>"], ["<s>"]], **self._search(decode, self.bundle.model.output_size),
            )
            for k, out in zip(keys, outputs, strict=True):
                results[k], ran_out = self._translations(out, sources[k], limit, decode.length_penalty)
                cut += [(k, j, pieces[k]) for j in ran_out]
        if cut:
            self._score_cut(results, cut, decode)
        for k in sources:
            del results[k][decode.nbest:]

    def _translate_fitting(self, batch: list[list[str]], decode: DecodeConfig, **options: Any) -> list[Any]:
        """CTranslate2's ``translate_batch`` over ``batch`` in batches of ``decode.max_tokens``
        source tokens, halved while the device runs out of memory (see the module docstring)."""
        while True:
            tokens = min(decode.max_tokens, self.budget.tokens)
            try:
                found = self.translator.translate_batch(batch, max_batch_size=tokens, batch_type="tokens", **options)
                self.budget.fitted(tokens)
                return found
            except (RuntimeError, MemoryError) as exc:
                if not is_out_of_memory(exc):
                    raise
                where = (f"out of memory on {memory_text(self.device)} decoding with CTranslate2 in batches "
                         f"of {tokens} tokens, beam {options['beam_size']}")
                if tokens <= max(map(len, batch)):  # every batch is one sentence already
                    raise DeviceMemoryError(f"{where}: lower the beam (decode.beam_size, --beam)") from None
            self.budget.lower(tokens)
            get_logger().warning("%s: decoding in batches of %d tokens from now on (a lower decode.max_tokens, "
                                 "now %d, avoids this)", where, self.budget.tokens, decode.max_tokens)

    @staticmethod
    def _search(decode: DecodeConfig, output_size: int) -> dict[str, Any]:
        """CTranslate2's search options: beam search (as wide as the torch engine allows), or
        sampling. CTranslate2's samples cannot be seeded (its translator threads draw from
        generators of their own: set_random_seed does not reach them), so a warning says so
        once; the torch engine's samples are seeded."""
        if decode.sampling == "none":
            check_beam_width(decode.beam_size, output_size)
            return {"beam_size": decode.beam_size}
        _warn_unseeded()
        return {"beam_size": 1, "sampling_topk": decode.topk if decode.sampling == "topk" else 0,
                "sampling_topp": decode.topp if decode.sampling == "topp" else 1.0,
                "sampling_temperature": decode.temperature}

    def _limit(self, source_length: int, decode: DecodeConfig) -> int:
        """Output tokens a source may get: ``max_len_a * S + max_len_b``, capped as our search
        caps it (the start token and the output must fit the model's positions)."""
        most = int(self.bundle.model.max_positions) - 1
        return max(1, min(most, int(decode.max_len_a * source_length + decode.max_len_b)))

    def _translations(self, out: Any, source: list[int], limit: int,
                      length_penalty: float) -> tuple[list[Translation], list[int]]:
        """One line's n-best list, and the hypotheses in it that ran into the line's limit
        without an end: those are ended, as our search ends them, and :meth:`_score_cut` gives
        their log-probability. CTranslate2's score is the hypothesis' log-probability over its
        length (its end token counted) to the power ``length_penalty``: the log-probability is
        that score times the power."""
        tokenizer = self.bundle.tokenizer
        end = tokenizer.id_to_piece(EOS_ID)
        found, cut = [], []
        for pieces, score in zip(out.hypotheses, out.scores, strict=True):
            logprob = float(score) * max(1, len(pieces)) ** length_penalty
            ended = bool(pieces) and pieces[-1] == end
            pieces = pieces[:-1] if ended else pieces
            if len(pieces) > limit or not ended:  # run into the limit
                pieces = pieces[:limit]
                cut.append(len(found))
            ids = [tokenizer.piece_to_id(p) for p in pieces]
            found.append(Translation(text=tokenizer.decode(ids), score=float(score), tokens=ids,
                                     logprob=logprob, source_tokens=source))
        return found, cut

    def _score_cut(self, results: list[Any], cut: list[tuple[int, int, list[str]]], decode: DecodeConfig) -> None:
        """The log-probability of each cut hypothesis (``(line, hypothesis, source pieces)``) of a
        window: its pieces and the end token, scored by CTranslate2 by teacher forcing in one call;
        its score follows from it as CTranslate2's does (over its length with the end token, as an
        ended hypothesis' score), and each n-best list of a search it
        changed is sorted best first again (samples too: CTranslate2 gives them sorted by score)."""
        tokenizer = self.bundle.tokenizer
        targets = [[tokenizer.id_to_piece(i) for i in results[k][j].tokens] for k, j, _ in cut]
        scored = self.translator.score_batch([pieces for _, _, pieces in cut], targets, batch_type="tokens",
                                             max_batch_size=min(decode.max_tokens, self.budget.tokens))
        for (k, j, _), result in zip(cut, scored, strict=True):
            hypothesis = results[k][j]
            logprob = float(sum(result.log_probs))  # the end token's too, as our search ends a cut output
            results[k][j] = dataclasses.replace(
                hypothesis, logprob=logprob, score=logprob / (len(hypothesis.tokens) + 1) ** decode.length_penalty)
        for k in {k for k, _, _ in cut}:
            results[k].sort(key=lambda translation: -translation.score)


__all__ = ["CT2_DIR", "CT2Engine", "ENGINES", "converted_model", "open_engine"]
