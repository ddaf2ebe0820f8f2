"""Typed configuration: four dataclass sections loaded from YAML and validated with clear errors.

A config file has the sections ``data``, ``model``, ``train`` and ``decode``; every key maps to a
field of :mod:`mtcli.settings` (see ``configs/multi30k_de_en.yaml`` for a commented reference). Any key can be
overridden from the command line with ``--set section.key=value``; the value is parsed as YAML,
so ``--set train.max_steps=100`` is an int and ``--set data.test_splits=[a,b]`` a list.

Errors are raised as :class:`mtcli.errors.ConfigError` whose message names the file and the key.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from mtcli.errors import ConfigError, shown
from mtcli.fileio import atomic_write, names_an_open_file
from mtcli.languages import default_character_coverage, default_normalization, standard_tag
from mtcli.logs import get_logger
from mtcli.settings import (
    DECODE_RANGES,
    MAX_SEED,
    SECTIONS,
    Config,
    CorpusConfig,
    DataConfig,
    DecodeConfig,
    ModelConfig,
    TrainConfig,
)
from mtcli.typed import coerce, type_name
from mtcli.yamlfile import load_yaml


def _dataclass_entry(cls: type, raw: dict[str, Any]) -> Any:
    """A mapping given where a section's field takes a dataclass (a ``data.sources`` entry)."""
    return _build_section(cls, raw, "<value>", "data.sources[]")


def _build_section(cls: type, raw: dict[str, Any], where: str, section: str,
                   lenient: bool = False) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    if cls is DataConfig and isinstance(raw.get("sources"), list):
        raw = dict(raw, sources=_corpus_sections(raw["sources"], where, lenient))
    for key, value in raw.items():
        if key not in fields and lenient:
            get_logger().warning("%s: '%s.%s' is not a key of this mtcli version; ignored", where, section, key)
            continue
        if key not in fields:
            raise ConfigError(f"{where}: {unknown_key(section, key, cls)}")
        try:
            kwargs[key] = coerce(value, hints[key], _dataclass_entry)
        except TypeError:
            raise ConfigError(
                f"{where}: key '{section}.{key}' must be {type_name(hints[key])}, got {shown(value)}"
            ) from None
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in kwargs:
            raise ConfigError(f"{where}: missing required key '{section}.{name}'")
    return cls(**kwargs)


