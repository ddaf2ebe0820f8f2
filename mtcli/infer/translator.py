"""``mtcli.Translator``: a trained model, loaded once, translating from Python.

    >>> from mtcli import Translator
    >>> translator = Translator.from_run("data/runs/multi30k_de_en", beam=5)
    >>> translator.translate(["Ein Hund läuft im Schnee."])  # -> a list with one English line

Every way mtcli decodes goes through this class: ``mtcli translate`` and ``mtcli evaluate``
build a :class:`Translator` and call :meth:`Translator.stream`, which is
:func:`mtcli.infer.translate.translate_lines` with the loaded model, its tokenizer, the decode
settings and the device. The other methods are views of it: :meth:`translate` (list in, list
out), :meth:`translate_iter` (streamed, in order), :meth:`nbest` (hypotheses with scores), and
:meth:`score`, which runs no search: the model's log-probability of given translations.

Decode settings come from the run's ``decode`` section; :meth:`from_run` and every method take
the common ones as typed keywords (``beam``, ``length_penalty``, ``max_tokens``, ...), checked as
a value in a config file is; ``--set decode.*`` strings are for the command line (``overrides``).

A batch that runs out of the device's memory is decoded again in halves, and every later batch
of the translator (this call's, and later calls', as under ``mtcli serve``) is cut to half the
failed one's tokens, so a server pays for a failed batch once, not once a request.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mtcli.allocator import release_freed_memory
from mtcli.config import DecodeConfig, with_changes
from mtcli.data.batching import collate, source_batch_tokens, source_batches
from mtcli.data.textio import ArrivingLines, check_unicode
from mtcli.device import (
    MemoryBudget,
    autocast,
    device_has_bf16_units,
    in_budget_halves,
    memory_text,
    resolve_device,
)
from mtcli.errors import ConfigError, DataError
from mtcli.infer.ct2 import ENGINES, CT2Engine, check_supported, open_engine
from mtcli.infer.ensemble import Ensemble, add_members
from mtcli.infer.export import require_ctranslate2
from mtcli.infer.loading import (
    InferenceModel,
    load_for_inference,
    source_prefix,
)
from mtcli.infer.search import check_beam_width
from mtcli.infer.translate import (
    DEFAULT_WINDOW,
    Translation,
    cut_size,
    decode_config,
    decoding_device,
    line_cap,
    model_for_decoding,
    override_keys,
    run_shortlist,
    source_limit,
    translate_lines,
    warn_of_some,
)
from mtcli.logs import get_logger

#: Keyword -> ``decode.*`` key, for the settings every method accepts.
SETTINGS = {"beam": "beam_size", "length_penalty": "length_penalty",
            "max_tokens": "max_tokens",
            "nbest": "nbest", "max_len_a": "max_len_a", "max_len_b": "max_len_b",
            "int8": "int8", "bf16": "bf16", "workers": "workers", "shortlist": "shortlist",
            "sampling": "sampling", "topk": "topk", "topp": "topp", "temperature": "temperature",
            "seed": "seed", "tgt_lang": "tgt_lang"}


def _changes(settings: dict[str, Any]) -> dict[str, Any]:
    """``decode.*`` keys and values for keyword settings (None: unchanged); a TypeError names
    an unknown keyword."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise TypeError(f"unknown decode setting(s) {', '.join(unknown)} (known: {', '.join(SETTINGS)})")
    return {SETTINGS[k]: v for k, v in settings.items() if v is not None}


def _no_nbest(settings: dict[str, Any], method: str, why: str = "") -> None:
    """Refuse an ``nbest`` setting where it means nothing: :meth:`Translator.translate` gives
    one translation a text (it widened the beam to ``nbest``, unsaid)."""
    if settings.get("nbest") is not None:
        raise ConfigError(f"{method}() takes no nbest setting{why or '; Translator.nbest(texts, n) gives n hypotheses'}")


