"""Tests for mtcli.model.kernels: the fused decoding kernels against the torch operations they
replace, and decoding with and without them."""

from __future__ import annotations

import logging
import math
import shutil

import pytest
import torch

from mtcli import native
from mtcli.model import Transformer, kernels
from mtcli.model.attention import padding_attn_mask
from tests.model.test_transformer import OUTPUT_IDS, VOCAB, make_batch, make_model, small_config
from tests.native_cases import the_one_warning, without_compiler

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C compiler: the kernels are not built")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d_k) + mask) v in float64: q [.., g, d_k], k/v [.., S, d_k]."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores + mask.double()
    return torch.softmax(scores, -1) @ v


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [0, 1, 6])
def test_self_attention_step_writes_the_cache_and_attends_to_the_past(dtype: torch.dtype, length: int) -> None:
    g = torch.Generator().manual_seed(length)
    n, h, d_k, max_len, capacity = 5, 4, 8, 9, 7
    buffers = [torch.randn(max_len, capacity, h, d_k, generator=g).to(dtype) for _ in range(2)]
    cache_k, cache_v = (b[:, :n] for b in buffers)  # rows of a wider buffer, as after a reorder
    qkv = torch.randn(n, 3 * h * d_k, generator=g).to(dtype)
    untouched = [b.clone() for b in buffers]
    with torch.inference_mode():
        out = kernels.self_attention_step(qkv, cache_k, cache_v, length)
    parts = qkv.view(n, 3, h, d_k)
    assert torch.equal(cache_k[length], parts[:, 1]) and torch.equal(cache_v[length], parts[:, 2])
    for before, after in zip(untouched, buffers, strict=True):  # nothing else written
        after = after.clone()
        after[length, :n] = before[length, :n]
        assert torch.equal(before, after)
    q = parts[:, 0].unsqueeze(2)  # [n, h, 1, d_k]
    k, v = (c[: length + 1].permute(1, 2, 0, 3) for c in (cache_k, cache_v))
    expected = reference_attention(q, k, v, None).reshape(n, h * d_k)
    assert out.dtype == dtype and out.shape == (n, h * d_k)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_cross_attention_step_groups_queries_per_sentence(dtype: torch.dtype, masked: bool) -> None:
    g = torch.Generator().manual_seed(3)
    sentences, group, h, s, d_k = 3, 2, 4, 6, 8
    k_all, v_all = (torch.randn(sentences + 2, h, s, d_k, generator=g).to(dtype) for _ in range(2))
    k, v = k_all[:sentences], v_all[:sentences]
    q = torch.randn(sentences, group, h * d_k, generator=g).to(dtype)
    mask = padding_attn_mask(torch.arange(s)[None, :] >= torch.tensor([[6], [2], [4]])) if masked else None
    with torch.inference_mode():
        out = kernels.cross_attention_step(q, k, v, mask)
    heads = q.view(sentences, group, h, d_k).transpose(1, 2)  # [sentences, h, group, d_k]
    expected = reference_attention(heads, k, v, mask).transpose(1, 2).reshape(sentences * group, h * d_k)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_kernels
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_score_statistics_are_chunk_maxima_and_log_normalizer(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 96, generator=g) * 8
    logits[:, 90:] = float("-inf")  # padding columns past the vocabulary
    logits[0, :5] = torch.tensor([80.0, -80.0, -100.0, 0.0, 1e-3])  # far below the maximum: e^x ~ 0
    chunk_max, lse = kernels.score_statistics(logits, 16)
    assert torch.equal(chunk_max, logits.view(rows, 6, 16).amax(2))
    torch.testing.assert_close(lse, torch.logsumexp(logits.double(), 1).float(), atol=2e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="whole number of chunks"):
        kernels.score_statistics(logits, 17)


@needs_kernels
def test_kernels_refuse_a_layout_they_cannot_read() -> None:
    cache = torch.zeros(4, 3, 2, 8)
    with torch.inference_mode(), pytest.raises(ValueError, match="contiguous"):
        kernels.self_attention_step(torch.zeros(3, 48), cache.transpose(2, 3), cache.transpose(2, 3), 0)


def decode_steps(model: Transformer, src: torch.Tensor, tgt: torch.Tensor, group: int = 2) -> torch.Tensor:
    """Cached logits of every position of ``tgt`` (``group`` rows per sentence), one step at a time."""
    enc = model.encode(src)
    cache = model.init_cache(enc, beam_size=group, max_len=tgt.size(1))
    rows = tgt.repeat_interleave(group, 0)
    return torch.cat([model.decode(rows[:, t : t + 1], enc, cache) for t in range(tgt.size(1))], 1)


@needs_kernels
@pytest.mark.parametrize("bf16", [False, True])
def test_decoding_with_the_kernels_matches_torch_operations(monkeypatch: pytest.MonkeyPatch, bf16: bool) -> None:
    model = make_model()
    src, tgt = make_batch()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with torch.inference_mode(), autocast:
        fused = decode_steps(model, src, tgt)
        monkeypatch.setattr(kernels, "_library", lambda: None)
        assert not kernels.available()
        plain = decode_steps(model, src, tgt)
    tolerance = 5e-2 if bf16 else 1e-5
    torch.testing.assert_close(fused.float(), plain.float(), atol=tolerance, rtol=tolerance)


def test_without_a_compiler_decoding_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    with without_compiler(monkeypatch, tmp_path, kernels._library):
        with caplog.at_level(logging.WARNING, logger="mtcli"):
            assert not kernels.available() and not kernels.available()
        warning = the_one_warning(caplog)
        assert "kernels unavailable" in warning and "no-such-compiler" in warning
        model = make_model()
        src, tgt = make_batch()
        with torch.inference_mode():
            torch.testing.assert_close(decode_steps(model, src, tgt)[::2], model(src, tgt), atol=1e-5, rtol=1e-5)