def _corpus_sections(sources: list[Any], where: str, lenient: bool = False) -> list[Any]:
    """Each entry of ``data.sources`` built as a section; an entry that is not a mapping is refused."""
    for i, c in enumerate(sources):
        if not isinstance(c, (dict, CorpusConfig)):
            raise ConfigError(f"{where}: data.sources[{i}] must be a mapping like {{source: ..., weight: ...}}, "
                              f"got {shown(c)}")
    return [_build_section(CorpusConfig, c, where, f"data.sources[{i}]", lenient) if isinstance(c, dict) else c
            for i, c in enumerate(sources)]


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split ``section.key=value`` into its parts, the value parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    dotted, raw_value = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. train.max_steps=100 (decoding: "
                          "decode.beam_size=5)")
    try:
        value = load_yaml(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError:
        value = raw_value
    if (value is None or isinstance(value, str)) and re.search(r"(^|\s)#", raw_value.strip()) \
            and not raw_value.strip().startswith(("'", '"')):  # (a quoted value is YAML's to read)
        value = raw_value.strip()  # text with a '#', not a comment (a run "my run #2")
    if value is None and raw_value.strip() not in ("null", "Null", "NULL", "~"):  # YAML's syntax, not a value
        value = raw_value.strip()  # (&x, an anchor of nothing, was null: the default run directory, unsaid)
    return parts[0], parts[1], value


def unknown_key(section: str, key: str, cls: type | None = None) -> str:
    """What is said of ``section.key``, a key the config does not have (``cls``: the section's
    class, where it is no top-level one: ``data.sources[0]``): the key of that name in another
    section (``train.vocab_size``: ``data.vocab_size``), or a near spelling of one in its own
    (``train.max_step``), then the section's keys. (YAML reads ``1:``, ``true:`` or ``null:`` as
    a key that is no text: it is said as written.)"""
    key = str(key)
    fields = [f.name for f in dataclasses.fields(cls or SECTIONS[section])]
    elsewhere = [f"{other}.{key}" for other, kind in SECTIONS.items()
                 if other != section and key in {f.name for f in dataclasses.fields(kind)}] if cls is None \
        or section in SECTIONS else []
    near = [f"{section}.{name}" for name in difflib.get_close_matches(key, fields, n=1, cutoff=0.6)]
    guess = f"; did you mean {' or '.join(elsewhere or near)}?" if elsewhere or near else ""
    return f"unknown key '{section}.{key}'{guess} (known keys: {', '.join(fields)})"


def _check_override(text: str, section: str, key: str, value: Any) -> None:
    """Refuse a ``--set`` of an unknown section or key, or of a value of the wrong type, naming
    the ``--set`` (not the file, which may not hold the key)."""
    if section not in SECTIONS:
        raise ConfigError(f"--set {text!r}: unknown section '{section}' (known: {', '.join(SECTIONS)})")
    cls = SECTIONS[section]
    fields = [f.name for f in dataclasses.fields(cls)]
    if key not in fields:
        raise ConfigError(f"--set {text!r}: {unknown_key(section, key)}")
    hint = typing.get_type_hints(cls)[key]
    if cls is DataConfig and key == "sources" and isinstance(value, list):  # corpora, each a section
        _corpus_sections(value, f"--set {text!r}")
        return
    try:
        coerce(value, hint, _dataclass_entry)
    except TypeError:
        raise ConfigError(f"--set {text!r}: key '{section}.{key}' must be {type_name(hint)}, got {shown(value)}") from None


def config_from_dict(raw: Any, where: str = "<config>", overrides: list[str] | None = None,
                     lenient: bool = False) -> Config:
    """Validate a nested dict (as read from YAML) plus overrides into a :class:`Config`.

    An unknown key is refused with one line naming it; ``lenient`` drops it with a warning
    instead (a run directory's config written by another mtcli version, read for decoding)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping with sections {', '.join(SECTIONS)}")
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    if lenient:  # a run's config.yaml from before empty paths were refused: '' meant none then
        for section, key in _PATH_KEYS:
            if isinstance(raw.get(section), dict) and isinstance(raw[section].get(key), str) \
                    and not raw[section][key].strip():
                raw[section][key] = None
    given = copy.deepcopy(raw)
    for text in overrides or []:
        section, key, value = parse_override(text)
        _check_override(text, section, key, value)
        if raw.get(section) is None:
            raw[section] = {}
        if not isinstance(raw[section], dict):
            raise ConfigError(f"{where}: section '{section}' must be a mapping, got {shown(raw[section])}")
        raw[section][key] = value
    for section in raw:
        if section not in SECTIONS:
            raise ConfigError(f"{where}: unknown section '{section}' (known: {', '.join(SECTIONS)})")
    if isinstance(raw.get("data"), dict) and "name" not in raw["data"] and where != "<config>":
        if names_an_open_file(Path(where)):
            raise ConfigError(f"{where}: a config read from a pipe has no file name to name its cache and run "
                              "after: set data.name in it (or save it as a file)")
        raw["data"]["name"] = Path(where).stem  # as the run directory is named after the file
    built: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        body = raw.get(section)
        if body is None and section == "data":
            if "data" in raw:
                raise ConfigError(f"{where}: data: is empty; it needs at least data.source, data.src_lang and "
                                  "data.tgt_lang")
            raise ConfigError(f"{where}: missing required section 'data'")
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: section '{section}' must be a mapping, got {shown(body)}")
        built[section] = _build_section(cls, body, where, section, lenient)
    built["data"] = _with_language_defaults(built["data"], raw["data"])
    # a pipe's config names no file to prepare again, nor its run (data.name does)
    path = "<config>" if names_an_open_file(Path(where)) else where
    config = Config(**built, path=path, overrides=tuple(overrides or ()))
    try:
        validate(config, where)
    except ConfigError as exc:  # a bad value may come from a --set: name it beside the file
        if not overrides:
            raise
        named = _naming_overrides(str(exc), where, overrides)
        if named is None and not lenient:  # the error names no --set key: is it the file's own?
            try:
                config_from_dict(given, where, None)
            except ConfigError as own:
                if str(own) == str(exc):
                    raise exc from None
        raise ConfigError(named or f"{where} with --set {' '.join(overrides)}: {str(exc)[len(where) + 2:]}") from None
    return config


def _naming_overrides(error: str, where: str, overrides: list[str]) -> str | None:
    """A :func:`validate` error about ``where`` that also names the ``--set`` overrides whose key
    it names; None when it names none (the rule's key may be set only indirectly)."""
    message = error[len(where) + 2:]
    named = [text for text in overrides
             if re.search(rf"(?<![\w.]){re.escape(text.split('=', 1)[0].strip())}(?!\w)", message)]
    return f"{where} with --set {' '.join(named)}: {message}" if named else None


def _with_language_defaults(data: DataConfig, given: dict[str, Any]) -> DataConfig:
    """``data`` with the character coverage and the normalisation its languages call for, where
    the ``given`` keys leave them out (:mod:`mtcli.languages`)."""
    langs = {data.src_lang, data.tgt_lang, *(lang for c in data.corpora() for lang in c.langs or ())}
    # (a corpus's langs of other than two languages: refused by validate, after)
    targets = {data.tgt_lang, *(c.langs[1] for c in data.corpora() if c.langs and len(c.langs) == 2)}
    defaults = {"character_coverage": default_character_coverage(langs),
                "spm_normalization": default_normalization(targets)}
    return dataclasses.replace(data, **{key: value for key, value in defaults.items() if key not in given})


def with_changes(config: Config, section: str, **changes: Any) -> Config:
    """``config`` with typed ``changes`` to one section, each checked as a value in a config
    file is, then the whole config validated: how library callers change a key (strings are
    for ``--set``, at the command line). A change to None leaves its key as it is (an option
    not given). A :class:`ConfigError` names the key."""
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    coerced: dict[str, Any] = {}
    for key, value in changes.items():
        if value is None:
            continue
        if key not in known:
            raise ConfigError(unknown_key(section, key))
        try:
            coerced[key] = coerce(value, hints[key], _dataclass_entry)
        except TypeError:
            raise ConfigError(f"key '{section}.{key}' must be {type_name(hints[key])}, got {shown(value)}") from None
    if not coerced:
        return config
    said = None if config.overrides is None or not all(isinstance(v, str | int | float) for v in coerced.values()) \
        else (*config.overrides, *(f"{section}.{key}={value}" for key, value in coerced.items()))
    changed = dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **coerced)},
                                  overrides=said)
    # the config was valid before, so what fails is the change: name it (the keys the error names) rather than the file
    try:
        validate(changed, "<change>")
    except ConfigError as exc:
        message = str(exc).removeprefix("<change>: ")
        named = [key for key in coerced if re.search(rf"\b{section}\.{key}\b", message)] or list(coerced)
        raise ConfigError(f"{', '.join(f'{section}.{key}={coerced[key]!r}' for key in named)}: {message}") from None
    return changed


