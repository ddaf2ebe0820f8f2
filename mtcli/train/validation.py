"""Validation during training: loss, NLL and perplexity on the validation split, the BLEU and
chrF of greedy decoding, and the best of them so far (:class:`Bests`: what picks
``checkpoint_best`` and drives ``train.patience``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from mtcli.config import Config
from mtcli.data.batching import collate, filter_by_length, make_batches
from mtcli.data.cache import PrefixedArray, PreparedCorpus
from mtcli.data.textio import read_lines
from mtcli.device import autocast
from mtcli.errors import ConfigError
from mtcli.infer.loading import InferenceModel
from mtcli.infer.search import check_beam_width
from mtcli.infer.translate import translate_texts
from mtcli.logs import get_logger
from mtcli.metrics import score, scorer
from mtcli.rundir import BASIS_KEYS
from mtcli.train.loss import LabelSmoothedLoss


def check_validation(config: Config) -> None:
    """Refuse, before training starts: a BLEU scorer the target language lacks (it would stop
    training at the first validation), and a ``decode.tgt_lang`` no corpus translates into
    (translate and evaluate would refuse the trained model's config)."""
    if config.train.valid_bleu:
        scorer("bleu", config.data.tgt_lang, instead=" (or train.valid_bleu=false: validation by loss)")
    targets = config.data.target_langs()
    if config.decode.tgt_lang is not None and config.decode.tgt_lang not in targets:
        raise ConfigError(f"{config.path}: decode.tgt_lang {config.decode.tgt_lang}: no corpus of the data translates "
                          f"into it (they translate into {', '.join(targets)})")


def check_decode_width(config: Config, output_size: int) -> None:
    """Refuse, before training starts, a ``decode.beam_size`` too wide for the model's output
    vocabulary: saved with the run, it made ``translate`` and ``evaluate`` refuse the trained model."""
    try:
        check_beam_width(config.decode.beam_size, output_size)
    except ConfigError as exc:
        raise ConfigError(f"{config.source_of('decode.beam_size')}: {exc}; translate and evaluate would refuse "
                          "the trained run") from None


@torch.no_grad()
def validation_loss(model: nn.Module, criterion: LabelSmoothedLoss, corpus: PreparedCorpus,
                    config: Config, device: torch.device) -> tuple[float, float, int]:
    """Summed loss, NLL and target tokens on the validation split (pairs too long are skipped),
    in token batches of ``train.max_tokens`` sorted by length, under ``train.precision`` autocast."""
    data, cfg = config.data, config.train
    split = corpus.eval_split(data.valid_split, data.src_lang, data.tgt_lang)
    src = PrefixedArray(corpus.array(split, data.src_lang), corpus.source_prefix(data.tgt_lang))
    tgt = corpus.array(split, data.tgt_lang)
    limit = config.model.max_positions - 1
    indices, skipped = filter_by_length(src.lengths, tgt.lengths, limit, limit)
    if cfg.valid_max_sentences > 0:
        indices = indices[indices < cfg.valid_max_sentences]
    if skipped:
        get_logger().info("validation loss skips %d pairs longer than %d pieces", skipped, limit)
    loss = nll = 0.0
    tokens = 0
    model.eval()
    for batch_idx in make_batches(src.lengths, tgt.lengths, indices, cfg.max_tokens, shuffle=False):
        batch = collate(src, tgt, batch_idx).to(device)
        with autocast(device, cfg.precision):
            logits = model(batch.src, batch.tgt_in)
        out = criterion(logits, model.output_targets(batch.tgt_out))
        loss += float(out.loss)
        nll += float(out.nll)
        tokens += out.tokens
    return loss, nll, tokens


def validation_scores(model: nn.Module, corpus: PreparedCorpus, config: Config,
                      device: torch.device) -> dict[str, float]:
    """``{"bleu": ..., "chrf": ...}`` of greedy decoding of the validation split (its first
    ``train.valid_max_sentences`` when set) against its references, decoded as ``mtcli
    translate`` does, by the model as it trains (never ``decode.int8`` or ``decode.shortlist``),
    in the training's precision: a bf16 run's validation decodes in bf16, so ``evaluate`` of the
    same checkpoint in fp32 (``decode.bf16: false``) may differ from it in the second decimal."""
    data, cfg = config.data, config.train
    split = corpus.eval_split(data.valid_split, data.src_lang, data.tgt_lang)
    source_path = corpus.text_path(split, data.src_lang)
    sources = list(read_lines(source_path))
    refs = list(read_lines(corpus.text_path(split, data.tgt_lang)))
    if cfg.valid_max_sentences > 0:
        sources = sources[: cfg.valid_max_sentences]
        refs = refs[: cfg.valid_max_sentences]
    tokenizer = corpus.tokenizer()
    tags = {lang: tokenizer.piece_to_id(tag) for lang, tag in corpus.target_tags.items()}
    bundle = InferenceModel(model=model, tokenizer=tokenizer, config=config, name="training", target_tags=tags)
    # into the references' language, whatever decode.tgt_lang asks of translate; a search, whatever
    # decode.sampling asks of it (scores of samples would pick checkpoint_best by chance); the model
    # as it trains, not the int8 copy or the shortlist a recipe asks of later decoding on a CPU
    greedy = dataclasses.replace(config.decode, beam_size=1, nbest=1, bf16=cfg.precision == "bf16",
                                 tgt_lang=data.tgt_lang, sampling="none", int8=False, shortlist=0)
    hyps = translate_texts(bundle, sources, greedy, device, name=str(source_path))
    scores = score(hyps, refs, metrics=("bleu", "chrf"), tgt_lang=data.tgt_lang)
    return {"bleu": float(scores["bleu"]), "chrf": float(scores["chrf"])}


#: ``train.valid_metric`` as the log writes it.
METRIC_NAMES = {"bleu": "BLEU", "chrf": "chrF", "loss": "loss"}


@dataclasses.dataclass
class Bests:
    """The best validation scores so far, and the validations since the deciding one last
    improved (``train.patience``).

    The deciding score is ``metric`` (``train.valid_metric``: the BLEU or chrF of the decoded
    validation split, or its loss), or the loss when the split is not decoded
    (``train.valid_bleu: false``: give ``metric="loss"``). When it changes (a resume under
    another setting) its best and its patience start anew: scores of two metrics do not compare.

    ``basis`` is what the scores were measured under (:func:`score_basis`): a resume under
    another (:meth:`rebase`) forgets the bests it changed."""

    metric: str = "bleu"
    basis: dict[str, Any] = dataclasses.field(default_factory=dict)
    best: float | None = None  # of ``best_by``; higher is better (the loss negated)
    best_by: str | None = None
    bleu: float | None = None
    chrf: float | None = None
    loss: float | None = None
    bad_validations: int = 0

    @classmethod
    def of(cls, config: Config) -> Bests:
        """The bests of a run of ``config``, none yet."""
        train = config.train
        return cls(train.valid_metric if train.valid_bleu else "loss", score_basis(config))

    def deciding(self, result: dict[str, Any]) -> str:
        """The metric that decides for a validation's ``result`` (``loss``, ``bleu``, ``chrf``)."""
        return self.metric if self.metric != "loss" and result.get(self.metric) is not None else "loss"

    def update(self, result: dict[str, Any]) -> bool:
        """Take a validation's ``result`` (``bleu``/``chrf`` None when not decoded); whether the
        deciding score improved."""
        by = self.deciding(result)
        value = -result["loss"] if by == "loss" else result[by]
        improved = self.best is None or by != self.best_by or value > self.best
        if improved:
            self.best, self.best_by, self.bad_validations = value, by, 0
        else:
            self.bad_validations += 1
        for key, better in (("bleu", max), ("chrf", max), ("loss", min)):
            if result.get(key) is not None:
                old = getattr(self, key)
                setattr(self, key, result[key] if old is None else better(old, result[key]))
        return improved

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's record of the bests (``train_state``)."""
        return {"best": self.best, "best_by": self.best_by, "best_bleu": self.bleu, "best_chrf": self.chrf,
                "best_loss": self.loss, "bad_validations": self.bad_validations}

    def load_state_dict(self, state: dict[str, Any], saved_train: dict[str, Any] | None = None) -> list[str]:
        """Resume from :meth:`state_dict` (a checkpoint without ``best_by``: its best was BLEU
        when it equals the best BLEU, else the loss), then :meth:`rebase` on ``saved_train``
        (the checkpoint's ``train`` config); returns what the log should say."""
        self.best, self.bleu, self.chrf, self.loss = (state.get(k) for k in ("best", "best_bleu", "best_chrf",
                                                                             "best_loss"))
        self.best_by = state.get("best_by") or (None if self.best is None else
                                                "bleu" if self.best == self.bleu else "loss")
        self.bad_validations = int(state.get("bad_validations", 0))
        notes = []
        if self.best_by not in (None, self.metric):  # another metric decides now: its patience starts anew
            self.bad_validations = 0
            notes.append(f"checkpoint_best was picked by {METRIC_NAMES[self.best_by]}, and {METRIC_NAMES[self.metric]} "
                         "picks it now: the next validation it scores replaces it, and the best that picks it and counts "
                         "patience starts again from there")
        return notes + self.rebase(saved_train or {})

    def rebase(self, saved: dict[str, Any]) -> list[str]:
        """Forget the bests measured under another basis than this run's (``saved``: the
        resumed checkpoint's ``train`` config; a key it lacks counts as unchanged): every score
        when the validation subset changed, the loss when its label smoothing did (a smoothed
        and an unsmoothed loss do not compare). Returns what was forgotten, for the log."""
        changed = [key for key in self.basis if key in saved and saved[key] != self.basis[key]]
        if not changed:
            return []
        forgets = [metric for metric, keys in BASIS_KEYS.items() if any(key in changed for key in keys)]
        for key in forgets:
            setattr(self, key, None)
        deciding = self.best_by in forgets
        if deciding:
            self.best, self.best_by, self.bad_validations = None, None, 0
        what = ", ".join(f"{key} {saved.get(key)} -> {self.basis[key]}" for key in changed)
        named = "every validation score" if len(forgets) > 1 else "the validation loss"
        return [f"{named} is measured otherwise now ({what}): its best so far starts again"
                f"{', and so does the best that picks checkpoint_best and counts patience' if deciding else ''}"]


def score_basis(config: Config) -> dict[str, Any]:
    """What a validation score depends on beyond the model (the ``train`` keys of
    :data:`~mtcli.rundir.BASIS_KEYS`: the label smoothing of its loss and the subset it reads)."""
    keys = dict.fromkeys(key for metric_keys in BASIS_KEYS.values() for key in metric_keys)
    return {key: getattr(config.train, key) for key in keys}
