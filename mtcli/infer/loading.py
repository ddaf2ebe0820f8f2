"""Loading a run directory for decoding: the model, its tokenizer and its config."""

from __future__ import annotations

import dataclasses
import json
import numbers
import re
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from mtcli.checkpoint import (
    architecture_mismatches,
    directions_text,
    load_checkpoint_with_id,
    other_directions,
    weights_sha256,
)
from mtcli.config import Config, DecodeConfig, load_config
from mtcli.data.tokenizer import PAD_ID, Tokenizer
from mtcli.data.vocabmap import VocabTokenizer
from mtcli.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    failed_to_allocate,
    one_line,
    shown,
)
from mtcli.fileio import sha256_file
from mtcli.infer.averaging import average_checkpoints
from mtcli.logs import get_logger
from mtcli.model import Transformer
from mtcli.rundir import (
    BEST_NAME,
    CONFIG_NAME,
    EXPORT_RECORD,
    LAST_NAME,
    MANIFEST_NAME,
    SOURCE_SPM_NAME,
    SPM_NAME,
    TARGET_SPM_NAME,
    VOCAB_NAME,
    checkpoint_dir,
    names,
    no_checkpoint_yet,
    select_checkpoints,
)
from mtcli.runlock import RunLock

_WRAPPER_RE = re.compile(r"^(?:module\.|_orig_mod\.)+")


@dataclasses.dataclass
class InferenceModel:
    """What ``evaluate``/``translate`` need from a run: model, tokenizer, config and a name."""

    model: torch.nn.Module
    tokenizer: Tokenizer | VocabTokenizer  # the latter: separate source/target models (import-hf)
    config: Config
    name: str
    state: dict | None = None  # checkpoint metadata (step, valid, ...) without the parameters
    # lexical shortlists built for this run, by (decode.shortlist, decode.shortlist_frequent)
    shortlists: dict = dataclasses.field(default_factory=dict)
    # a model of several target languages: the id of each language's tag (<2de>), put before a source
    target_tags: dict[str, int] = dataclasses.field(default_factory=dict)
    # one checkpoint file's weights: the sha256 of the payload they were loaded from (None: an average)
    payload_sha256: str | None = None
    # the sha256 of the weights themselves (checkpoint.weights_sha256), averages too
    weights_sha256: str | None = None


def source_prefix(bundle: InferenceModel, decode: DecodeConfig) -> list[int]:
    """The ids put before every source: the tag of ``decode.tgt_lang`` (default ``data.tgt_lang``)
    for a model of several target languages, else none. :class:`ConfigError` for a language the
    model was not trained to produce."""
    if not bundle.target_tags and decode.tgt_lang is None:
        return []
    data = bundle.config.data
    lang = decode.tgt_lang or data.tgt_lang
    if bundle.target_tags:
        if lang not in bundle.target_tags:
            raise ConfigError(f"target language {lang}: this model translates into {', '.join(bundle.target_tags)}")
        return [bundle.target_tags[lang]]
    if lang != data.tgt_lang:
        raise ConfigError(f"target language {lang}: this model translates into {data.tgt_lang} only "
                          "(it was trained on one target language)")
    return []