def _decode_checks(d: DecodeConfig) -> list[tuple[bool, str]]:
    """:func:`validate`'s checks of the decode settings: (holds, what the message says)."""
    return [
        (d.beam_size >= 1, "decode.beam_size must be >= 1"),
        (1 <= d.nbest <= d.beam_size or (d.sampling != "none" and d.nbest >= 1),
         "decode.nbest must be between 1 and decode.beam_size"),
        (d.topk >= 1 and 0.0 < d.topp <= 1.0, "decode.topk must be >= 1 and decode.topp in (0, 1]"),
        (d.max_tokens > 0, "decode.max_tokens must be > 0"),
        (d.max_len_a >= 0.0 and d.max_len_b >= 0 and (d.max_len_a > 0.0 or d.max_len_b >= 1),
         "decode.max_len_a and decode.max_len_b must be >= 0 and not both 0 (an output has at most "
         "max_len_a x its source's length + max_len_b pieces)"),
        *((low <= getattr(d, key) <= high, f"decode.{key} must be in [{low}, {high}], got {getattr(d, key)!r}")
          for key, (low, high) in DECODE_RANGES.items()),  # also refuses nan and inf
        (not (d.int8 and d.bf16), "decode.int8 and decode.bf16 exclude each other: choose one"),
        (d.workers >= 1, "decode.workers must be >= 1"),
        (d.tgt_lang is None or bool(d.tgt_lang.strip()), "decode.tgt_lang (--tgt-lang) must name a language, not be empty"),
        (d.shortlist >= 0 and d.shortlist_frequent >= 0, "decode.shortlist and decode.shortlist_frequent must be >= 0"),
        (d.sampling == "none" or d.shortlist == 0, "decode.sampling draws from the whole vocabulary: set decode.shortlist=0"),
    ]


