"""Validation during training: loss, NLL and perplexity on the validation split, and the BLEU of
greedy decoding (the number that picks ``checkpoint_best`` and drives ``train.patience``)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mtcli.config import Config
from mtcli.data.batching import collate, filter_by_length, make_batches
from mtcli.data.cache import PrefixedArray, PreparedCorpus
from mtcli.data.textio import read_lines
from mtcli.device import autocast
from mtcli.infer.loading import InferenceModel
from mtcli.infer.translate import translate_texts
from mtcli.logs import get_logger
from mtcli.metrics import score
from mtcli.train.loss import LabelSmoothedLoss


@torch.no_grad()
def validation_loss(model: nn.Module, criterion: LabelSmoothedLoss, corpus: PreparedCorpus,
                    config: Config, device: torch.device) -> tuple[float, float, int]:
    """Summed loss, NLL and target tokens on the validation split (pairs too long are skipped),
    in token batches of ``train.max_tokens`` sorted by length, under ``train.precision`` autocast."""
    data, cfg = config.data, config.train
    src = PrefixedArray(corpus.array(data.valid_split, data.src_lang), corpus.source_prefix(data.tgt_lang))
    tgt = corpus.array(data.valid_split, data.tgt_lang)
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


def validation_bleu(model: nn.Module, corpus: PreparedCorpus, config: Config,
                    device: torch.device) -> float:
    """BLEU of greedy decoding of the validation split (its first ``train.valid_max_sentences``
    when set) against its references, decoded as ``mtcli translate`` does."""
    data, cfg = config.data, config.train
    sources = list(read_lines(corpus.text_path(data.valid_split, data.src_lang)))
    refs = list(read_lines(corpus.text_path(data.valid_split, data.tgt_lang)))
    if cfg.valid_max_sentences > 0:
        sources = sources[: cfg.valid_max_sentences]
        refs = refs[: cfg.valid_max_sentences]
    tokenizer = corpus.tokenizer()
    tags = {lang: tokenizer.piece_to_id(tag) for lang, tag in corpus.target_tags.items()}
    bundle = InferenceModel(model=model, tokenizer=tokenizer, config=config, name="training", target_tags=tags)
    greedy = dataclasses.replace(config.decode, beam_size=1, nbest=1, bf16=cfg.precision == "bf16")
    hyps = translate_texts(bundle, sources, greedy, device)
    return float(score(hyps, refs, tgt_lang=data.tgt_lang)["bleu"])
