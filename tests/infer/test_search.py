"""Tests for mtcli.infer.search: greedy and beam search on random and tiny trained models."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import mtcli.infer.search as search
from mtcli.config import ModelConfig
from mtcli.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtcli.errors import ConfigError
from mtcli.infer.search import (
    Hypothesis,
    _beam_search,
    _greedy,
    chunk_width,
    fill_from_the_end,
    generate,
    keep_parent_rows,
    length_penalty_factor,
    log_normalizer,
    max_output_lengths,
    step_scores,
)
from mtcli.model import Transformer

VOCAB = 24
TOY_VOCAB = 14  # 4 specials + 10 symbols for the copy/reverse tasks


def random_model(seed: int = 0, **overrides) -> Transformer:
    values = dict(
        d_model=32, n_heads=4, encoder_layers=2, decoder_layers=2, d_ff=64,
        dropout=0.1, attention_dropout=0.1, max_positions=64,
    )
    values.update(overrides)
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**values), VOCAB).eval()


def pad_batch(rows: list[list[int]]) -> torch.Tensor:
    """Right-padded ``ids + [eos]`` rows."""
    width = max(len(r) for r in rows) + 1
    out = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r) + 1] = torch.tensor(r + [EOS_ID])
    return out


def random_sources(seed: int = 1, n: int = 5, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g).tolist()
    return [torch.randint(4, vocab, (k,), generator=g).tolist() for k in lengths]


def teacher_forced_logprob(model: Transformer, src_ids: list[int], tokens: list[int]) -> float:
    """log p(tokens + eos | src) by one teacher-forced forward pass."""
    src = pad_batch([src_ids])
    tgt_in = torch.tensor([[BOS_ID] + tokens])
    tgt_out = torch.tensor(tokens + [EOS_ID])
    with torch.no_grad():
        lprobs = torch.log_softmax(model.widen(model(src, tgt_in))[0].float(), dim=-1)
    return lprobs.gather(1, tgt_out[:, None]).sum().item()


def tokens_of(results: list[list[Hypothesis]]) -> list[list[list[int]]]:
    return [[h.tokens for h in hyps] for hyps in results]


@pytest.mark.parametrize("beam", [1, 4])
def test_cached_and_uncached_decoding_agree(beam: int) -> None:
    model = random_model()
    src = pad_batch(random_sources())
    kwargs = dict(beam_size=beam, nbest=beam, length_penalty=1.0)
    cached = generate(model, src, **kwargs)
    uncached = generate(model, src, use_cache=False, **kwargs)
    assert tokens_of(cached) == tokens_of(uncached)
    for a, b in zip(cached, uncached, strict=True):
        for ha, hb in zip(a, b, strict=True):
            assert ha.score == pytest.approx(hb.score, abs=1e-4)
            assert ha.logprob == pytest.approx(hb.logprob, abs=1e-4)


@pytest.mark.parametrize("seed", [11, 12, 13])
@pytest.mark.parametrize("beam", [1, 3])
def test_in_place_cache_reorders_agree_with_uncached_decoding(seed: int, beam: int) -> None:
    """Sentences finishing at many different steps: the cache's in-place reorders (rows moved
    within a sentence, finished sentences' places taken by the last live ones) decode what
    rerunning the decoder over the whole prefix decodes."""
    model = random_model(seed=seed)
    sources = random_sources(seed=seed, n=9)
    kwargs = dict(beam_size=beam, nbest=beam, length_penalty=1.0, max_len_a=1.5, max_len_b=3)
    cached = generate(model, pad_batch(sources), **kwargs)
    uncached = generate(model, pad_batch(sources), use_cache=False, **kwargs)
    assert tokens_of(cached) == tokens_of(uncached)
    for a, b in zip(cached, uncached, strict=True):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)
    assert len({len(hyps[0].tokens) for hyps in cached}) > 2  # sentences end at several steps


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_of_one_equals_greedy(use_cache: bool) -> None:
    model = random_model(seed=2)
    src = pad_batch(random_sources(seed=3, n=6))
    with torch.inference_mode():
        enc = model.encode(src)
        max_lens = max_output_lengths(src, 1.2, 10, model.cfg.max_positions)
        greedy = _greedy([model], [enc], max_lens, 0.6, use_cache)
        beam = _beam_search([model], [enc], max_lens, 0.6, use_cache, beam_size=1, nbest=1)
    assert tokens_of(greedy) == tokens_of(beam)
    for g, b in zip(greedy, beam, strict=True):
        assert g[0].score == pytest.approx(b[0].score, abs=1e-4)
    assert tokens_of(generate(model, src, length_penalty=0.6)) == tokens_of(greedy)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
@pytest.mark.parametrize("beam", [1, 3])
def test_reported_score_equals_teacher_forced_logprob(alpha: float, beam: int) -> None:
    model = random_model(seed=4)
    sources = random_sources(seed=5, n=4)
    results = generate(model, pad_batch(sources), beam_size=beam, nbest=beam, length_penalty=alpha)
    for src_ids, hyps in zip(sources, results, strict=True):
        for h in hyps:
            logprob = teacher_forced_logprob(model, src_ids, h.tokens)
            assert h.logprob == pytest.approx(logprob, abs=1e-4)
            penalty = ((5 + len(h.tokens) + 1) / 6) ** alpha
            assert h.score == pytest.approx(logprob / penalty, abs=1e-4)


def test_nbest_lists_are_sorted_distinct_and_complete() -> None:
    model = random_model(seed=6)
    results = generate(model, pad_batch(random_sources(seed=7)), beam_size=5, nbest=4,
                       length_penalty=1.0)
    for hyps in results:
        assert len(hyps) == 4
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 4


def test_beam_finds_at_least_the_greedy_score() -> None:
    model = random_model(seed=8)
    src = pad_batch(random_sources(seed=9, n=6))
    greedy = generate(model, src)
    beam = generate(model, src, beam_size=6)
    for g, b in zip(greedy, beam, strict=True):
        assert b[0].score >= g[0].score - 1e-5


def test_early_stopping_loses_no_hypothesis(monkeypatch) -> None:
    """A sentence leaves the beam only when no live hypothesis can still enter its n-best list:
    the n-best lists (tokens and scores) equal those of the same search run to the length limit.
    The bound is a live hypothesis' log-probability over lp(max_len + 1) (not lp(1)), compared
    with the nbest-th finished score (not the best). The models' eos is raised so that
    hypotheses end at many lengths and the n-best lists fill before the limit."""
    def settings(seed: int, alpha: float) -> list[list[tuple[list[int], float]]]:
        model = random_model(seed=seed, output_bias=True)
        model.output_bias[EOS_ID] = 3.0
        src = pad_batch(random_sources(seed=seed + 100, n=4))
        results = generate(model, src, beam_size=4, nbest=4, length_penalty=alpha)
        return [[(h.tokens, h.score) for h in hyps] for hyps in results]

    cases = [(seed, alpha) for seed in range(4) for alpha in (0.6, 1.0, 2.0)]
    stopping = {case: settings(*case) for case in cases}
    # the search's own no-bound path (that of alpha < 0): a sentence stays until its length limit
    bounded = search.length_penalty_factor
    monkeypatch.setattr(search, "length_penalty_factor",
                        lambda length, alpha: None if isinstance(length, torch.Tensor) else bounded(length, alpha))
    for case in cases:
        exhaustive = settings(*case)
        for got, want in zip(stopping[case], exhaustive, strict=True):
            assert [t for t, _ in got] == [t for t, _ in want], case
            assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-4), case


def test_max_length_is_respected() -> None:
    model = random_model(seed=10)  # an untrained model rarely says eos: it runs to the limit
    sources = random_sources(seed=11, n=6)
    for beam in (1, 3):
        results = generate(model, pad_batch(sources), beam_size=beam, max_len_a=0.5, max_len_b=2)
        lengths = [len(hyps[0].tokens) for hyps in results]
        limits = [int(0.5 * len(s) + 2) for s in sources]
        assert all(n <= limit for n, limit in zip(lengths, limits, strict=True))
        assert any(n == limit for n, limit in zip(lengths, limits, strict=True))
    # the positional table caps the length too
    capped = generate(random_model(seed=10, max_positions=6), pad_batch(sources[:1]),
                      max_len_a=0.0, max_len_b=100)
    assert len(capped[0][0].tokens) <= 5


def test_eos_and_special_tokens() -> None:
    model = random_model(seed=12)
    src = pad_batch(random_sources(seed=13))
    for beam in (1, 4):
        for hyps in generate(model, src, beam_size=beam, nbest=beam):
            for h in hyps:
                assert not {PAD_ID, BOS_ID, EOS_ID} & set(h.tokens)
    # no room for any token: eos at once, and its log-probability is the whole score
    results = generate(model, src, beam_size=2, max_len_a=0.0, max_len_b=0)
    for row, hyps in enumerate(results):
        assert hyps[0].tokens == []
        with torch.no_grad():
            lprobs = torch.log_softmax(model(src[row : row + 1], torch.tensor([[BOS_ID]])), -1)
        assert hyps[0].logprob == pytest.approx(lprobs[0, 0, EOS_ID].item(), abs=1e-5)


@pytest.mark.parametrize("beam", [1, 4])
def test_batched_results_equal_single_sentence_results(beam: int) -> None:
    model = random_model(seed=14)
    sources = random_sources(seed=15, n=5)
    batched = generate(model, pad_batch(sources), beam_size=beam, nbest=beam, length_penalty=1.0)
    for src_ids, hyps in zip(sources, batched, strict=True):
        alone = generate(model, pad_batch([src_ids]), beam_size=beam, nbest=beam,
                         length_penalty=1.0)[0]
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]
        for a, b in zip(hyps, alone, strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-4)


def test_attention_is_returned_on_request_only() -> None:
    model = random_model(seed=16)
    sources = random_sources(seed=17, n=3)
    plain = generate(model, pad_batch(sources), beam_size=2)
    assert all(h.attention is None for hyps in plain for h in hyps)
    results = generate(model, pad_batch(sources), beam_size=2, nbest=2, return_attention=True)
    assert tokens_of(results)[0][:1] == tokens_of(plain)[0]
    for src_ids, hyps in zip(sources, results, strict=True):
        for h in hyps:
            assert h.attention.shape == (2, len(h.tokens) + 1, len(src_ids) + 1)
            assert torch.allclose(h.attention.sum(-1), torch.ones(2, len(h.tokens) + 1), atol=1e-4)


def test_arguments_and_model_mode() -> None:
    model = random_model().train()
    src = pad_batch(random_sources(n=2))
    with pytest.raises(ConfigError, match="nbest"):
        generate(model, src, beam_size=2, nbest=3)
    with pytest.raises(ConfigError, match="beam_size"):
        generate(model, src, beam_size=0)
    first = generate(model, src, beam_size=2)
    assert model.training  # restored
    assert tokens_of(generate(model, src, beam_size=2)) == tokens_of(first)  # no dropout
    assert generate(model, src[:0]) == []
    # a row of pad alone (from Python; the tokenizer gives every line its eos) scored NaN greedily
    # and had no hypothesis in a beam
    src[1] = 0
    for beam in (1, 3):
        with pytest.raises(ValueError, match="a row of src holds only pad"):
            generate(model, src, beam_size=beam)


def test_length_helpers() -> None:
    assert length_penalty_factor(7, 0.0) == 1.0
    assert length_penalty_factor(7, 1.0) == pytest.approx(2.0)
    src = pad_batch([[5, 6, 7, 8], [5]])
    assert max_output_lengths(src, 1.5, 2, 100).tolist() == [8, 3]
    assert max_output_lengths(src, 1.5, 2, 5).tolist() == [4, 3]


# ----------------------------------------------------------------------------------------------
# The step scoring: log-normaliser and the chunked top-k against plain PyTorch


def masked_log_softmax(logits: torch.Tensor, limit_rows: torch.Tensor) -> torch.Tensor:
    """What the search must rank by: the model's log-probabilities, pad/bos banned, eos forced."""
    lprobs = torch.log_softmax(logits.double(), dim=-1)
    lprobs[:, [PAD_ID, BOS_ID]] = float("-inf")
    eos = lprobs[:, EOS_ID].clone()
    lprobs[limit_rows] = float("-inf")
    lprobs[:, EOS_ID] = eos
    return lprobs


