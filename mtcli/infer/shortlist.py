"""Lexical shortlists (``decode.shortlist``): each batch decodes over the target pieces its
sources are likely to produce, instead of the whole output vocabulary.

On a CPU the largest product of a decoder step is the output projection, ``[rows, d_model] x
[d_model, V]``, and the normaliser then runs over its ``V`` columns. A lexical shortlist (Marian's
``--shortlist``, CTranslate2's vocabulary map) narrows ``V`` per batch to

- the special pieces,
- the ``decode.shortlist_frequent`` most frequent target pieces of the training split, and
- for each source piece in the batch, the ``decode.shortlist`` target pieces most often seen in
  the training pairs whose source holds it, ranked by ``p(t | s) = c(s, t) / c(s)`` (each piece
  counted once per sentence; at most :data:`MAX_PAIRS` pairs are read).

The table is built from the prepared cache the run was trained on (a second or two for
Multi30k) when a decoder first asks for it. The search then normalises over the candidates only,
as Marian and CTranslate2 do, so scores are no longer the model's exact log-probabilities and the
output may change: the option is off by default (exact search), and docs/decoding.md gives its
speed and its BLEU cost on val.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mtcli.config import Config
from mtcli.data.cache import PreparedCorpus, TokenArray
from mtcli.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from mtcli.errors import ConfigError
from mtcli.fileio import sha256_file
from mtcli.model import Transformer

#: Training pairs read to build a table, spread evenly over the split (enough for the counts to
#: settle; every corpus of a multilingual cache, laid one after another, in its share).
MAX_PAIRS = 500_000
SPECIALS = torch.tensor(sorted((PAD_ID, UNK_ID, BOS_ID, EOS_ID)))


@dataclass
class Restriction:
    """The output columns of one batch: ``ids`` (sorted joint ids, specials first, each on the
    model's output vocabulary) and ``product(hidden) -> [..., len(ids)]`` logits over them."""

    ids: Tensor
    product: Callable[[Tensor], Tensor]


@dataclass
class Shortlist:
    """Candidate target pieces: ``table[s]`` lists the best target ids for source id ``s`` (-1
    pads a short row); ``frequent`` are always candidates."""

    table: Tensor
    frequent: Tensor

    def candidates(self, src: Tensor) -> Tensor:
        """Sorted joint ids a batch ``src [B, S]`` decodes over (the special ids included)."""
        listed = self.table[torch.unique(src.cpu())].flatten()
        return torch.unique(torch.cat([SPECIALS, self.frequent, listed[listed >= 0]]))

    def restrict(self, model: Transformer, src: Tensor) -> Restriction:
        """The columns and output product of ``model`` for batch ``src``."""
        ids = self.candidates(src).to(src.device)
        if model.output_ids is not None:  # keep the candidates on the output vocabulary
            positions = model.output_index[ids]
            positions = positions[model.output_ids[positions] == ids]
            ids = model.output_ids[positions]
        else:
            positions = ids
        return Restriction(ids, model.output_rows(positions))


def build_shortlist(source: TokenArray, target: TokenArray, vocab_size: int, per_source: int,
                    frequent: int, max_pairs: int = MAX_PAIRS) -> Shortlist:
    """Count which target pieces appear with each source piece over ``max_pairs`` pairs spread
    evenly over all of them (not the first ones, which a multilingual cache gives to its first
    corpus), keep the ``per_source`` likeliest per source piece and the ``frequent`` most
    frequent target pieces (see the module docstring)."""
    total = min(len(source), len(target))
    rows = range(total) if total <= max_pairs else np.linspace(0, total - 1, max_pairs).round().astype(np.int64)
    per_source = min(per_source, vocab_size)  # (more is the whole vocabulary too)
    source_count = np.zeros(vocab_size, dtype=np.int64)
    target_count = np.zeros(vocab_size, dtype=np.int64)
    keys = []
    for i in rows:
        s, t = np.unique(source[i]), np.unique(target[i])
        source_count[s] += 1
        target_count[t] += 1
        keys.append((s.astype(np.int64)[:, None] * vocab_size + t[None, :]).ravel())
    table = np.full((vocab_size, per_source), -1, dtype=np.int64)
    if keys:
        joint, counts = np.unique(np.concatenate(keys), return_counts=True)
        s_of, t_of = joint // vocab_size, joint % vocab_size
        order = np.lexsort((-counts / source_count[s_of], s_of))  # by source, likeliest first
        s_sorted = s_of[order]
        rank = np.arange(len(order)) - np.searchsorted(s_sorted, s_sorted)
        kept = rank < per_source
        table[s_sorted[kept], rank[kept]] = t_of[order][kept]
    top = np.argsort(-target_count, kind="stable")[:frequent]
    return Shortlist(torch.from_numpy(table), torch.from_numpy(top[target_count[top] > 0]))


def shortlist_for(config: Config, per_source: int, frequent: int, tokenizer_sha256: str) -> Shortlist:
    """The shortlist of a run whose config is ``config``, built from the training split of the
    prepared cache it was trained on; :class:`ConfigError` when that cache is gone, or was
    prepared again since with another tokenizer (``tokenizer_sha256``: the run's; the cache's
    ids would be other pieces)."""
    path = config.data.prepared_path()
    hint = "run `mtcli prepare` on the run's recipe, or set decode.shortlist=0"
    if not (path / "manifest.json").is_file():
        raise ConfigError(f"decode.shortlist builds its table from the prepared cache {path}, which is not there: {hint}")
    corpus = PreparedCorpus.open(path, verify=False)
    if sha256_file(corpus.spm_path) != tokenizer_sha256:
        raise ConfigError(f"decode.shortlist builds its table from the prepared cache {path}, whose tokenizer is not "
                          f"this run's (it was prepared again since): {hint}")
    return build_shortlist(*corpus.train_pairs(), corpus.vocab_size, per_source, frequent)


__all__ = ["MAX_PAIRS", "Restriction", "Shortlist", "build_shortlist", "shortlist_for"]