#: Sizes past any model this code can build (a typo's extra digits: an overflow, or hours of
#: building layers, rather than a message).
MODEL_LIMITS = {"d_model": 1 << 16, "d_ff": 1 << 20, "encoder_layers": 1000, "decoder_layers": 1000,
                 "n_heads": 1 << 12, "max_positions": 1 << 20}


#: The keys that name a file or directory (their ``~`` expanded: :mod:`mtcli.settings`), and
#: what leaving one out means.
_PATH_KEYS = {("data", "prepared_dir"): "data/prepared/<data.name>",
              ("data", "spm_model"): "a SentencePiece model of the corpus's own",
              ("train", "run_dir"): "data/runs/<config name>", ("train", "init_from"): "training from scratch"}
#: What a language code may hold, as messages say it.
_CODE_CHARS = "letters, digits, _ or -: de, pt_BR, zh-Hans"


def check_language_code(option: str, value: str) -> None:
    """Raise :class:`ConfigError` when ``value``, given as ``option``, is no language code
    (:data:`LANGUAGE_CODE`: it names files, ``train.<lang>``, and the tag ``<2lang>``)."""
    if not LANGUAGE_CODE.fullmatch(value):
        raise ConfigError(f"{option} {value!r}: not a language code ({_CODE_CHARS})")


def _path_checks(config: Config) -> list[tuple[bool, str]]:
    """:func:`validate`'s checks of the path keys: none is empty (``--init-from "$UNSET"``)."""
    checks = []
    for (section, key), meaning in _PATH_KEYS.items():
        value = getattr(getattr(config, section), key)
        checks.append((value is None or bool(value.strip()),
                       f"{section}.{key} is empty: leave it out (or null) for {meaning}"))
    return checks


def _model_checks(m: ModelConfig) -> list[tuple[bool, str]]:
    """:func:`validate`'s checks of the model's shape: (holds, what the message says)."""
    return [
        (m.n_heads >= 1 and m.d_model > 0 and m.d_model % m.n_heads == 0,
         "model.n_heads must be >= 1 and model.d_model a positive multiple of it"),
        *((getattr(m, key) <= most, f"model.{key} must be at most {most:,}, got {getattr(m, key):,}")
          for key, most in MODEL_LIMITS.items()),
        (m.d_model % 2 == 0, "model.d_model must be even (sinusoidal positions pair sin/cos)"),
        (m.encoder_layers >= 1 and m.decoder_layers >= 1, "model.encoder_layers/decoder_layers must be >= 1"),
        (m.d_ff >= 1, "model.d_ff must be >= 1"),
        (m.max_positions >= 2, "model.max_positions must be >= 2"),
        (all(0.0 <= p < 1.0 for p in (m.dropout, m.attention_dropout, m.activation_dropout)),
         "model.dropout, model.attention_dropout and model.activation_dropout must be in [0, 1)"),
    ]