def _run_manifest(run_dir: Path) -> dict:
    """The run's copy of its prepared data's ``manifest.json`` ({} when it has none)."""
    try:
        manifest = json.loads((run_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # (nested past Python's limit: no manifest of mtcli's)
        return {}
    return manifest if isinstance(manifest, dict) else {}


def run_target_tags(run_dir: Path, tokenizer: Tokenizer | VocabTokenizer) -> dict[str, int]:
    """The target-language tags of the run's prepared data, by language; :class:`DataError`
    when the manifest holds something else there."""
    tags = _run_manifest(run_dir).get("target_tags") or {}
    if not isinstance(tags, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tags.items()):
        raise DataError(f"{run_dir / MANIFEST_NAME}: target_tags is not a mapping of languages to tags, but "
                        f"{shown(tags)}")
    return {lang: tokenizer.piece_to_id(tag) for lang, tag in tags.items()}


def run_directions(run_dir: str | Path, config: Config) -> list[tuple[str, str]]:
    """The directions a run was trained on, in the order of its corpora, without repeats
    (``data.src_lang -> data.tgt_lang`` for a run of one corpus)."""
    corpora = _run_manifest(Path(run_dir)).get("corpora") or []
    corpora = corpora if isinstance(corpora, list) else []
    found = [(c["langs"][0], c["langs"][1]) for c in corpora
             if isinstance(c, dict) and isinstance(c.get("langs"), list) and len(c["langs"]) == 2
             and all(isinstance(lang, str) for lang in c["langs"])]
    return list(dict.fromkeys(found)) or [(config.data.src_lang, config.data.tgt_lang)]


def resolve_checkpoint(run_dir: Path, checkpoint: str | Path) -> Path:
    """The file ``checkpoint`` names in ``run_dir``: ``best`` (``last`` when there is no best),
    ``last``, or a path (as given, or a file name in ``checkpoints/``); CheckpointError if none."""
    directory = checkpoint_dir(run_dir)
    text = str(checkpoint)
    if not text.strip():  # (Path("") is ".", the working directory)
        raise CheckpointError(f"the checkpoint is empty: give best, last, a file name in {directory} or a path")
    if text in ("best", "last"):
        path = directory / (BEST_NAME if text == "best" else LAST_NAME)
        if text == "best" and not path.is_file() and (directory / LAST_NAME).is_file():
            get_logger().info("%s has no %s; using %s", run_dir, BEST_NAME, LAST_NAME)
            path = directory / LAST_NAME
    else:
        path = Path(checkpoint)
        if not path.exists() and not path.is_absolute() and (directory / path).exists():
            path = directory / path
    if path.is_dir():
        inside = checkpoint_dir(path) if checkpoint_dir(path).is_dir() else path  # a run's: in checkpoints/
        raise CheckpointError(f"{path}: is a directory, not a checkpoint file (checkpoints in "
                              f"{'it' if inside == path else inside}: {names(sorted(inside.glob('*.pt')))})")
    if not path.is_file():
        found = sorted(directory.glob("*.pt"))
        hint = "" if found else no_checkpoint_yet(run_dir)
        raise CheckpointError(f"{path}: checkpoint not found (checkpoints in {run_dir}: {names(found)}){hint}")
    return path


def run_tokenizer(run_dir: Path) -> Tokenizer | VocabTokenizer:
    """The run's tokenizer: its joint ``spm.model``, or (a run imported by ``mtcli import-hf``)
    ``source.spm`` and ``target.spm`` mapped through ``vocab.json``; :class:`CheckpointError`
    when it has neither. Its files are named absolutely: a host program that changes directory
    later still finds them (a shortlist hashes the model on first use)."""
    run_dir = Path(run_dir).absolute()
    spm_path = run_dir / SPM_NAME
    try:
        if not spm_path.is_file() and (run_dir / VOCAB_NAME).is_file():
            return VocabTokenizer(run_dir / SOURCE_SPM_NAME, run_dir / TARGET_SPM_NAME, run_dir / VOCAB_NAME)
        if not spm_path.is_file():
            raise CheckpointError(f"{run_dir}: incomplete run directory (no {SPM_NAME})")
        return Tokenizer(spm_path)
    except DataError as exc:
        raise CheckpointError(str(exc)) from None


def _open_run(run_dir: Path) -> tuple[Config, Tokenizer | VocabTokenizer]:
    """The run's config and tokenizer; :class:`CheckpointError` for anything but a run directory."""
    check_run_dir(run_dir)
    config = load_config(run_dir / CONFIG_NAME, lenient=True)
    return config, run_tokenizer(run_dir)


def check_run_dir(run_dir: Path) -> None:
    """:class:`CheckpointError` for anything but a run directory, saying what it is instead (a
    training's config file, an export, a training that has just begun)."""
    if run_dir.suffix in (".yaml", ".yml") and run_dir.is_file():
        raise CheckpointError(f"{run_dir}: a config file, not a run directory; give the run directory its "
                              "training wrote (its train.run_dir)")
    if not run_dir.exists():
        raise CheckpointError(f"{run_dir}: run directory not found")
    if not run_dir.is_dir() or not (run_dir / CONFIG_NAME).is_file():
        training = run_dir.is_dir() and RunLock(run_dir).holder()
        if training:  # a training that has not yet written its config (it reads its data first)
            raise CheckpointError(f"{run_dir}: no checkpoint yet; it has just started training ({training}): its "
                                  "first checkpoint comes at the first validation, train.valid_every steps in")
        if (run_dir / EXPORT_RECORD).is_file():  # an export: what it holds is decoded by its own tools
            raise CheckpointError(f"{run_dir}: an mtcli export, not a run directory; give the run it was exported "
                                  f"from ({_exported_from(run_dir)}), or load it with CTranslate2 or transformers")
        raise CheckpointError(f"{run_dir}: not a run directory (no {CONFIG_NAME})")


def _exported_from(export: Path) -> str:
    """The run directory an export's record names, or ``"its record names none"``."""
    try:
        record = json.loads((export / EXPORT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = None
    return str(record.get("run_dir")) if isinstance(record, dict) and record.get("run_dir") else "its record names none"


def _check_vocabulary(state: dict, source: str, tokenizer: Tokenizer | VocabTokenizer) -> None:
    """Refuse a checkpoint whose vocabulary is not the run's ``spm.model`` (naming both)."""
    vocab = state.get("vocab")
    if not isinstance(vocab, dict):
        return
    spm_sha = sha256_file(tokenizer.model_path)
    size, sha = vocab.get("size"), vocab.get("spm_sha256")
    if (size is not None and int(size) != tokenizer.vocab_size) or (sha and sha != spm_sha):
        raise CheckpointError(
            f"{source}: checkpoint vocabulary (size {size}, spm sha256 {str(sha)[:12]}) does not "
            f"match {tokenizer.model_path} (size {tokenizer.vocab_size}, sha256 {spm_sha[:12]})"
        )


def _build_model(state: dict, source: str, config: Config, vocab_size: int, run_dir: Path) -> Transformer:
    """The Transformer of ``config`` with the checkpoint's parameters (DDP/compile prefixes dropped)."""
    model_state = state.get("model")
    if not isinstance(model_state, dict):
        raise CheckpointError(f"{source}: checkpoint has no model parameters")
    model_state = {_WRAPPER_RE.sub("", k): v for k, v in model_state.items()}
    _check_shapes(model_state, source, config, vocab_size, run_dir)
    try:
        with torch.random.fork_rng(devices=[]):  # its random first weights, replaced: the caller's draws unmoved
            # in float32 before the weights go in, whatever default dtype a host program set
            model = Transformer(config.model, vocab_size, PAD_ID, model_state.get("output_ids")).float()
        model.load_state_dict(model_state)
    except (RuntimeError, ValueError) as exc:
        if failed_to_allocate(exc):  # the shapes fit (checked on the meta device): the memory is short
            raise MemoryError(f"{source}: building its model ({one_line(exc)})") from None
        detail = " ".join(str(exc).split())
        raise CheckpointError(
            f"{source}: parameters do not fit the model of {run_dir / CONFIG_NAME} ({detail[:300]})"
        ) from None
    return model


class _ShapesOnly(TorchFunctionMode):
    """Inside ``torch.device("meta")``: a model built for its shapes alone, its initialisers
    skipped and ``arange`` made on the host. PyTorch fills a meta tensor (``normal_``, ``arange``)
    through its Python reference ops, whose first use imports ``torch._dynamo``: 2-3 s of every
    ``translate``, ``evaluate`` and ``serve`` start, for values nobody reads."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":  # init.normal_(tensor, ...) fills in place
            return args[0] if args else kwargs["tensor"]
        if func is torch.arange:
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _check_shapes(model_state: dict, source: str, config: Config, vocab_size: int, run_dir: Path) -> None:
    """:class:`CheckpointError` unless the parameters are those, by name and shape, of the model
    of ``config``, found on a model that holds no memory (PyTorch's meta device): the real one is
    built after, so a run whose config.yaml asks for a model of a hundred gigabytes is refused
    before a byte of it is allocated, not when memory runs out."""
    try:
        with torch.device("meta"), _ShapesOnly():
            shaped = Transformer(config.model, vocab_size, PAD_ID, model_state.get("output_ids")).state_dict()
    except (NotImplementedError, RuntimeError, ValueError):  # (a model built from its output list reads it)
        return  # the real build and load check it
    given = {k: tuple(v.shape) for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    wanted = {k: tuple(v.shape) for k, v in shaped.items()}
    if given == wanted:
        return
    differ = [f"{k}: {given.get(k, 'missing')} in the checkpoint, {wanted.get(k, 'none')} in the model"
              for k in sorted(set(given) | set(wanted)) if given.get(k) != wanted.get(k)]
    raise CheckpointError(f"{source}: parameters do not fit the model of {run_dir / CONFIG_NAME} "
                          f"({'; '.join(differ[:3])}{'; ...' if len(differ) > 3 else ''})")


def load_for_inference(
    run_dir: str | Path,
    checkpoint: str | Path = "best",
    average_last: int = 0,
    average_best: int = 0,
    device: str | torch.device = "cpu",
) -> InferenceModel:
    """Load a run directory for decoding: Transformer (eval mode, on ``device``) + tokenizer + config.

    ``checkpoint`` is "best" (falls back to "last", logged, when there is no best), "last",
    or a path (absolute, relative to the working directory, or a file name in
    ``checkpoints/``). With ``average_last``/``average_best`` > 0 the last/best K step
    checkpoints are averaged in memory instead (``checkpoint`` must then be left "best").
    Raises :class:`CheckpointError` (one line) for a missing run directory, a directory
    without ``config.yaml`` or ``spm.model``, a missing checkpoint (listing what exists), or
    a checkpoint whose vocabulary is not the run's ``spm.model`` (naming both).
    """
    for key, value in (("average_last", average_last), ("average_best", average_best)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # True averaged one; 2.0 failed
            raise TypeError(f"{key} must be an int (0: no average), got {value!r}")
    average_last, average_best = int(average_last), int(average_best)
    if average_last < 0 or average_best < 0:
        raise ConfigError("--average-last/--average-best must be 0 (no average) or > 0, "
                          f"got {min(average_last, average_best)}")
    if average_last > 0 and average_best > 0:
        raise ConfigError(f"give one of --average-last K or --average-best K, not both (got --average-last "
                          f"{average_last} --average-best {average_best})")
    if (average_last > 0 or average_best > 0) and str(checkpoint) != "best":
        raise ConfigError(f"give --checkpoint ({checkpoint}) or --average-last/--average-best K, not both: an "
                          "average is of the run's own step checkpoints")
    run_dir = Path(run_dir)
    config, tokenizer = _open_run(run_dir)
    if average_last > 0 or average_best > 0:
        paths = select_checkpoints(run_dir, last=average_last, best=average_best)
        state, payload_sha256 = average_checkpoints(paths), None
        kind = f"last{average_last}" if average_last > 0 else f"best{average_best}"
        name = f"avg_{kind} ({names(paths)})"
        source = f"{paths[0].name}..{paths[-1].name}"
    else:
        path = resolve_checkpoint(run_dir, checkpoint)
        state, payload_sha256 = load_checkpoint_with_id(path)
        members = [str(m.get("file")) for m in state.get("averaged_from") or () if isinstance(m, dict)]
        name = f"{path.name} ({'average of ' + ', '.join(members) if members else 'step ' + str(state.get('step', '?'))})"
        source = str(path)
    _check_vocabulary(state, source, tokenizer)
    differ = architecture_mismatches((state.get("config") or {}).get("model"), config.model)
    if differ:  # same shapes but another computation (an activation) would load and decode wrongly
        said = "; ".join(f"model.{key} {saved} vs {own}" for key, saved, own in differ)
        raise CheckpointError(f"{source}: a checkpoint of another model: its {said} in "
                              f"{run_dir / CONFIG_NAME}; decode it with its own run directory")
    differ = other_directions((state.get("config") or {}).get("data"), config.to_dict()["data"])
    if differ:
        raise CheckpointError(f"{source}: a checkpoint trained for {directions_text(differ[0])}, not for "
                              f"{directions_text(differ[1])} as {run_dir / CONFIG_NAME}; decode it with its own run "
                              "directory")
    model = _build_model(state, source, config, tokenizer.vocab_size, run_dir)
    weights = weights_sha256(model.state_dict())  # by the model's own names (a DDP or compiled prefix gone)
    model.to(device).eval()
    meta = {k: v for k, v in state.items() if k not in ("model", "optimizer", "scheduler", "rng", "rng_ranks")}
    return InferenceModel(model=model, tokenizer=tokenizer, config=config, name=name, state=meta,
                          target_tags=run_target_tags(run_dir, tokenizer),
                          payload_sha256=payload_sha256, weights_sha256=weights)