def _fitted(changes: dict[str, Any], base: DecodeConfig, beam_fixed: bool = False,
            nbest_fixed: bool = False) -> dict[str, Any]:
    """``changes`` (to ``base``) with the beam and the n-best made to fit each other, as a search
    needs (``nbest <= beam_size``): a beam given alone narrows the n-best with it (unless
    ``nbest_fixed``: an n-best set by ``--set``, then refused beside a narrower beam); an n-best
    given alone, wider than the beam, widens the beam to it (unless ``beam_fixed``: a beam set
    by ``--set``, which is then refused as given). Sampling keeps no beam: left as asked; a
    search asked of a translator that samples narrows its count of samples to the beam."""
    if changes.get("sampling", base.sampling) != "none":
        return changes
    beam, n = changes.get("beam_size"), changes.get("nbest")
    if isinstance(beam, int) and n is None:
        return changes if nbest_fixed else {**changes, "nbest": max(1, min(base.nbest, beam))}
    if beam is None and n is None and base.nbest > base.beam_size:  # the samples a sampling default draws
        return {**changes, "nbest": base.beam_size}
    if isinstance(n, int) and beam is None and not beam_fixed and n > base.beam_size:
        return {**changes, "beam_size": n}
    return changes


def _asked(settings: dict[str, Any], beam_fixed: bool, decode: DecodeConfig) -> dict[str, Any]:
    """The keyword settings asked for, and a beam ``--set`` gave (``beam_fixed``): what
    :func:`_check_sampling_only` checks. A sampling setting ``--set`` gives is a default for when
    sampling is asked for (a server's requests), not refused beside a search."""
    asked = {name: value for name, value in settings.items() if value is not None}
    if beam_fixed:
        asked.setdefault("beam", decode.beam_size)
    return asked


#: The settings that shape sampling only: given for a search, they would change nothing.
SAMPLING_ONLY = ("topk", "topp", "temperature", "seed")


def _check_sampling_only(settings: dict[str, Any], decode: DecodeConfig) -> None:
    """Raise :class:`ConfigError` when ``settings`` give a sampling setting while ``decode``
    searches (beam or greedy), or a beam wider than 1 while it samples: either would be
    silently ignored."""
    given = [key for key in SAMPLING_ONLY if settings.get(key) is not None]
    if given and decode.sampling == "none":
        raise ConfigError(f"{', '.join(given)}: for sampling only; add sampling topk or topp (on the command "
                          "line --sampling topk): beam search and greedy decoding would ignore it")
    if settings.get("beam") not in (None, 1) and decode.sampling != "none":
        raise ConfigError(f"beam {settings['beam']}: sampling draws each token, it keeps no beam; leave the beam "
                          "out when sampling (nbest gives several samples)")


def _check_width(output_size: int, decode: DecodeConfig, settings: dict[str, Any]) -> None:
    """Refuse, before any decoding, a beam too wide for the output vocabulary (the search would,
    at the first batch: a server's request then failed with a 500), naming ``nbest`` when it
    is an n-best asked for that widened the beam."""
    if decode.sampling != "none" or decode.beam_size <= 1 or 2 * decode.beam_size <= output_size:
        return
    n = settings.get("nbest")
    if n is not None and settings.get("beam") is None and n == decode.beam_size:
        raise ConfigError(f"nbest {n} widens the beam to {n}, which needs an output vocabulary of at least {2 * n} "
                          f"pieces (this model has {output_size}); ask for fewer")
    check_beam_width(decode.beam_size, output_size)


def _check_unseeded(settings: dict[str, Any], in_overrides: bool = False) -> None:
    """Refuse a seed given to the ctranslate2 engine (as ``serve`` refuses it in a request):
    its samples cannot be seeded, and the same seed would give other samples each call."""
    if settings.get("seed") is not None or in_overrides:
        raise ConfigError("seed: --engine ctranslate2's samples cannot be seeded (its threads draw from generators "
                          "of their own); leave the seed out, or decode with --engine torch for seeded samples")


@functools.cache
def _one_thread_in_forked_children() -> None:
    """A process forked from one that has decoded (a multiprocessing pool under ``fork``,
    ``gunicorn --preload``, Celery's prefork workers) decodes on one torch thread: GNU OpenMP,
    once it has run in the parent, hangs a forked child's first multi-threaded operation."""
    os.register_at_fork(after_in_child=lambda: torch.set_num_threads(1))