def test_chunk_width() -> None:
    assert chunk_width(8000) == 64
    assert chunk_width(24) == 24  # small vocabularies: one chunk
    assert chunk_width(7992, 64) == 72  # 7992 = 8 * 999: the multiple-of-8 divisor nearest 64
    assert chunk_width(8009, 64) == 64  # none: padded up to a multiple of 64
    assert chunk_width(27, 8) == 8


def test_log_normalizer_matches_logsumexp() -> None:
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 30.0, 300.0):
        logits = torch.randn(7, 1000, generator=g) * scale
        logits[0, :500] = float("-inf")
        expected = torch.logsumexp(logits.double(), dim=1)
        assert torch.allclose(log_normalizer(logits).double(), expected, rtol=1e-6, atol=1e-5)
        scratch = torch.empty_like(logits)
        assert torch.equal(log_normalizer(logits, scratch), log_normalizer(logits))


@pytest.mark.parametrize("vocab,width", [(64, 8), (61, 8), (200, 16), (30, 30)])
def test_chunked_top_extensions_equal_a_full_sort(vocab: int, width: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    m, b, n = 4, 3, 6
    logits = torch.randn(m * b, vocab, generator=g) * 4
    scores = -torch.rand(m, b, generator=g) * 5
    limit_rows = torch.zeros(m * b, dtype=torch.bool)
    limit_rows[b : 2 * b] = True  # sentence 1 is at its length limit
    lprobs = masked_log_softmax(logits, limit_rows)
    scored = step_scores(logits.clone(), limit_rows, width)
    assert torch.allclose(scored.lse.double(), torch.logsumexp(logits.double(), 1), atol=1e-5)
    top, beam, token = scored.top_extensions(scores, n)
    candidates = (scores.double()[:, :, None] + lprobs.view(m, b, vocab)).view(m, -1)
    expected, flat = candidates.topk(n, dim=1)
    finite = expected.isfinite()
    assert torch.equal(finite, top.isfinite())
    assert torch.allclose(top.double()[finite], expected[finite], atol=1e-5)
    assert torch.equal(beam[finite], (flat // vocab)[finite])
    assert torch.equal(token[finite], (flat % vocab)[finite])
    assert token.max() < vocab  # never a padding column
    # greedy pick: the arg max and its log-probability
    picked, best = step_scores(logits.clone(), limit_rows, width).greedy()
    assert torch.equal(picked, lprobs.argmax(1))
    assert torch.allclose(best.double(), lprobs.max(1).values, atol=1e-5)
    # a reused padded buffer (its old contents, and its padding, overwritten) changes nothing
    padded = torch.full(scored.logits.shape, 7.0)
    again = step_scores(logits.clone(), limit_rows, width, padded=padded)
    assert torch.equal(again.logits, scored.logits) and torch.equal(again.lse, scored.lse)


@pytest.mark.parametrize("kept,order", [([0, 2, 4, 5], [0, 4, 2, 5]), ([3, 4], [3, 4]),
                                         ([0, 1, 2], [0, 1, 2]), ([1], [1]), ([], [])])
def test_fill_from_the_end_keeps_what_it_can_in_place(kept: list[int], order: list[int]) -> None:
    assert fill_from_the_end(kept) == order


def test_keep_parent_rows_leaves_each_parents_first_child_in_its_row() -> None:
    parent = torch.tensor([[0, 0, 1, 3, 3], [4, 4, 4, 4, 4], [2, 0, 1, 4, 3]])
    order = keep_parent_rows(parent)
    assert order.tolist() == [[0, 2, 1, 3, 4], [1, 2, 3, 4, 0], [1, 2, 0, 4, 3]]
    placed = parent.gather(1, order)  # the parent of the hypothesis now in each row
    for row in placed.tolist():
        firsts = [r for r, p in enumerate(row) if r == p]
        assert len(firsts) == len(set(row))  # every parent keeps one child in its own row


@pytest.mark.parametrize("beam", [1, 3])
def test_chunked_search_equals_one_chunk_search(beam: int, monkeypatch) -> None:
    """Same outputs with several -inf-padded vocabulary chunks as with a single chunk."""
    torch.manual_seed(3)
    model = Transformer(ModelConfig(d_model=32, n_heads=4, encoder_layers=1, decoder_layers=2,
                                    d_ff=64, max_positions=64), 27).eval()
    src = pad_batch(random_sources(seed=21, n=5, vocab=27))
    kwargs = dict(beam_size=beam, nbest=beam, length_penalty=1.0)
    one_chunk = generate(model, src, **kwargs)
    monkeypatch.setattr(search, "CHUNK", 8)  # 27 -> 4 chunks of 8, 5 padding columns
    chunked = generate(model, src, **kwargs)
    assert tokens_of(chunked) == tokens_of(one_chunk)
    for a, b in zip(chunked, one_chunk, strict=True):
        for ha, hb in zip(a, b, strict=True):
            assert ha.score == pytest.approx(hb.score, abs=1e-5)


def test_workspace_is_reused_and_results_do_not_depend_on_it() -> None:
    model = random_model(seed=22)
    big = pad_batch(random_sources(seed=23, n=6))
    small = pad_batch(random_sources(seed=24, n=2))
    search.workspace().clear()
    first = generate(model, big, beam_size=3, nbest=3)
    held = search.workspace().nbytes()
    assert held > 0
    generate(model, small, beam_size=3)  # smaller batch: reuses the same buffers
    assert search.workspace().nbytes() == held
    assert tokens_of(generate(model, big, beam_size=3, nbest=3)) == tokens_of(first)
    search.workspace().clear()
    assert tokens_of(generate(model, big, beam_size=3, nbest=3)) == tokens_of(first)


# ----------------------------------------------------------------------------------------------
# Tiny models trained in the test to copy or reverse short integer sequences


def toy_batch(g: torch.Generator, n: int, task: str, max_len: int):
    """Random symbol sequences (empty ones too); the target is the sequence (copy) or its reverse."""
    lengths = torch.randint(0, max_len + 1, (n,), generator=g)
    seqs = [torch.randint(4, TOY_VOCAB, (k,), generator=g).tolist() for k in lengths.tolist()]
    targets = [s if task == "copy" else s[::-1] for s in seqs]
    src = pad_batch(seqs)
    tgt_out = pad_batch(targets)
    tgt_in = torch.cat([torch.full((n, 1), BOS_ID), tgt_out[:, :-1]], dim=1)
    tgt_in[tgt_in.eq(EOS_ID)] = PAD_ID
    return seqs, targets, src, tgt_in, tgt_out


@functools.cache
def train_toy(task: str, d_model: int, layers: int, steps: int, max_len: int) -> Transformer:
    """Adam with warm-up and linear decay on fresh random batches; fixed seeds. Cached: the same
    arguments give the same (shared, not to be modified) model, trained once per session."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    cfg = ModelConfig(d_model=d_model, n_heads=4, encoder_layers=layers, decoder_layers=layers,
                      d_ff=2 * d_model, dropout=0.0, attention_dropout=0.0, max_positions=32)
    model = Transformer(cfg, TOY_VOCAB)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 30) * (1 - s / steps)
    )
    for _ in range(steps):
        _, _, src, tgt_in, tgt_out = toy_batch(g, 64, task, max_len)
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.view(-1, TOY_VOCAB), tgt_out.view(-1), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return model.eval()


def check_toy(model: Transformer, task: str, max_len: int) -> None:
    seqs, targets, src, _, _ = toy_batch(torch.Generator().manual_seed(123), 40, task, max_len)
    for beam in (1, 4):
        for use_cache in (True, False):
            results = generate(model, src, beam_size=beam, use_cache=use_cache)
            assert [hyps[0].tokens for hyps in results] == targets, (task, beam, use_cache)
    # an empty source (eos only) gives an empty output
    assert generate(model, pad_batch([[]]), beam_size=4)[0][0].tokens == []


def test_tiny_model_learns_to_copy() -> None:
    check_toy(train_toy("copy", d_model=32, layers=1, steps=300, max_len=6), "copy", 6)


def test_tiny_model_learns_to_reverse() -> None:
    check_toy(train_toy("reverse", d_model=48, layers=1, steps=300, max_len=5), "reverse", 5)


@pytest.mark.slow
def test_small_model_learns_to_reverse_longer_sequences() -> None:
    check_toy(train_toy("reverse", d_model=48, layers=2, steps=400, max_len=6), "reverse", 6)


@pytest.mark.parametrize("beam", [1, 4])
def test_search_with_an_output_vocabulary_emits_listed_pieces_only(beam: int) -> None:
    """The same random weights with and without an output vocabulary: without it the search
    produces unlisted pieces; with it only listed ones, cached and uncached alike, scored with
    the list-normalised log-probabilities of teacher forcing."""
    listed = [PAD_ID, 1, BOS_ID, EOS_ID, 6, 11, 14, 17, 20, 22]
    base = random_model()
    model = Transformer(base.cfg, VOCAB, output_ids=listed).eval()
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert missing == ["output_ids"] and not unexpected
    sources = random_sources()
    src = pad_batch(sources)
    kwargs = dict(beam_size=beam, nbest=beam, length_penalty=1.0)
    free = {t for hyps in tokens_of(generate(base, src, **kwargs)) for h in hyps for t in h}
    assert free - set(listed), "degenerate test: the free model already stays on the list"
    cached = generate(model, src, **kwargs)
    uncached = generate(model, src, use_cache=False, **kwargs)
    assert tokens_of(cached) == tokens_of(uncached)
    produced = {t for hyps in tokens_of(cached) for h in hyps for t in h}
    assert produced and produced <= set(listed) - {PAD_ID, BOS_ID, EOS_ID}
    for src_ids, hyps in zip(sources, cached, strict=True):
        best = hyps[0]
        assert best.logprob == pytest.approx(teacher_forced_logprob(model, src_ids, best.tokens), abs=1e-4)

