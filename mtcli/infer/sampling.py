"""Sampling decoding: ``n`` translations drawn from the model's distribution, for
back-translation (Edunov et al., 2018) and for diverse outputs.

At each step the next token of a row is drawn from ``softmax(log p / T)`` (``temperature``
``T``) restricted to the ``topk`` most probable tokens (``sampling: topk``; fairseq's
``--sampling-topk``) or to the smallest set whose probability reaches ``topp`` (``sampling:
topp``, nucleus sampling). Pad and bos are never drawn; at the length limit eos is forced, as in
search. A hypothesis' ``logprob`` is the model's own log-probability of the drawn tokens (not the
tempered one), and its ``score`` is that over the GNMT length penalty, as search gives.

Seeded and independent of batching: each sample of each source row draws from its own generator,
seeded by ``seed``, the source's pieces and the sample's number. The same input, model and
settings give the same samples whether a sentence is decoded alone, in a batch, or beside
another client's requests in ``mtcli serve``.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from mtcli.data.tokenizer import PAD_ID
from mtcli.errors import ConfigError

METHODS = ("topk", "topp")


def row_generators(src: Tensor, samples: int, seed: int) -> list[torch.Generator]:
    """One generator per (source row, sample), in that order: seeded by ``seed``, the row's
    pieces (padding excluded) and the sample's number."""
    out = []
    for row in src.tolist():
        pieces = [t for t in row if t != PAD_ID]
        for k in range(samples):
            digest = hashlib.blake2b(repr((seed, k, pieces)).encode(), digest_size=8).digest()
            out.append(torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1))
    return out


def filtered_logprobs(logprobs: Tensor, method: str, topk: int, topp: float, temperature: float) -> Tensor:
    """``log p / T`` with every token outside the ``topk`` best, or outside the nucleus of mass
    ``topp``, at -inf (``[rows, V]``, float32; the input is not modified)."""
    scaled = logprobs / temperature
    if method == "topk":
        k = min(topk, scaled.size(-1))
        kth = scaled.topk(k, dim=-1).values[:, -1:]
        return scaled.masked_fill(scaled < kth, float("-inf"))
    ordered, order = scaled.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # the mass of the tokens ranked above each one
    outside = before >= topp
    outside[:, 0] = False  # the best token always stays (a topp below float32's least value reads as 0)
    ordered = ordered.masked_fill(outside, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, ordered)


def draw(logits: Tensor, generators: list[torch.Generator]) -> Tensor:
    """One token per row of (filtered, tempered) ``logits``, row ``i`` drawn with
    ``generators[i]`` by the inverse of its cumulative distribution: the first token whose
    cumulative probability reaches a uniform draw ``u``, which is kept above 0 (``torch.rand``
    gives exactly 0 once in 2^24 draws, which would take the first token, ``<pad>``, of
    probability 0), so that a token of probability 0 is never drawn."""
    probs = logits.float().softmax(dim=-1).cpu()
    cdf = probs.cumsum(dim=-1)
    u = (torch.cat([torch.rand(1, generator=g, dtype=torch.float32) for g in generators]) * cdf[:, -1]).clamp(
        min=torch.finfo(torch.float32).tiny)
    tokens = torch.searchsorted(cdf, u[:, None]).squeeze(1).clamp(max=logits.size(-1) - 1)
    return tokens.to(logits.device)


def check_settings(method: str, topk: int, topp: float, temperature: float, samples: int) -> None:
    """Raise :class:`ConfigError` naming the ``decode.*`` key of an unusable setting."""
    if method not in METHODS:
        raise ConfigError(f"decode.sampling must be one of {', '.join(METHODS)} (or none), got {method!r}")
    if topk < 1:
        raise ConfigError(f"decode.topk must be >= 1, got {topk}")
    if not 0.0 < topp <= 1.0:
        raise ConfigError(f"decode.topp must be in (0, 1], got {topp}")
    if temperature <= 0.0:
        raise ConfigError(f"decode.temperature must be > 0, got {temperature}")
    if samples < 1:
        raise ConfigError(f"decode.nbest (samples per input) must be >= 1, got {samples}")


__all__ = ["METHODS", "check_settings", "draw", "filtered_logprobs", "row_generators"]