def _text(item: Any, where: str) -> str:
    """``item`` if it is a string of valid Unicode: a TypeError for another type, a
    :class:`DataError` naming ``where`` and the column of a lone surrogate."""
    if not isinstance(item, str):
        raise TypeError(f"{where} is a {type(item).__name__}, expected str")
    check_unicode(item, where)
    return item


def _check_many(texts: Any, what: str, kind: str = "a list") -> None:
    """A TypeError, at the call, for what is not ``kind`` of strings: a lone string, a mapping
    (its keys), bytes, None or a number."""
    if isinstance(texts, str):
        raise TypeError(f"{what} must be {kind} of strings, not one string (wrap it: [text])")
    if isinstance(texts, Mapping | bytes | bytearray) or not isinstance(texts, Iterable):
        name = type(texts).__name__
        raise TypeError(f"{what} must be {kind} of strings, not {'an' if name[0] in 'aeiou' else 'a'} {name}")


def _texts(texts: Any, what: str = "texts") -> list[str]:
    """``texts`` as a list of strings of valid Unicode (:func:`_text`); see :func:`_check_many`."""
    _check_many(texts, what)
    return [_text(item, f"{what}[{i}]") for i, item in enumerate(texts)]


class Translator:
    """A loaded model with its tokenizer, decode settings and device (see the module docstring)."""

    def __init__(self, bundle: InferenceModel, decode: DecodeConfig, device: torch.device | str,
                 engine: CT2Engine | None = None) -> None:
        self.bundle = bundle
        self.decode = decode
        self.device = torch.device(device)
        self.engine = engine
        bundle.model.to(self.device).eval()
        self._prepared: dict[tuple[bool, bool], InferenceModel] = {}
        # the tokens a batch is cut to once one did not fit, for every later call: decoding, and
        # scoring (whose batches hold pairs, counted as source_batches counts them)
        self._fitting_tokens = MemoryBudget()
        self._fitting_pairs = MemoryBudget()
        _one_thread_in_forked_children()

    @classmethod
    def from_run(cls, run_dir: str | Path, checkpoint: str | Path = "best", *, device: str = "auto",
                 average_last: int = 0, average_best: int = 0, ensemble: Sequence[str | Path] = (),
                 engine: str = "torch", overrides: Sequence[str] = (), **settings: Any) -> Translator:
        """Load ``run_dir``'s checkpoint (``best``, ``last``, a path; or the average of the last
        or best K) for decoding. ``device``: ``auto`` (the first GPU if there is one, the CPU
        under int8), ``cpu``, ``cuda:N``. ``ensemble``: more run directories or checkpoints
        decoded together with it. ``settings``: ``beam``, ``length_penalty``, ``max_tokens``,
        ``nbest``, ``max_len_a``, ``max_len_b``, ``int8``, ``bf16``, ``workers``, ``shortlist``,
        ``sampling``, ``topk``, ``topp``, ``temperature``, ``seed``, ``tgt_lang`` (the language
        to translate into, for a model of several target languages); ``overrides``:
        ``decode.*=value`` strings as ``--set`` takes them. ``engine``: ``torch`` (ours) or
        ``ctranslate2`` (:mod:`mtcli.infer.ct2`: the weights, of a checkpoint or an average,
        converted once into the run directory; no ensemble; int8/bf16 fixed here). Raises :class:`CheckpointError`
        or :class:`ConfigError` with one line."""
        if engine not in ENGINES:
            raise ConfigError(f"--engine {engine!r}: unknown (known: {', '.join(ENGINES)})")
        if engine == "ctranslate2" and ensemble:
            raise ConfigError("--engine ctranslate2 decodes one model, not an ensemble (an ensemble: decode with "
                              "--engine torch)")
        if not isinstance(device, str | torch.device):
            raise TypeError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        if isinstance(ensemble, str | Path):
            raise TypeError("ensemble must be a list of run directories or checkpoints, not one (wrap it: [path])")
        if isinstance(overrides, str):
            raise TypeError("overrides must be a list of 'decode.key=value' strings, not one (wrap it: [text])")
        if not all(isinstance(item, str) for item in overrides):
            raise TypeError(f"overrides must be a list of 'decode.key=value' strings, got {list(overrides)!r}")
        chosen = None if device == "auto" else resolve_device(device, key="--device")  # before any loading
        if engine == "ctranslate2":
            require_ctranslate2("--engine ctranslate2")
        bundle = load_for_inference(run_dir, checkpoint, average_last=average_last, average_best=average_best)
        bundle = add_members(bundle, ensemble, run_dir)
        given = override_keys(overrides)
        if not isinstance(bundle.model, Ensemble) and "decode.ensemble_mode" in given:
            get_logger().warning("decode.ensemble_mode: combines the members of --ensemble; one model: it changes nothing")
        release_freed_memory()  # what reading the checkpoints took, past now
        base = decode_config(bundle.config, list(overrides))
        beam_fixed, nbest_fixed = "decode.beam_size" in given, "decode.nbest" in given
        decode = with_changes(base, "decode", **_fitted(_changes(settings), base.decode, beam_fixed, nbest_fixed)).decode
        _check_sampling_only(_asked(settings, beam_fixed, decode), decode)
        _check_width(bundle.model.output_size, decode, settings)
        source_prefix(bundle, decode)  # a target language the model does not produce: refused now
        if engine == "ctranslate2":
            _check_unseeded(settings, "decode.seed" in given)
            check_supported(decode)  # before converting: a run's own settings may ask for it
        else:
            run_shortlist(bundle, decode)  # built now: a cache gone or changed is refused, not at every request
        where = decoding_device(decode) if chosen is None else chosen
        if decode.bf16 and not decode.int8 and engine == "torch" and not device_has_bf16_units(where):
            get_logger().warning("decode.bf16 on a %s without bf16 matrix units: expect decoding several times slower "
                                 "than fp32 (--set decode.bf16=false)", where.type)
        fast = None
        if engine == "ctranslate2":
            fast = open_engine(Path(run_dir), bundle, where, decode)
        return cls(bundle, decode, where, fast)

    @property
    def name(self) -> str:
        """Which checkpoint (or average, or ensemble) is loaded."""
        return self.bundle.name

    @property
    def target_languages(self) -> list[str]:
        """The languages this model translates into, its default (the run's ``data.tgt_lang``,
        or ``tgt_lang`` given to :meth:`from_run`) first."""
        default = self.decode.tgt_lang or self.bundle.config.data.tgt_lang
        return [default, *(lang for lang in self.bundle.target_tags if lang != default)]

    @property
    def max_source_pieces(self) -> int:
        """The longest source, in pieces, the model reads whole; a longer one is truncated."""
        return source_limit(self.bundle)

    def source_pieces(self, texts: Sequence[str], **settings: Any) -> list[int]:
        """How many pieces each text encodes to under ``settings`` (checked as :meth:`settings`
        checks them), with the tag asking for ``tgt_lang`` in a model of several target
        languages (texts checked as :meth:`translate` checks its input)."""
        prefix = len(source_prefix(self.bundle, self.settings(**settings)))
        return [prefix + len(ids) for ids in self.bundle.tokenizer.encode_batch(_texts(texts))]

    def settings(self, **settings: Any) -> DecodeConfig:
        """The decode settings with ``settings`` applied (checked; the translator's stay as they are)."""
        changes = _fitted(_changes(settings), self.decode)
        if not changes:
            return self.decode
        decode = with_changes(dataclasses.replace(self.bundle.config, decode=self.decode), "decode", **changes).decode
        _check_sampling_only(settings, decode)
        _check_width(self.bundle.model.output_size, decode, settings)
        if self.engine is not None:
            _check_unseeded(settings)
        return decode

    def __getstate__(self) -> dict[str, Any]:
        """For pickle and deepcopy: the decoding copies made on first use (packed for oneDNN,
        whose tensors cannot be serialised) are left out and made again when needed."""
        state = self.__dict__.copy()
        state["_prepared"] = {}
        return state

    def _for(self, decode: DecodeConfig) -> tuple[InferenceModel, DecodeConfig]:
        """The model to decode with (:func:`~mtcli.infer.translate.model_for_decoding`: an int8
        or a packed copy), made once per setting and kept."""
        key = (decode.int8, decode.bf16)
        if key not in self._prepared:
            model = model_for_decoding(self.bundle.model, decode, self.device)
            self._prepared[key] = dataclasses.replace(self.bundle, model=model)
        return self._prepared[key], dataclasses.replace(decode, int8=False)

    def stream(self, lines: Iterable[str], *, decode: DecodeConfig | None = None, name: str = "input",
               on_done: Any = None, return_attention: bool = False, window: int = DEFAULT_WINDOW,
               offset: int = 0) -> Iterator[list[Translation]]:
        """The n-best list of every line of ``lines``, lazily and in order, read ``window`` lines
        at a time (:func:`~mtcli.infer.translate.translate_lines`; ``name`` prefixes truncation
        warnings, their line numbers counted from ``offset + 1``; ``on_done(n)`` counts finished
        lines). Each line is checked as :meth:`translate` checks its texts."""
        if decode is not None and not isinstance(decode, DecodeConfig):
            raise TypeError(f"decode is a {type(decode).__name__}, expected a DecodeConfig (Translator.settings "
                            "makes one)")
        _check_many(lines, "lines", "an iterable")
        if not isinstance(lines, ArrivingLines):  # a reader's lines are strings already
            lines = (_text(line, f"{name}[{i}]") for i, line in enumerate(lines, offset))
        return self._stream(lines, decode, name, on_done, return_attention, window, offset)

    def _stream(self, lines: Iterable[str], decode: DecodeConfig | None, name: str = "input", on_done: Any = None,
                return_attention: bool = False, window: int = DEFAULT_WINDOW,
                offset: int = 0) -> Iterator[list[Translation]]:
        """:meth:`stream` of lines checked already (by :meth:`translate`, :meth:`nbest`, ...)."""
        if self.engine is not None:
            decode = decode or self.decode
            if return_attention:
                raise ConfigError("--engine ctranslate2 returns no attention (--plot-attention): decode with "
                                  "--engine torch")
            if (decode.int8, decode.bf16) != (self.decode.int8, self.decode.bf16):
                raise ConfigError("with --engine ctranslate2, int8/bf16 are chosen when the model is loaded")
            return self.engine.translate_lines(lines, decode, name=name, on_done=on_done, window=window,
                                               offset=offset)
        bundle, decode = self._for(decode or self.decode)
        return translate_lines(bundle, lines, decode, self.device, name=name, on_done=on_done,
                               return_attention=return_attention, budget=self._fitting_tokens,
                               window=window, offset=offset)

    def translate(self, texts: Sequence[str], **settings: Any) -> list[str]:
        """The best translation of each text, in order (an empty text gives ``""``)."""
        items = _texts(texts)
        _no_nbest(settings, "translate")
        decode = dataclasses.replace(self.settings(**settings), nbest=1)
        return [nbest[0].text if nbest else "" for nbest in self._stream(items, decode)]

    def translate_iter(self, texts: Iterable[str], *, window: int = DEFAULT_WINDOW,
                       **settings: Any) -> Iterator[str]:
        """Translate an iterable (a file, a generator) lazily: one output per input, in order.
        ``window`` texts are read, then translated together (sorted by length into batches), so
        memory stays bounded; a producer that waits for each answer before it gives the next text
        (a chat loop, a queue) needs ``window=1``, as ``fairseq-interactive --buffer-size 1``. An
        input that fails (raises) has the texts read before it translated and yielded first."""
        _check_many(texts, "texts", "an iterable")
        _no_nbest(settings, "translate_iter")
        if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < 1:
            raise ConfigError(f"translate_iter window must be an int >= 1, got {window!r}")
        decode = dataclasses.replace(self.settings(**settings), nbest=1)
        failed: list[Exception] = []

        def checked() -> Iterator[str]:
            try:
                for i, item in enumerate(texts):
                    yield _text(item, f"texts[{i}]")
            except Exception as exc:  # ends the input here; raised once what came before is out
                failed.append(exc)

        def translated() -> Iterator[str]:
            for nbest in self._stream(checked(), decode, window=int(window)):
                yield nbest[0].text if nbest else ""
            if failed:
                raise failed[0]

        return translated()

    def nbest(self, texts: Sequence[str], n: int | None = None, **settings: Any) -> list[list[Translation]]:
        """The ``n`` best hypotheses of each text (default: the beam size), best first, each a
        :class:`Translation` with ``text``, ``score`` (length-penalised log-probability, what
        the search ranks by) and ``logprob``. The run's beam widens to ``n`` when it is
        narrower; a ``beam`` given narrower than ``n`` is refused (as ``--beam 2 --nbest 4``).
        With ``sampling`` (``topk`` or ``topp``): ``n`` samples of each text, in draw order
        (default ``decode.nbest``). An empty (or blank) text has one hypothesis, the empty one,
        with score 0 (``mtcli translate --nbest`` pads its rows with ``-inf`` ones)."""
        _no_nbest(settings, "nbest", " (its n is how many)")
        decode = self.settings(**settings)
        sampled = decode.sampling != "none"
        if n is not None and (not isinstance(n, numbers.Integral) or isinstance(n, bool)):
            raise TypeError(f"nbest n must be an int, got {n!r}")
        n = (decode.nbest if sampled else decode.beam_size) if n is None else int(n)
        if n < 1:
            raise ConfigError(f"nbest n must be >= 1, got {n}")
        if not sampled and settings.get("beam") is not None and n > settings["beam"]:
            raise ConfigError(f"nbest {n} with beam {settings['beam']}: a beam search keeps beam hypotheses "
                              "(leave beam out and it widens to n)")
        decode = dataclasses.replace(decode, nbest=n, beam_size=decode.beam_size if sampled else max(decode.beam_size, n))
        _check_width(self.bundle.model.output_size, decode, {**settings, "nbest": n})
        return list(self._stream(_texts(texts), decode))

    def score(self, sources: Sequence[str], targets: Sequence[str], *, max_tokens: int | None = None,
              tgt_lang: str | None = None, normalize: bool = False, names: tuple[str, str] = ("sources", "targets"),
              first_line: int | None = None) -> list[float]:
        """log p(target | source) under the model for each pair: the sum of the log-probabilities
        of the target's pieces and ``</s>`` by teacher forcing, no search (for rescoring and
        filtering); ``normalize``: that sum divided by the number of pieces it adds up (the
        target's and ``</s>``), comparable across lengths. A piece the model cannot produce gives
        ``-inf``, and so does a target longer than the model's limit (which it cannot produce
        either), with a warning. Sources longer than the limit are truncated (as when
        translating), with a warning. Warnings name a pair ``sources[i]`` (``names``), or
        ``NAME: line N`` counting from ``first_line`` when it is given (as ``mtcli score`` names
        its files). A batch that runs out of the device's memory is scored again in halves (with
        a warning naming ``max_tokens``), and later batches, of this call and the next, are cut to half its
        size before they are tried; one pair that does not fit alone raises :class:`DeviceMemoryError`.
        The model is the one loaded: under bf16 autocast where the translator decodes in bf16, in float32
        under ``int8`` (which quantizes only the decoding copy); the torch engine's in either case."""
        src_texts, tgt_texts = _texts(sources, "sources"), _texts(targets, "targets")
        if len(src_texts) != len(tgt_texts):
            raise DataError(f"{len(src_texts)} sources but {len(tgt_texts)} targets: score takes them in pairs")
        if not isinstance(normalize, bool | np.bool_):  # ("no" would be true)
            raise TypeError(f"normalize must be a bool, got {normalize!r}")
        model = self.bundle.model
        if isinstance(model, Ensemble):
            raise ConfigError("score needs one model, not an ensemble")
        decode = self.settings(max_tokens=max_tokens, tgt_lang=tgt_lang)  # a max_tokens below 1: refused
        src_ids, tgt_ids, too_long = _encoded_pairs(self.bundle, src_texts, tgt_texts, source_prefix(self.bundle, decode),
                                                    names, first_line)
        lengths = [max(len(s), len(t)) + 1 for s, t in zip(src_ids, tgt_ids, strict=True)]
        out = [-math.inf if i in too_long else 0.0 for i in range(len(src_texts))]
        scored = [i for i in range(len(src_texts)) if i not in too_long]
        tokens = decode.max_tokens

        def score_batch(batch: list[int]) -> list[float]:
            pairs = collate(src_ids, tgt_ids, np.asarray(batch))
            logits = model(pairs.src.to(self.device), pairs.tgt_in.to(self.device)).float()
            target = pairs.tgt_out.to(self.device)
            return _target_logprobs(model, logits, target).sum(-1).tolist()

        def failed(part: list[int]) -> str:
            return (f"out of memory on {memory_text(self.device)} scoring {len(part)} pair(s) of up to "
                    f"{max(lengths[i] for i in part)} pieces")

        def halving(part: list[int], where: str) -> None:
            get_logger().warning("%s: scoring them in two halves (a lower max_tokens, now %d, avoids this)",
                                 where, tokens)

        budget = self._fitting_pairs
        with torch.inference_mode(), autocast(self.device, self.decode.bf16):
            for chosen in source_batches([lengths[i] for i in scored], min(tokens, budget.tokens), 1):
                batch = [scored[i] for i in chosen]
                scores = in_budget_halves(score_batch, batch, budget,
                                          lambda part: source_batch_tokens([lengths[i] for i in part]),
                                          lambda part, most: source_batches([lengths[i] for i in part], most, 1),
                                          failed, "the pair is too long for this device", halving)
                for i, value in zip(batch, scores, strict=True):
                    out[i] = value / (len(tgt_ids[i]) + 1) if normalize else value
        return out


