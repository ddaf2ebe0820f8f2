"""What the training stream reads each epoch when it is not the cached pairs.

:class:`~mtcli.batching.BatchStream` calls a ``resegment(epoch) -> (src, tgt)`` hook at the
start of every epoch. :func:`training_resegmenter` builds it from the config: sampled
segmentations (``train.subword_alpha``, :mod:`mtcli.subword_sampling`), then both translation
directions for the first ``train.bidirectional_epochs``. Each epoch's pairs are a pure function of
the epoch, so every DDP rank and every resumed process reads the same ones.
:func:`output_vocabulary` lists the pieces those pairs' targets can hold (``model.output_vocab``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mtcli.batching import JoinedSentences, Resegment, SentenceArray
from mtcli.config import Config
from mtcli.corpus import read_lines
from mtcli.errors import DataError
from mtcli.tokenizer import SPECIAL_IDS, UNK_ID


def subword_resegmenter(corpus: Any, config: Config) -> Resegment:
    """Per-epoch sampled segmentations of the training split (``train.subword_alpha`` > 0).

    The cleaned training text the cache was encoded from is read once, and each sampled side
    gets a :class:`~mtcli.subword_sampling.WordSegmentationSampler`: both sides, or with
    ``train.subword_sides: source`` the source only (the target keeps its cached segmentation).
    Epoch ``e`` draws with a NumPy generator seeded by ``(train.seed, e, side)``, so every rank
    and every resume sees the same pieces.
    """
    from mtcli.subword_sampling import WordSegmentationSampler
    from mtcli.tokenizer import Tokenizer

    data, seed = config.data, config.train.seed
    tokenizer = Tokenizer(corpus.spm_path)
    sides: list[Any] = []
    for side, lang in enumerate((data.src_lang, data.tgt_lang)):
        best = corpus.array(data.train_split, lang)
        if side == 1 and config.train.subword_sides == "source":
            sides.append(best)  # the target keeps its best segmentation
            continue
        path = corpus.text_path(data.train_split, lang)
        lines = list(read_lines(path))
        if len(lines) != len(best):
            raise DataError(f"{path}: {len(lines)} lines, but the cache holds {len(best)} sentences; "
                            f"re-run `mtcli prepare {config.path}`")
        sides.append(WordSegmentationSampler(tokenizer, lines, best, config.train.subword_alpha,
                                             nbest=config.train.subword_nbest))

    def resegment(epoch: int) -> tuple[SentenceArray, SentenceArray]:
        return tuple(s.sample(np.random.default_rng([seed, epoch, side]))  # type: ignore[return-value]
                     if isinstance(s, WordSegmentationSampler) else s
                     for side, s in enumerate(sides))

    return resegment


def bidirectional_resegmenter(src: SentenceArray, tgt: SentenceArray, epochs: int,
                              base: Resegment | None = None) -> Resegment:
    """Bidirectional training (Ding et al., 2021): both directions first, then the asked one.

    For epochs ``e < epochs`` the stream reads the doubled corpus ``(src + tgt -> tgt + src)``:
    every pair once as asked and once reversed, so the shared encoder, decoder and joint
    embeddings learn both languages on both sides. From epoch ``epochs`` on it reads
    ``src -> tgt`` only. ``base`` (subword regularisation) supplies each epoch's pairs first.
    """

    def resegment(epoch: int) -> tuple[SentenceArray, SentenceArray]:
        s, t = base(epoch) if base is not None else (src, tgt)
        if epoch < epochs:
            return JoinedSentences(s, t), JoinedSentences(t, s)
        return s, t

    return resegment


def training_resegmenter(corpus: Any, config: Config) -> Resegment | None:
    """What the training stream reads per epoch instead of the cached pairs, if anything:
    sampled segmentations (``train.subword_alpha``), then both directions for the first
    ``train.bidirectional_epochs``; ``None`` when neither is on."""
    data = config.data
    base = subword_resegmenter(corpus, config) if config.train.subword_alpha > 0 else None
    if config.train.bidirectional_epochs == 0:
        return base
    return bidirectional_resegmenter(corpus.array(data.train_split, data.src_lang),
                                     corpus.array(data.train_split, data.tgt_lang),
                                     config.train.bidirectional_epochs, base)


def output_vocabulary(corpus: Any, config: Config) -> np.ndarray | None:
    """The sorted ids the decoder learns to produce under ``model.output_vocab: target``, else None.

    Every piece of the training split's target side, plus its source side while
    ``train.bidirectional_epochs`` make the source a target too, plus pad, unk, bos and eos. The
    config check keeps sampled segmentations (``train.subword_alpha``) off the target side, so
    the cached pieces are all the targets can hold. A pure function of the cache: every rank
    and every resume computes the same list.
    """
    if config.model.output_vocab == "joint":
        return None
    data = config.data
    langs = [data.tgt_lang] + ([data.src_lang] if config.train.bidirectional_epochs > 0 else [])
    used = np.zeros(corpus.vocab_size, dtype=bool)
    used[sorted(SPECIAL_IDS | {UNK_ID})] = True
    for lang in langs:
        used |= corpus.array(data.train_split, lang).id_counts(corpus.vocab_size) > 0
    return np.flatnonzero(used)