def validate(config: Config, where: str | None = None) -> None:
    """Check value ranges and cross-field rules; raise :class:`ConfigError` naming the key and
    ``where`` its value came from (default: the config's file)."""
    where = where or config.path
    m, t, d, dc = config.model, config.train, config.decode, config.data
    checks: list[tuple[bool, str]] = [
        *_model_checks(m),
        (0.0 <= t.label_smoothing < 1.0, "train.label_smoothing must be in [0, 1)"),
        (t.rdrop_alpha >= 0.0, "train.rdrop_alpha must be 0 (off) or > 0"),
        (t.subword_alpha >= 0.0, "train.subword_alpha must be 0 (off) or > 0"),
        (t.subword_alpha == 0.0 or dc.spm_model_type == "unigram",
         "train.subword_alpha > 0 samples from a unigram model: set data.spm_model_type: unigram"),
        (t.subword_nbest >= 1, "train.subword_nbest must be >= 1"),
        (t.subword_alpha == 0.0 or t.subword_nbest >= 2,
         "train.subword_nbest must be >= 2 with train.subword_alpha > 0 (1 is the best segmentation alone: nothing "
         "is sampled)"),
        (m.output_vocab == "joint" or t.subword_alpha == 0.0 or t.subword_sides == "source",
         "model.output_vocab: target needs the target pieces fixed: with train.subword_alpha > 0 "
         "set train.subword_sides: source"),
        (t.max_tokens > 0, "train.max_tokens must be > 0"),
        (re.fullmatch(r"auto|cpu|cuda(:\d+)?", t.device) is not None, "train.device must be auto, cpu, cuda or cuda:N"),
        *((getattr(t, key) >= 1, f"train.{key} must be >= 1")
          for key in ("max_steps", "max_source_length", "max_target_length", "log_every", "max_nonfinite")),
        *((getattr(t, key) >= 0, f"train.{key} must be 0 ({meaning}) or > 0")
          for key, meaning in (("max_epochs", "no limit"), ("patience", "no limit"), ("max_minutes", "no limit"),
                               ("valid_max_sentences", "all of them"), ("num_threads", "PyTorch's choice"),
                               ("clip_norm", "off"), ("weight_decay", "off"), ("lr", "Noam's schedule sets the rate"))),
        (0 <= t.seed <= MAX_SEED, f"train.seed must be between 0 and {MAX_SEED} (numpy's and torch's range)"),
        (t.lr_factor >= 0, "train.lr_factor must be >= 0"),
        (t.adam_eps > 0, "train.adam_eps must be > 0"),
        (t.pack_length == 0 or 2 <= t.pack_length <= min(t.max_tokens, m.max_positions),
         "train.pack_length must be 0 (token batches) or a row of 2 to min(train.max_tokens, "
         "model.max_positions) slots"),
        (t.update_freq >= 1, "train.update_freq must be >= 1"),
        (t.warmup_steps >= 1, "train.warmup_steps must be >= 1"),
        (t.init_average >= 1, "train.init_average must be >= 1 (the parent's last K checkpoints)"),
        (t.lr_schedule == "noam" or t.lr > 0.0,
         f"train.lr_schedule: {t.lr_schedule} needs train.lr > 0 (its peak learning rate)"),
        (t.lr_schedule != "noam" or t.lr == 0.0,
         "train.lr sets the peak of lr_schedule inverse_sqrt or constant; Noam's peak is "
         "train.lr_factor * (d_model * warmup_steps)^-0.5: set train.lr_factor, or choose a schedule"),
        (t.lr_schedule == "noam" or t.lr_factor == 1.0,
         f"train.lr_factor {t.lr_factor} scales Noam's rate only; under train.lr_schedule {t.lr_schedule} set "
         "train.lr_factor=1.0 (the peak rate is its lr key)"),
        (t.cooldown_steps >= 0, "train.cooldown_steps must be 0 (off) or > 0 (it counts back from "
                                "train.max_steps; more than max_steps cools down from the first step)"),
        (len(t.adam_betas) == 2 and all(0.0 <= b < 1.0 for b in t.adam_betas),
         "train.adam_betas must be two values in [0, 1)"),
        (t.keep_last >= 1, "train.keep_last must be >= 1"),
        (t.keep_best >= 0, "train.keep_best must be >= 0 (0: keep only the last train.keep_last)"),
        (t.valid_every >= 1, "train.valid_every must be >= 1"),
        (t.valid_metric != "chrf" or t.valid_bleu,
         "train.valid_metric: chrf scores the decoded validation split: set train.valid_bleu: true "
         "(or valid_metric: loss)"),
        *_decode_checks(d),
        (dc.name not in ("", ".", "..") and not re.search(r"[/\\]", dc.name),
         f"data.name must be a plain name, without '/' or '\\' and not '.' or '..' (it names the cache "
         f"data/prepared/<name>), got {dc.name!r}"),
        (8 <= dc.vocab_size <= 1 << 24, "data.vocab_size must be between 8 and 16,777,216"),
        (dc.num_workers >= 1, "data.num_workers must be >= 1"),
        (dc.spm_max_sentences >= 0, "data.spm_max_sentences must be 0 (all of them) or > 0"),
        (all(name.strip() for name in (dc.train_split, dc.valid_split, *dc.test_splits)),
         "data.train_split, data.valid_split and data.test_splits must name splits (none empty)"),
        (len(set(dc.test_splits)) == len(dc.test_splits), f"data.test_splits names a split twice: {dc.test_splits}"),
        *((value <= 1024, f"{key} must be at most 1024") for key, value in (("data.num_workers", dc.num_workers),
                                                                             ("train.num_threads", t.num_threads))),
        *_path_checks(config),
        (0.98 <= dc.character_coverage <= 1.0,
         "data.character_coverage must be in [0.98, 1] (SentencePiece's range; 0.9995 for Chinese or Japanese)"),
        (dc.src_lang != dc.tgt_lang, "data.src_lang and data.tgt_lang must differ"),
        (dc.max_length >= 1 and dc.max_length_ratio >= 1.0, "data.max_length must be >= 1 and data.max_length_ratio >= 1"),
    ]
    checks[:0] = [(math.isfinite(v), f"{section}.{key} must be a finite number, got {v!r}")  # YAML's .inf, .nan
                  for section in ("data", "model", "train")  # (each decode float has a range of its own)
                  for key, v in vars(getattr(config, section)).items() if isinstance(v, float)]
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"{where}: {message}")
    _validate_sources(config, where)