def test_the_library_is_named_by_the_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "cpu_flags", lambda: "fpu sse2")
    kernels._build()
    monkeypatch.setattr(native, "cpu_flags", lambda: "fpu sse2 avx2")
    kernels._build()
    built = sorted(p.name for p in (tmp_path / "mtcli" / "kernels").iterdir())
    assert len(built) == 2 and all(name.startswith("kernels-") and name.endswith(".so") for name in built)


def test_a_compiler_without_openmp_gives_one_thread_kernels(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    fake = tmp_path / "cc-without-openmp"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {cc} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lib, parallel = kernels._build()
    assert not parallel and lib.self_attention_step is not None
    built = [p.name for p in (tmp_path / "cache" / "mtcli" / "kernels").iterdir()]
    assert len(built) == 1 and built[0].endswith(".so")  # the failed build left no temporary file


@needs_kernels
@pytest.mark.parametrize("pre_norm", [False, True])
@pytest.mark.parametrize("beam", [1, 2, 4])  # 3, 6 and 12 rows: one and two groups of 8
def test_the_fused_decoder_step_matches_the_model(pre_norm: bool, beam: int) -> None:
    from mtcli.infer.packed import pack_for_decoding

    model = make_model(pre_norm=pre_norm, tie_embeddings=False)
    decoding = pack_for_decoding(model)
    src, tgt = make_batch()  # 3 sentences of different lengths: a padding mask
    with torch.inference_mode():
        enc = decoding.encode(src)
        assert kernels.decoder_step_takes(decoding.init_cache(enc, beam_size=beam))
        fused = decode_steps(decoding, src, tgt, beam)
        assert decoding._plans["decoder"] is not None  # the step ran fused
        expected = model(src, tgt).repeat_interleave(beam, 0)
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_the_fused_step_of_a_model_with_an_output_vocabulary_gives_its_logits() -> None:
    from mtcli.infer.packed import pack_for_decoding

    torch.manual_seed(0)
    model = Transformer(small_config(), VOCAB, output_ids=OUTPUT_IDS).eval()
    decoding = pack_for_decoding(model)
    src, tgt = make_batch()
    with torch.inference_mode():
        fused = decode_steps(decoding, src, tgt, 1)
        assert decoding._plans["decoder"] is not None
        expected = model(src, tgt)
    assert fused.shape[-1] == len(OUTPUT_IDS)
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("pre_norm", [False, True])
def test_the_fused_encoder_matches_the_model(pre_norm: bool) -> None:
    from mtcli.infer.packed import pack_for_decoding

    model = make_model(pre_norm=pre_norm)
    decoding = pack_for_decoding(model)
    src, _ = make_batch()  # 3 sentences of different lengths: a padding mask
    with torch.inference_mode():
        fused = decoding.encode(src)
        assert decoding._plans["encoder"] is not None  # it ran fused
        expected = model.encode(src)
    assert expected.attn_mask is not None
    torch.testing.assert_close(fused.memory, expected.memory, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.attn_mask, expected.attn_mask)


@needs_kernels
def test_the_fused_step_is_only_for_fp32_steps_of_a_decoding_copy() -> None:
    from mtcli.infer.packed import pack_for_decoding

    model = make_model()
    src, tgt = make_batch()
    with torch.inference_mode():
        enc = model.encode(src)
        decode_steps(model, src, tgt, 1)
        assert not hasattr(model, "_plans")  # a model being trained: its weights change
        decoding = pack_for_decoding(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not kernels.decoder_step_takes(decoding.init_cache(decoding.encode(src)))
        assert kernels.decoder_step_takes(model.init_cache(enc))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("times", [None, 3])
def test_moving_cache_rows_in_c_matches_torch(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                              times: int | None) -> None:
    from mtcli.model.incremental import _move_rows

    generator = torch.Generator().manual_seed(0)
    shape = (5, 6, 2, 4) if times is not None else (6, 2, 3, 4)
    buffers = [torch.randn(shape, generator=generator).to(dtype) for _ in range(4)]
    index = torch.tensor([0, 4, 4, 1, 2, 5])  # rows 1-4 change, one source twice
    expected = [b.clone() for b in buffers]
    original = [b.clone() for b in buffers]
    with torch.inference_mode():
        assert _move_rows(buffers, index, times)
        monkeypatch.setattr(kernels, "_library", lambda: None)
        assert _move_rows(expected, index, times)
    for got, want, before in zip(buffers, expected, original, strict=True):
        assert torch.equal(got, want)
        assert not torch.equal(got, before)
        if times is not None:
            assert torch.equal(got[times:], before[times:])  # later times untouched


@needs_kernels
def test_the_fused_step_hands_its_hidden_states_to_a_shortlist_product(monkeypatch: pytest.MonkeyPatch) -> None:
    from mtcli.infer.packed import pack_for_decoding

    decoding = pack_for_decoding(make_model())
    src, tgt = make_batch()
    columns = torch.tensor([0, 1, 2, 3, 5, 8])

    def steps() -> torch.Tensor:
        enc = decoding.encode(src)
        cache = decoding.init_cache(enc, max_len=tgt.size(1))
        cache.output_product = decoding.output_rows(columns)
        return torch.cat([decoding.decode(tgt[:, t : t + 1], enc, cache) for t in range(tgt.size(1))], 1)

    with torch.inference_mode():
        fused = steps()
        assert decoding._plans["decoder"] is not None
        monkeypatch.setattr(kernels, "_library", lambda: None)
        plain = steps()
    assert fused.shape == (3, tgt.size(1), len(columns))
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
