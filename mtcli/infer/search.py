"""Batched greedy and beam search over a trained :class:`~mtcli.model.Transformer` (or an ensemble).

``generate(model, src, ...)`` decodes every row of a padded source batch and returns, per row,
an n-best list of :class:`Hypothesis` (best first).

Scoring. A hypothesis ``y = y_1..y_n`` (eos excluded) has
``logprob = sum_t log p(y_t | y_<t, x) + log p(eos | y, x)`` and
``score = logprob / lp(n + 1)`` with the GNMT length penalty (Wu et al., 2016)
``lp(L) = ((5 + L) / 6) ** alpha`` (``alpha = length_penalty``; 0 means no penalty, score =
logprob). The length ``L`` counts eos. Pad and bos are never produced (their log-probability is set to -inf before choosing; the log-probabilities
of the chosen tokens are the model's own).

Length. A source of ``m`` tokens (eos excluded) gets at most ``max_len = int(a*m + b)`` output
tokens before eos (eos is forced after that), capped so bos + tokens fit ``max_positions``.

Beam search keeps ``beam_size`` live hypotheses per sentence in a flat ``[sentences*beam]``
layout. Each step looks at the best ``2*beam`` extensions: an extension by eos that ranks among
the best ``beam`` is finished; the best ``beam`` extensions by other tokens stay live. A sentence
is done once it has ``nbest`` finished hypotheses and no live one can beat the ``nbest``-th:
log-probabilities only fall as a hypothesis grows and, with ``alpha >= 0``, ``lp`` only grows, so
a live hypothesis can at best reach ``logprob / lp(max_len + 1)``. (With ``alpha < 0`` the bound does not hold and the search runs to the length limit.) Done sentences leave the batch at
once (their rows are dropped from the decoder cache), so the batch shrinks as it decodes.

Greedy search (``beam_size=1``) is a separate, leaner loop with the same scoring.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mtcli.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtcli.errors import ConfigError
from mtcli.infer import sampling
from mtcli.infer.ensemble import Ensemble, decoding_members
from mtcli.infer.shortlist import Restriction, Shortlist
from mtcli.model import DecoderCache, EncoderOutput, Transformer, Workspace


@dataclass
class Hypothesis:
    """One output of the search.

    ``tokens`` exclude bos/eos; ``score`` is the length-penalised log-probability that the search
    ranks by; ``logprob`` the sum of token log-probabilities including eos; ``attention`` the
    head-averaged cross-attention ``[layers, len(tokens)+1, source length incl. eos]`` (row ``t``
    is the step that produced token ``t``, the last row produced eos) when asked for, else None.
    """

    tokens: list[int]
    score: float
    logprob: float
    attention: Tensor | None = None


def length_penalty_factor(length: int | Tensor, alpha: float) -> float | Tensor:
    """GNMT length penalty ``lp(L) = ((5 + L) / 6) ** alpha`` (1 when ``alpha == 0``)."""
    if alpha == 0.0:
        return 1.0 if isinstance(length, int) else torch.ones_like(length, dtype=torch.float32)
    return ((5.0 + length) / 6.0) ** alpha


def _penalised(logprob: float, length: int, alpha: float) -> float:
    """A finished hypothesis's score: ``logprob / lp(length)``."""
    return logprob / length_penalty_factor(length, alpha)


def max_output_lengths(src: Tensor, a: float, b: int, max_positions: int) -> Tensor:
    """Per row: ``int(a * m + b)`` where ``m`` is the source length without eos and padding,
    capped at ``max_positions - 1`` (bos + tokens must fit the positional table)."""
    m = src.ne(PAD_ID).sum(1) - 1
    lengths = (a * m.clamp(min=0).double() + b).floor().long()
    return lengths.clamp(min=0, max=max_positions - 1)


#: log2(e): ``exp(y) = 2 ** (y * LOG2E)``; ``exp2`` is about 2x faster than ``exp`` on a CPU.
LOG2E = 1.4426950408889634
#: Width of the vocabulary chunks of the two-stage top-k (see :class:`StepScores`).
CHUNK = 64


def chunk_width(vocab: int, preferred: int = CHUNK) -> int:
    """Chunk width for a vocabulary: a divisor of ``vocab`` that is a multiple of 8 near
    ``preferred`` when there is one (no padding needed), else ``preferred`` (the logits are then
    padded with -inf up to a multiple of it)."""
    if vocab <= preferred:
        return vocab
    divisors = [c for c in range(8, 2 * preferred + 1, 8) if vocab % c == 0]
    return min(divisors, key=lambda c: abs(c - preferred)) if divisors else preferred