_TAG = re.compile(r"<(?!2[A-Za-z])[A-Za-z0-9_-]+>")  # not <2xx>: mtcli.data.corpora.target_tag's form
_SPECIAL_PIECES = ("<s>", "<pad>", "<unk>")  # and </s>: mtcli.data.tokenizer's (the regex refuses "/")


LANGUAGE_CODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def _check_one_code_a_language(config: Config, where: str) -> None:
    """Refuse one language written two ways in a config's languages (``de`` and ``deu``, ``fr``
    and ``fra_Latn``): a model tags, scores and translates into each code apart, so its pairs
    would be split between two target languages without a word. Regions and scripts that say
    something (``pt-BR`` and ``pt``, ``zh-TW`` and ``zh-CN``) are other languages here."""
    dc = config.data
    seen: dict[str, tuple[str, str]] = {}
    for key, lang in [("data.src_lang", dc.src_lang), ("data.tgt_lang", dc.tgt_lang),
                      *((f"data.sources[{i}].langs", lang) for i, c in enumerate(dc.sources) for lang in c.langs or ())]:
        first_key, first = seen.setdefault(standard_tag(lang), (key, lang))
        if first != lang:
            raise ConfigError(f"{where}: {first_key} {first!r} and {key} {lang!r} are one language written two ways "
                              f"({standard_tag(lang)}): a model keeps each code apart (its tag, its direction, its "
                              "score), splitting the language's pairs between them; write it one way")


