"""Subword regularisation: a fresh random segmentation of the training text every epoch.

Kudo (2018) trains on segmentations sampled from the unigram language model of the
SentencePiece vocabulary instead of always the single best one::

    P(x | X) = P_unigram(x) ** alpha / sum_x' P_unigram(x') ** alpha

where ``x`` ranges over the segmentations of the sentence ``X``. Smaller ``alpha`` gives more
varied segmentations (``alpha = 0`` is uniform); large ``alpha`` approaches the best one.

SentencePiece does not split pieces across whitespace, so a sentence's segmentation is the
concatenation of independent segmentations of its words, and ``P(x | X)`` factorises over the
words. :class:`WordSegmentationSampler` therefore asks SentencePiece once for the ``nbest``
best segmentations of every distinct word, with their log-probabilities, and then draws each
epoch's segmentation with NumPy: one candidate per word occurrence, ``P(candidate) ∝
exp(alpha * log P_unigram)`` among the word's candidates (Kudo's ``l``-best sampling, per word).

This is our own sampler rather than SentencePiece's ``enable_sampling`` because the latter's
random generator cannot be seeded reproducibly across processes (the same seed gives different
draws in two processes), while an epoch's segmentation must be the same on every DDP rank and
after a resume. Here it is a pure function of ``(seed, epoch, side)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mtcli.config import Config
from mtcli.data.cache import ConcatArray, PrefixedArray, PreparedCorpus
from mtcli.data.textio import read_lines
from mtcli.data.tokenizer import Tokenizer
from mtcli.errors import ConfigError, DataError
from mtcli.logs import get_logger


class FlatSentences:
    """Sentences as one flat id array plus offsets (a :class:`~mtcli.data.batching.SentenceArray`).

    ``overrides`` maps sentence indices to fixed ids that replace the flat slice.
    """

    def __init__(self, ids: np.ndarray, offsets: np.ndarray,
                 overrides: dict[int, np.ndarray] | None = None) -> None:
        self.ids = ids
        self.offsets = offsets
        self.overrides = overrides or {}
        self.lengths = np.diff(offsets).astype(np.int64)
        for i, fixed in self.overrides.items():
            self.lengths[i] = len(fixed)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        fixed = self.overrides.get(int(i))
        if fixed is not None:
            return fixed
        return self.ids[self.offsets[i] : self.offsets[i + 1]]


class WordSegmentationSampler:
    """Draws a segmentation of a list of sentences, word by word, from n-best candidates.

    ``tokenizer`` is a :class:`~mtcli.data.tokenizer.Tokenizer` of a unigram model; ``best`` holds
    each sentence's deterministic ids (the cache). Sentences whose words' best segmentations do
    not concatenate to ``best`` (text the normaliser changes across word boundaries) keep
    ``best`` in every epoch; :attr:`fixed` counts them.
    """

    def __init__(self, tokenizer: Any, sentences: Sequence[str], best: Any, alpha: float,
                 nbest: int = 32) -> None:
        if alpha <= 0:
            raise ValueError("alpha must be > 0")
        types: dict[str, int] = {}
        token_types: list[int] = []
        word_offsets = np.zeros(len(sentences) + 1, dtype=np.int64)
        for i, line in enumerate(sentences):
            words = line.split()
            token_types.extend(types.setdefault(w, len(types)) for w in words)
            word_offsets[i + 1] = word_offsets[i] + len(words)
        self.token_types = np.asarray(token_types, dtype=np.int64)
        self.word_offsets = word_offsets

        # Candidates of every type, flattened: pieces, lengths, and a sampling key per candidate.
        results = tokenizer.nbest(list(types), int(nbest))
        pieces: list[int] = []
        starts: list[int] = []
        lengths: list[int] = []
        keys: list[float] = []
        first = np.zeros(len(types) + 1, dtype=np.int64)
        for t, result in enumerate(results):
            cands = result or [([], 0.0)]
            scores = np.array([s for _, s in cands], dtype=np.float64) * float(alpha)
            probs = np.exp(scores - scores.max())
            cum = np.cumsum(probs / probs.sum())
            cum[-1] = 1.0
            for (ids, _), c in zip(cands, cum, strict=True):
                starts.append(len(pieces))
                lengths.append(len(ids))
                pieces.extend(ids)
                keys.append(t + float(c))
            first[t + 1] = first[t] + len(cands)
        self.pieces = np.asarray(pieces, dtype=np.int32)
        self.cand_start = np.asarray(starts, dtype=np.int64)
        self.cand_len = np.asarray(lengths, dtype=np.int64)
        self.cand_key = np.asarray(keys, dtype=np.float64)

        # Sentences whose best-candidate concatenation is not the cached segmentation.
        viterbi = self._assemble(first[:-1][self.token_types], {})
        self.overrides: dict[int, np.ndarray] = {}
        for i in range(len(sentences)):
            want = np.asarray(best[i], dtype=np.int32)
            if not np.array_equal(want, viterbi[i]):
                self.overrides[i] = want
        if self.fixed:
            get_logger().info("subword sampling: %d of %d sentences keep their best segmentation "
                              "(the normaliser changes them across words)", self.fixed, len(sentences))

    @property
    def fixed(self) -> int:
        """How many sentences keep their cached segmentation in every epoch."""
        return len(self.overrides)

    def _assemble(self, chosen: np.ndarray, overrides: dict[int, np.ndarray]) -> FlatSentences:
        """Concatenate the chosen candidate of every word occurrence into sentences."""
        lens = self.cand_len[chosen]
        out_offsets = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=out_offsets[1:])
        total = int(out_offsets[-1])
        gather = np.repeat(self.cand_start[chosen] - out_offsets[:-1], lens) + np.arange(total)
        ids = self.pieces[gather]
        return FlatSentences(ids, out_offsets[self.word_offsets], overrides)

    def sample(self, rng: np.random.Generator) -> FlatSentences:
        """One segmentation of every sentence, drawn with ``rng``."""
        u = rng.random(len(self.token_types))
        chosen = np.searchsorted(self.cand_key, self.token_types + u, side="right")
        return self._assemble(chosen, self.overrides)


__all__ = ["FlatSentences", "WordSegmentationSampler"]


class _Unprefixed:
    """The sentences of ``array`` without their first ``n`` ids (a corpus's tags)."""

    def __init__(self, array: Any, n: int) -> None:
        self.array, self.n = array, n

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.array[i][self.n:]


def _side_sampler(corpus: PreparedCorpus, split: str, lang: str, prefix: list[int], tokenizer: Tokenizer,
                  config: Config) -> WordSegmentationSampler:
    """A sampler over the cleaned text of ``split`` in ``lang``; its cached ids start with ``prefix``."""
    best = corpus.array(split, lang)
    path = corpus.text_path(split, lang)
    lines = list(read_lines(path))
    if len(lines) != len(best):
        raise DataError(f"{path}: {len(lines)} lines, but the cache holds {len(best)} sentences; "
                        f"re-run `{config.prepare_command()}`")
    return WordSegmentationSampler(tokenizer, lines, _Unprefixed(best, len(prefix)) if prefix else best,
                                   config.train.subword_alpha, nbest=config.train.subword_nbest)


def subword_resegmenter(corpus: PreparedCorpus, config: Config
                        ) -> Callable[[int], tuple[Any, Any]]:
    """``resegment(epoch) -> (src, tgt)``: the training pairs with a segmentation sampled for
    ``epoch`` (``train.subword_alpha`` > 0), what :class:`~mtcli.data.batching.BatchStream`
    reads each epoch instead of the cached pairs (:meth:`PreparedCorpus.train_pairs`).

    The cleaned training text the cache was encoded from is read once, and each sampled side
    gets a :class:`WordSegmentationSampler`: both sides, or with ``train.subword_sides: source``
    the source only (the target keeps its cached segmentation). With several corpora
    (``data.sources``) each corpus's sides get their own samplers, and a source keeps its tags
    (they are whole symbols, never segmented) in front of its sampled pieces. Epoch ``e`` draws
    with a NumPy generator seeded by ``(train.seed, e, side)``, and with several corpora
    ``(train.seed, e, side, corpus)``, so every rank and every resume sees the same pieces.
    """
    data, seed = config.data, config.train.seed
    tokenizer = Tokenizer(corpus.spm_path)
    try:
        tokenizer.nbest(["a"], 2)
    except RuntimeError:  # "NBestEncode is not available for the current model"
        raise ConfigError(f"train.subword_alpha > 0 samples from a unigram SentencePiece model; {corpus.spm_path} is "
                          "not one (a data.spm_model of another type): set train.subword_alpha=0") from None
    if corpus.corpora:
        parts = [(c["split"], c["langs"], [corpus.tags[t] for t in c.get("prefix", [])]) for c in corpus.corpora]
    else:
        parts = [(data.train_split, [data.src_lang, data.tgt_lang], [])]
    sides: list[list[Any]] = []  # per corpus: [source, target], each a sampler or the cached ids
    for split, langs, prefix in parts:
        src = _side_sampler(corpus, split, langs[0], prefix, tokenizer, config)
        tgt = (corpus.array(split, langs[1]) if config.train.subword_sides == "source"
               else _side_sampler(corpus, split, langs[1], [], tokenizer, config))
        sides.append([src, tgt])

    def draw(k: int, side: int, epoch: int) -> Any:
        sampler = sides[k][side]
        if not isinstance(sampler, WordSegmentationSampler):
            return sampler
        key = [seed, epoch, side, k] if corpus.corpora else [seed, epoch, side]
        sampled = sampler.sample(np.random.default_rng(key))
        prefix = parts[k][2] if side == 0 else []
        return PrefixedArray(sampled, prefix) if prefix else sampled

    def resegment(epoch: int) -> tuple[Any, Any]:
        src, tgt = ([draw(k, side, epoch) for k in range(len(parts))] for side in (0, 1))
        if not corpus.corpora:
            return src[0], tgt[0]
        return ConcatArray(src), ConcatArray(tgt)

    return resegment