def log_normalizer(logits: Tensor, out: Tensor | None = None, m: Tensor | None = None) -> Tensor:
    """``log sum_v exp(logits[r, v])`` per row of ``logits [R, V]`` (float32), i.e. ``logZ`` in
    ``log p(v) = logits[v] - logZ``.

    Computed as ``m + log(sum_v 2 ** ((logits[v] - m) * log2(e)))`` with ``m [R]`` the row
    maximum (computed when not given), in one scaled pass into ``out`` (a scratch ``[R, V]``
    float32 buffer, allocated if None), an in-place ``exp2`` and a sum: about 2x cheaper than
    ``log_softmax`` over the whole vocabulary, whose full-size output the search never needs.
    """
    if m is None:
        m = logits.amax(dim=1)
    if out is None:
        out = torch.empty_like(logits)
    torch.add(m[:, None] * -LOG2E, logits, alpha=LOG2E, out=out)
    return out.exp2_().sum(dim=1).log_().add_(m)


@dataclass
class StepScores:
    """The next-token distribution of every decoder row, kept as logits.

    ``log p(v | row) = logits[row, v] - lse[row]``. ``logits [R, C * chunks]`` float32 has pad and
    bos at -inf, every token but eos at -inf in rows at their length limit, and -inf padding
    columns past the vocabulary (``chunk_max`` never picks them while a finite value is left);
    ``chunk_max [R, chunks]`` is the maximum of each run of ``C`` columns. A top-k then looks
    only inside the best ``k`` chunks, which hold the best ``k`` values (exact: a chunk holding
    one of them has a maximum at least the k-th value), instead of sorting the whole vocabulary.
    """

    logits: Tensor
    lse: Tensor
    chunk_max: Tensor
    width: int
    vocab: int  # real vocabulary size: columns past it are -inf padding
    ids: Tensor | None = None  # column -> token id (the model's output vocabulary), else identity

    @property
    def chunks(self) -> int:
        """Number of vocabulary chunks."""
        return self.chunk_max.size(1)

    def greedy(self) -> tuple[Tensor, Tensor]:
        """Per row: the most probable token and its log-probability (first one on ties)."""
        best, chunk = self.chunk_max.max(dim=1)
        rows = torch.arange(chunk.numel(), device=chunk.device)
        inside = self.logits.view(rows.numel(), self.chunks, self.width)[rows, chunk]
        return self._ids(chunk * self.width + inside.argmax(dim=1)), best - self.lse

    def _ids(self, column: Tensor) -> Tensor:
        return column if self.ids is None else self.ids[column]

    def top_extensions(self, scores: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """The best ``n`` extensions of each sentence's hypotheses.

        ``scores [m, b]`` are the log-probabilities of the ``b`` hypotheses (rows ``s*b + j``) of
        each of ``m`` sentences. Returns ``(score [m, n], beam [m, n], token [m, n])`` best first,
        ``score = scores[s, beam] + log p(token | that hypothesis)``.
        """
        m, b = scores.shape
        c, chunks = self.width, self.chunks
        offset = scores.reshape(-1) - self.lse  # [m*b]: score - logZ of each row
        bound = (self.chunk_max + offset[:, None]).view(m, b * chunks)
        picked = bound.topk(min(n, b * chunks), dim=1).indices  # [m, n'] best chunks
        beam, chunk = picked // chunks, picked % chunks
        row = torch.arange(m, device=scores.device)[:, None] * b + beam  # [m, n']
        values = self.logits.view(-1, c).index_select(0, (row * chunks + chunk).view(-1))
        values = values.view(m, -1, c).add_(offset[row][..., None])  # [m, n', c]
        top, pos = values.view(m, -1).topk(n, dim=1)
        slot = pos // c
        column = (chunk.gather(1, slot) * c + pos % c).clamp_(max=self.vocab - 1)
        return top, beam.gather(1, slot), self._ids(column)


def step_scores(
    logits: Tensor, limit_rows: Tensor, width: int, scratch: Tensor | None = None,
    ids: Tensor | None = None, padded: Tensor | None = None,
) -> StepScores:
    """:class:`StepScores` from the raw decoder logits ``[R, V]`` (taken over and modified).

    ``ids``: the token id of each column when the logits cover an output vocabulary (the
    model's ``output_ids``, whose special ids are their own columns), else column = id.
    ``scratch`` and ``padded``: reusable ``[R, C * chunks]`` float32 buffers for the
    normaliser's pass and, when ``V`` is not a multiple of ``width``, for the logits with their
    -inf padding columns (each allocated when None or of another shape; a fresh padded copy
    costs more than the copy itself, its first touch of new memory included).

    ``logZ`` is over the model's whole distribution (pad and bos included), so a chosen token's
    log-probability is the model's own; then pad, bos, and every token but eos in the rows where
    ``limit_rows`` is True, are set to -inf.
    """
    rows, vocab = logits.shape
    logits = logits.float()
    if vocab % width:
        columns = vocab + width - vocab % width
        if padded is None or padded.shape != (rows, columns):
            padded = logits.new_empty((rows, columns))
        padded[:, vocab:] = float("-inf")
        padded[:, :vocab] = logits
        logits = padded
    chunk_max = logits.view(rows, -1, width).amax(dim=2)
    if scratch is not None and scratch.shape != logits.shape:
        scratch = None
    lse = log_normalizer(logits, scratch, chunk_max.amax(dim=1))
    logits[:, PAD_ID] = float("-inf")
    logits[:, BOS_ID] = float("-inf")
    for chunk in {PAD_ID // width, BOS_ID // width}:
        chunk_max[:, chunk] = logits[:, chunk * width : (chunk + 1) * width].amax(dim=1)
    if bool(limit_rows.any()):
        eos = logits[:, EOS_ID].clone()
        logits[limit_rows] = float("-inf")
        logits[:, EOS_ID] = eos
        chunk_max[limit_rows] = float("-inf")
        chunk_max[:, EOS_ID // width] = torch.where(
            limit_rows, eos, chunk_max[:, EOS_ID // width]
        )
    return StepScores(logits, lse, chunk_max, width, vocab, ids)


_LOCAL = threading.local()


def workspace(member: int = 0) -> Workspace:
    """This thread's decoding :class:`~mtcli.model.Workspace` (made on first use); an ensemble's
    ``member`` > 0 gets one of its own.

    ``generate`` decodes with it so that consecutive batches reuse the key/value caches,
    logits and scratch buffers instead of faulting in fresh memory each time;
    ``workspace().clear()`` gives that memory back.
    """
    spaces = getattr(_LOCAL, "workspaces", None)
    if spaces is None:
        spaces = _LOCAL.workspaces = []
    while len(spaces) <= member:
        spaces.append(Workspace())
    return spaces[member]


class _StepDecoder:
    """Scores of the next token for each row, with or without the key/value cache.

    ``group`` rows per sentence at the start (beam search starts with one; :meth:`reorder` can
    change it). With the cache only the newest token is fed; without it the decoder reruns over
    the whole prefix (for the benchmark and the equivalence test). With several ``models`` (an
    ensemble, each with its encoder output in ``encs``) the scores are those of the mean of
    their probabilities, ``log(1/M * sum_m p_m)`` (``ensemble_mode="linear"``), or of the
    renormalised mean of their log-probabilities, ``1/M * sum_m log p_m - log Z``
    (``"log_linear"``, a product of experts: a token must be likely under every member).
    """

    def __init__(
        self, models: list[Transformer], encs: list[EncoderOutput], group: int, max_len: int,
        use_cache: bool, ensemble_mode: str = "linear", restriction: Restriction | None = None,
    ) -> None:
        self.models = models
        self.log_linear = ensemble_mode == "log_linear"
        self.caches: list[DecoderCache] | None = None
        self.encs = encs
        self.restriction = restriction
        self.ids = models[0].output_ids if restriction is None else restriction.ids
        self.width = chunk_width(models[0].output_size if restriction is None else len(restriction.ids))
        self.workspace = workspace()
        if use_cache:
            self.caches = [m.init_cache(e, beam_size=group, max_len=max_len, workspace=workspace(i))
                           for i, (m, e) in enumerate(zip(models, encs, strict=True))]
            if restriction is not None:
                self.caches[0].output_product = restriction.product
        elif group > 1:
            self.encs = [e.repeat_interleave(group) for e in encs]

    def _logits(self, i: int, seq: Tensor) -> Tensor:
        model = self.models[i]
        if self.caches is not None:
            return model.decode(seq[:, -1:], self.encs[i], self.caches[i])[:, 0]
        hidden, _ = model.decoder(seq, self.encs[i])
        return (model.project if self.restriction is None else self.restriction.product)(hidden[:, -1])

    def scores(self, seq: Tensor, limit_rows: Tensor) -> StepScores:
        """:class:`StepScores` of the token after ``seq [rows, t]`` (bos + the tokens so far);
        rows where ``limit_rows`` is True may only end (eos)."""
        if len(self.models) == 1:
            logits = self._logits(0, seq)
        else:
            logp = torch.stack([self._logits(i, seq).float().log_softmax(-1)
                                for i in range(len(self.models))])
            if self.log_linear:  # step_scores renormalises (its log Z)
                logits = logp.mean(dim=0)
            else:  # log of the mean probability: logsumexp_m(log p_m) - log M
                logits = torch.logsumexp(logp, dim=0).sub_(math.log(len(self.models)))
        rows, vocab = logits.shape
        padded = -(-vocab // self.width) * self.width
        scratch = self.workspace.get("scratch", (rows, padded), torch.float32, logits.device)
        padded_logits = None
        if vocab % self.width:
            padded_logits = self.workspace.get("padded_logits", (rows, padded), torch.float32, logits.device)
        return step_scores(logits, limit_rows, self.width, scratch, self.ids, padded_logits)

    def reorder(self, index: Tensor, group: int | None = None) -> None:
        """Keep rows ``index`` (grouped by sentence, see :meth:`DecoderCache.reorder`)."""
        if self.caches is not None:
            for cache in self.caches:
                cache.reorder(index, group)
        else:
            self.encs = [e.select(index) for e in self.encs]


def _decode_rows(decoder: _StepDecoder, limits: Tensor, alpha: float,
                 choose: Callable[[StepScores, Tensor], tuple[Tensor, Tensor]],
                 store: Callable[[int, Hypothesis], None]) -> None:
    """Decode each row one token at a time until eos or its length limit (``limits``, per row):
    ``choose(scores, rows)`` gives the live rows' next tokens and their log-probabilities
    (``rows``: each live row's original index), ``store(row, hypothesis)`` takes each finished
    row. Finished rows leave the batch at once."""
    device = limits.device
    row = torch.arange(limits.numel(), device=device)  # original index of each live row
    seq = torch.full((limits.numel(), 1), BOS_ID, dtype=torch.long, device=device)
    logprob = torch.zeros(limits.numel(), dtype=torch.float32, device=device)
    for step in range(int(limits.max()) + 1):
        token, best = choose(decoder.scores(seq, limits.eq(step)), row)
        logprob = logprob + best
        seq = torch.cat([seq, token[:, None]], dim=1)
        finished = token.eq(EOS_ID)
        if not bool(finished.any()):
            continue
        done = finished.nonzero()[:, 0]
        for tokens, lp, original in zip(seq[done, 1:-1].tolist(), logprob[done].tolist(),
                                        row[done].tolist(), strict=True):
            store(original, Hypothesis(tokens, _penalised(lp, len(tokens) + 1, alpha), lp))
        kept = fill_from_the_end((~finished).nonzero()[:, 0].tolist())
        if not kept:
            break
        keep = torch.tensor(kept, device=device)
        decoder.reorder(keep)
        row, seq, logprob, limits = row[keep], seq[keep], logprob[keep], limits[keep]


def _greedy(
    models: list[Transformer], encs: list[EncoderOutput], max_lens: Tensor, alpha: float,
    use_cache: bool, ensemble_mode: str = "linear", restriction: Restriction | None = None,
) -> list[list[Hypothesis]]:
    """Greedy search: the most probable token at each step until eos or the length limit."""
    results: list[list[Hypothesis]] = [[] for _ in range(max_lens.numel())]
    decoder = _StepDecoder(models, encs, 1, int(max_lens.max()) + 1, use_cache, ensemble_mode, restriction)

    def store(original: int, hypothesis: Hypothesis) -> None:
        results[original] = [hypothesis]

    _decode_rows(decoder, max_lens, alpha, lambda scored, rows: scored.greedy(), store)
    return results


@dataclass(frozen=True)
class Sampling:
    """How :func:`generate` samples instead of searching (:mod:`mtcli.infer.sampling`)."""

    method: str  # topk | topp
    topk: int = 10
    topp: float = 0.9
    temperature: float = 1.0
    seed: int = 1


def _sample(
    models: list[Transformer], encs: list[EncoderOutput], src: Tensor, max_lens: Tensor, alpha: float,
    use_cache: bool, samples: int, how: Sampling, ensemble_mode: str = "linear",
) -> list[list[Hypothesis]]:
    """``samples`` translations of each sentence drawn token by token (:mod:`mtcli.infer.sampling`),
    in draw order. Each sample is a row of its own (row ``sentence * samples + sample``),
    decoded as greedy search decodes a sentence."""
    generators = sampling.row_generators(src, samples, how.seed)
    limits = max_lens.repeat_interleave(samples)
    found: list[list[Hypothesis | None]] = [[None] * samples for _ in range(max_lens.numel())]
    decoder = _StepDecoder(models, [e.repeat_interleave(samples) for e in encs], 1, int(limits.max()) + 1,
                           use_cache, ensemble_mode)

    def draw(scored: StepScores, rows: Tensor) -> tuple[Tensor, Tensor]:
        logp = scored.logits[:, :scored.vocab] - scored.lse[:, None]
        filtered = sampling.filtered_logprobs(logp, how.method, how.topk, how.topp, how.temperature)
        column = sampling.draw(filtered, [generators[r] for r in rows.tolist()])
        token = column if scored.ids is None else scored.ids[column]
        return token, logp.gather(1, column[:, None]).squeeze(1)

    def store(original: int, hypothesis: Hypothesis) -> None:
        found[original // samples][original % samples] = hypothesis

    _decode_rows(decoder, limits, alpha, draw, store)
    return [[h for h in hyps if h is not None] for hyps in found]


def fill_from_the_end(kept: list[int]) -> list[int]:
    """The positions ``kept`` (ascending) as an order that leaves each one where it is when it
    can: a kept position below ``len(kept)`` stays, and the last kept positions fill the gaps
    the others left. :meth:`~mtcli.model.DecoderCache.reorder` then copies only the rows of the
    sentences that fill a gap, not every sentence after the first one to finish."""
    n = len(kept)
    movers = iter(i for i in kept if i >= n)
    staying = {i for i in kept if i < n}
    return [i if i in staying else next(movers) for i in range(n)]


def keep_parent_rows(parent: Tensor) -> Tensor:
    """A placement of each sentence's next hypotheses on its ``k`` rows that leaves as many
    rows as it can where they are.

    ``parent [m, k]``: the row (``0..k-1`` within its sentence) each new hypothesis extends.
    Returns ``order [m, k]``: new row ``r`` of sentence ``s`` holds hypothesis ``order[s, r]``.
    Each parent's first child takes the parent's own row, so its key/value history stays in
    place (:meth:`~mtcli.model.DecoderCache.reorder` copies only the rows that change); the
    other children take, in order, the rows of the parents that have none.
    """
    k = parent.shape[1]
    same = parent[:, :, None].eq(parent[:, None, :])  # [m, j, i]: j and i extend one parent
    earlier = torch.ones(k, k, dtype=torch.bool, device=parent.device).tril(-1)  # i < j
    first = ~(same & earlier).any(dim=2)  # j is its parent's first child
    has_child = torch.zeros_like(first).scatter_(1, parent, True)
    childless = has_child.to(torch.uint8).argsort(dim=1, stable=True)  # childless rows first
    rank = (~first).long().cumsum(dim=1).sub_(1).clamp_(min=0)
    row = torch.where(first, parent, childless.gather(1, rank))
    return row.argsort(dim=1)


def _beam_search(
    models: list[Transformer], encs: list[EncoderOutput], max_lens: Tensor, alpha: float,
    use_cache: bool, beam_size: int, nbest: int, ensemble_mode: str = "linear",
    restriction: Restriction | None = None,
) -> list[list[Hypothesis]]:
    """Beam search (see the module docstring), ``beam_size`` hypotheses per sentence."""
    n, k, device = max_lens.numel(), beam_size, max_lens.device
    finished: list[list[Hypothesis]] = [[] for _ in range(n)]
    # The first step runs one row per sentence (all its beams would be equal); the first
    # reorder then fans each sentence out to its k beams.
    decoder = _StepDecoder(models, encs, 1, int(max_lens.max()) + 1, use_cache, ensemble_mode, restriction)
    sentence = torch.arange(n, device=device)  # original index of each live sentence
    seq = torch.full((n, 1), BOS_ID, dtype=torch.long, device=device)
    scores = torch.zeros((n, 1), device=device, dtype=torch.float32)  # [sentences, live beams]
    limits = max_lens
    bound_lp = length_penalty_factor(max_lens + 1, alpha) if alpha >= 0 else None
    for step in range(int(max_lens.max()) + 1):
        m, b = scores.shape
        scored = decoder.scores(seq, limits.eq(step).repeat_interleave(b))
        # the best 2k extensions of each sentence: at most k of them end (one per beam)
        top_scores, top_beam, top_token = scored.top_extensions(scores, 2 * k)
        is_eos = top_token.eq(EOS_ID)

        # finished: eos extensions among the best k (and not impossible)
        done_now = is_eos[:, :k] & top_scores[:, :k].gt(float("-inf"))
        if bool(done_now.any()):  # one gather each, not one tensor access per hypothesis
            s, j = done_now.nonzero().unbind(1)
            for tokens, lp, original in zip(seq[s * b + top_beam[s, j], 1:].tolist(), top_scores[s, j].tolist(),
                                            sentence[s].tolist(), strict=True):
                score = _penalised(lp, len(tokens) + 1, alpha)
                finished[original].append(Hypothesis(tokens, score, lp))

        # live: the best k extensions by a token other than eos (at most k of 2k are eos)
        live = ~is_eos & (~is_eos).cumsum(dim=1).le(k)
        scores = top_scores[live].view(m, k)
        next_beam = top_beam[live].view(m, k)
        next_token = top_token[live].view(m, k)
        if b == k:  # rows in no particular order from here: the cache copies fewer of them
            order = keep_parent_rows(next_beam)
            scores, next_beam, next_token = (t.gather(1, order) for t in (scores, next_beam, next_token))

        # a sentence is done when its nbest-th finished hypothesis beats every live one's bound
        kept: list[int] = []
        best_live = scores.amax(dim=1)  # -inf once the length limit forced eos everywhere
        if bound_lp is not None:
            bounds = (best_live / bound_lp[sentence]).tolist()
        else:
            bounds = [float("inf") if x > float("-inf") else x for x in best_live.tolist()]
        for i, original in enumerate(sentence.tolist()):
            hyps = finished[original]
            if len(hyps) >= nbest:
                hyps.sort(key=lambda h: h.score, reverse=True)
                del hyps[nbest:]
                if bounds[i] <= hyps[nbest - 1].score:
                    continue
            kept.append(i)
        rows = torch.arange(m, device=device)[:, None] * b + next_beam  # [m, k] old rows
        if len(kept) < m:
            if not kept:
                break
            keep = torch.tensor(fill_from_the_end(kept), device=device)
            rows, scores, next_token = rows[keep], scores[keep], next_token[keep]
            sentence, limits = sentence[keep], limits[keep]
        index = rows.view(-1)
        decoder.reorder(index, k)
        seq = torch.cat([seq[index], next_token.view(-1, 1)], dim=1)
    for hyps in finished:
        hyps.sort(key=lambda h: h.score, reverse=True)
        del hyps[nbest:]
    return finished


def _attach_attention(
    model: Transformer, src: Tensor, enc: EncoderOutput, results: list[list[Hypothesis]]
) -> None:
    """Fill ``Hypothesis.attention`` by one teacher-forced pass over all hypotheses."""
    flat = [(i, h) for i, hyps in enumerate(results) for h in hyps]
    if not flat:
        return
    longest = max(len(h.tokens) for _, h in flat) + 1
    tgt_in = torch.full((len(flat), longest), PAD_ID, dtype=torch.long, device=src.device)
    for r, (_, h) in enumerate(flat):
        tgt_in[r, 0] = BOS_ID
        if h.tokens:
            tgt_in[r, 1 : len(h.tokens) + 1] = torch.tensor(h.tokens, device=src.device)
    rows = torch.tensor([i for i, _ in flat], device=src.device)
    weights = model.cross_attention_weights(tgt_in, enc.select(rows)).float()
    src_lens = src.ne(PAD_ID).sum(1).tolist()
    for r, (i, h) in enumerate(flat):
        h.attention = weights[r, :, : len(h.tokens) + 1, : src_lens[i]].cpu()


def check_beam_width(beam_size: int, output_size: int) -> None:
    """:class:`ConfigError` for a beam wider than half the output vocabulary: each step keeps
    twice the beam's candidates, so that ended ones do not leave it short."""
    if beam_size > 1 and 2 * beam_size > output_size:
        raise ConfigError(f"decode.beam_size={beam_size} needs an output vocabulary of at least "
                          f"{2 * beam_size} pieces (this model has {output_size}: a beam of at most "
                          f"{output_size // 2})")


def generate(
    model: Transformer | Ensemble,
    src: Tensor,
    *,
    beam_size: int = 1,
    length_penalty: float = 0.0,
    max_len_a: float = 1.2,
    max_len_b: int = 10,
    nbest: int = 1,
    use_cache: bool = True,
    return_attention: bool = False,
    ensemble_mode: str = "linear",
    shortlist: Shortlist | None = None,
    sample: Sampling | None = None,
) -> list[list[Hypothesis]]:
    """Translate a padded source batch: one n-best list (best first) per row of ``src``.

    ``src [B, S]`` holds ids + eos, right-padded with pad (0), on the model's device. Greedy when
    ``beam_size == 1``; ``length_penalty`` is GNMT's alpha (see the module docstring); at most
    ``int(max_len_a * m + max_len_b)`` tokens before eos for a source of ``m`` tokens. ``use_cache=False`` reruns the
    decoder over the whole prefix each step (same results, slower). ``return_attention`` fills
    :attr:`Hypothesis.attention` (one extra teacher-forced pass; an ensemble's first member's).
    ``model`` may be an :class:`~mtcli.infer.ensemble.Ensemble`: the search then runs on the mean of
    its members' probabilities, or with ``ensemble_mode="log_linear"`` on the renormalised mean
    of their log-probabilities. ``shortlist`` restricts every step to the batch's candidate pieces
    (:mod:`mtcli.infer.shortlist`; one model only). With ``sample`` the ``nbest`` translations
    of each row are drawn instead of searched (:class:`Sampling`, :mod:`mtcli.infer.sampling`;
    ``beam_size`` is not used). The model runs in eval mode under ``torch.inference_mode()``;
    its previous train/eval mode is restored afterwards.
    """
    if beam_size < 1:
        raise ConfigError(f"decode.beam_size must be >= 1, got {beam_size}")
    if sample is not None:
        sampling.check_settings(sample.method, sample.topk, sample.topp, sample.temperature, nbest)
        if shortlist is not None:
            raise ConfigError("decode.sampling draws from the whole vocabulary: set decode.shortlist=0")
        beam_size = 1
    elif not 1 <= nbest <= beam_size:
        raise ConfigError(f"decode.nbest must be between 1 and beam_size={beam_size}, got {nbest}")
    check_beam_width(beam_size, model.output_size)
    if ensemble_mode not in ("linear", "log_linear"):
        raise ConfigError(f"decode.ensemble_mode must be linear or log_linear, got {ensemble_mode!r}")
    if shortlist is not None and isinstance(model, Ensemble):
        raise ConfigError("decode.shortlist decodes one model, not an --ensemble")
    if src.dim() != 2:
        raise ValueError(f"generate expects src [B, S], got shape {list(src.shape)}")
    if src.size(0) == 0:
        return []
    if not bool(src.ne(PAD_ID).any(dim=1).all()):  # attention over no key at all: NaN scores, no hypotheses
        raise ValueError("generate: a row of src holds only pad; every source holds at least its eos")
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            members = decoding_members(model)
            encs = [m.encode(src) for m in members]
            max_lens = max_output_lengths(src, max_len_a, max_len_b, model.max_positions)
            restriction = None if shortlist is None else shortlist.restrict(members[0], src)
            if restriction is not None and len(restriction.ids) < 2 * beam_size:
                restriction = None  # too few candidates for the beam: the whole vocabulary
            if sample is not None:
                results = _sample(members, encs, src, max_lens, length_penalty, use_cache, nbest, sample,
                                  ensemble_mode)
            elif beam_size == 1:
                results = _greedy(members, encs, max_lens, length_penalty, use_cache, ensemble_mode,
                                  restriction)
            else:
                results = _beam_search(members, encs, max_lens, length_penalty, use_cache, beam_size, nbest,
                                       ensemble_mode, restriction)
            if return_attention:
                _attach_attention(members[0], src, encs[0], results)
    finally:
        model.train(was_training)
    return results