def _target_logprobs(model: Any, logits: Tensor, target: Tensor) -> Tensor:
    """log p of each ``target`` id ``[B, T]`` under ``logits`` ``[B, T, V_out]`` (the model's
    output vocabulary), 0 at pad: ``logit - logsumexp(logits)``, read off the output vocabulary
    without widening it to the joint one (an id off it, which the model cannot produce: -inf)."""
    positions = model.output_targets(target)
    picked = logits.gather(-1, positions.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if model.output_ids is not None:
        picked = picked.masked_fill(model.output_ids[positions].ne(target), -math.inf)
    return picked.masked_fill(target.eq(model.pad_id), 0.0)


def _encoded_pairs(bundle: InferenceModel, sources: list[str], targets: list[str], prefix: list[int],
                   names: tuple[str, str], first_line: int | None) -> tuple[list[list[int]], list[list[int]], set[int]]:
    """The ids of :meth:`Translator.score`'s pairs: each source after ``prefix``, truncated to the
    model's limit; the targets, and the indices of those longer than it (not scored), each said
    (:func:`~mtcli.infer.translate.warn_of_some`). Lines far longer than any the model reads are
    encoded from their start only, as when translating."""
    limit, tokenizer = source_limit(bundle), bundle.tokenizer
    cap = line_cap(limit)
    src_ids = [[*prefix, *ids] for ids in tokenizer.encode_batch([text[:cap] for text in sources])]
    tgt_ids = tokenizer.encode_target_batch([text[:cap] for text in targets])

    def too_long_of(encoded: list[list[int]], texts: list[str]) -> list[int]:
        return [i for i, (ids, text) in enumerate(zip(encoded, texts, strict=True)) if len(ids) > limit or len(text) > cap]

    cut, too_long = too_long_of(src_ids, sources), too_long_of(tgt_ids, targets)

    def warn(rows: list[int], name: str, texts: list[str], encoded: list[list[int]], what: str, more: str) -> None:
        label = (lambda i: f"{name}[{i}]") if first_line is None else (lambda i: f"{name}: line {first_line + i}")
        warn_of_some(rows, lambda i: f"{label(i)}: {cut_size(texts[i], encoded[i], cap)}, {what}",
                     lambda k, listed: f"{name}: {k} more {more} ({'indices' if first_line is None else 'lines'} "
                                       f"{listed})", lambda i: i + (first_line or 0))

    truncated = f"truncated to the model limit of {limit} pieces"
    warn(cut, names[0], sources, src_ids, truncated, truncated)
    warn(too_long, names[1], targets, tgt_ids, f"more than the model's limit of {limit}: scored -inf",
         f"longer than the model's limit of {limit} pieces, scored -inf")
    return [ids[:limit] for ids in src_ids], tgt_ids, set(too_long)


__all__ = ["SETTINGS", "Translator"]