def _validate_sources(config: Config, where: str) -> None:
    """The rules of ``data.source`` / ``data.sources``."""
    dc = config.data
    for key, lang in [("data.src_lang", dc.src_lang), ("data.tgt_lang", dc.tgt_lang),
                      *((f"data.sources[{i}].langs", lang) for i, c in enumerate(dc.sources) for lang in c.langs or ())]:
        if not LANGUAGE_CODE.fullmatch(lang):  # it names files (train.<lang>) and the tag <2lang>
            raise ConfigError(f"{where}: {key} must be a language code ({_CODE_CHARS}), got {lang!r}")
    if bool(dc.source) == bool(dc.sources):
        raise ConfigError(f"{where}: give data.source (one corpus) or data.sources (several)"
                          + (", not both" if dc.source else ""))
    for i, corpus in enumerate(dc.corpora()):
        key = f"data.sources[{i}]"
        langs = corpus.langs if not dc.sources or dc.sources[i].langs is None else dc.sources[i].langs  # ([] too)
        if dc.sources and not corpus.source:
            raise ConfigError(f"{where}: {key}.source is empty")
        if not 0.0 < corpus.weight <= 1000.0:
            raise ConfigError(f"{where}: {key}.weight must be > 0 and at most 1000 (how many times its pairs are "
                              f"drawn an epoch), got {corpus.weight}")
        if len(langs) != 2 or langs[0] == langs[1]:
            raise ConfigError(f"{where}: {key}.langs must be two different languages [source, target], got {langs}")
        if corpus.tag is not None and (not _TAG.fullmatch(corpus.tag) or corpus.tag in _SPECIAL_PIECES):
            raise ConfigError(f"{where}: {key}.tag must be one symbol <name> (letters, digits, _ or -), e.g. '<bt>', "
                              f"not <s>, </s>, <pad>, <unk> or a target-language tag <2xx>, got {corpus.tag!r}")
    _check_one_code_a_language(config, where)
    directions = [tuple(c.langs or ()) for c in dc.corpora()]
    if (dc.src_lang, dc.tgt_lang) not in directions:
        raise ConfigError(f"{where}: no corpus of data.sources goes {dc.src_lang}->{dc.tgt_lang} (data.src_lang, "
                          "data.tgt_lang: the direction validation scores)")
    if dc.sources and dc.hub_config:
        raise ConfigError(f"{where}: data.hub_config is per corpus with data.sources: set data.sources[i].hub_config")


def load_config(path: str | Path, overrides: list[str] | None = None,
                lenient: bool = False) -> Config:
    """Read a YAML recipe with a safe loader, apply ``--set`` overrides, validate
    (``lenient``: see :func:`config_from_dict`)."""
    path = Path(path)
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        stdin = "; a config on standard input is given as /dev/stdin (with a data.name)" if where == "-" else ""
        raise ConfigError(f"{where}: config file not found{stdin}") from None
    except IsADirectoryError:
        run = " (a run directory: its config.yaml resumes it)" if (path / "config.yaml").is_file() else ""
        raise ConfigError(f"{where}: is a directory{run}; give a YAML config file") from None
    except UnicodeDecodeError as exc:  # where, as a data file's bad byte is said (mtcli.data.textio)
        line, start = exc.object.count(b"\n", 0, exc.start) + 1, exc.object.rfind(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{where}:{line}: invalid UTF-8 (byte 0x{exc.object[exc.start]:02x} at column "
                          f"{exc.start - start + 1}); save the config as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read config ({exc})") from None
    try:
        raw = load_yaml(text)
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a config") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{where}:{line}: {problem}") from None
    return config_from_dict(raw, where, overrides, lenient)


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config as YAML, atomically."""
    with atomic_write(path) as handle:
        yaml.safe_dump(config.to_dict(), handle, sort_keys=False, allow_unicode=True)


__all__ = ["DECODE_RANGES", "LANGUAGE_CODE", "MAX_SEED", "SECTIONS", "Config", "CorpusConfig", "DataConfig",
           "DecodeConfig", "ModelConfig", "TrainConfig", "check_language_code", "config_from_dict", "load_config",
           "parse_override", "save_config", "validate", "with_changes"]
