"""fp32 decoding with oneDNN-packed weights (mtcli.infer.packed): the same products, an untouched
original, the same search results, and the copy made only where it applies."""

from __future__ import annotations

import pytest
import torch
from test_search import pad_batch, random_model, random_sources, teacher_forced_logprob

from mtcli.config import DecodeConfig
from mtcli.infer.packed import PackedLinear, pack_for_decoding, packing_supported, padded_rows
from mtcli.infer.search import generate
from mtcli.infer.translate import model_for_decoding

pytestmark = pytest.mark.skipif(not packing_supported(), reason="this PyTorch build has no oneDNN linear")


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_linear(bias: bool, relu: bool) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=bias)
    x = torch.randn(3, 7, 64)
    packed = PackedLinear(layer.weight, layer.bias, relu=relu)(x)
    expected = layer(x).detach()
    assert packed.shape == (3, 7, 96) and packed.dtype == torch.float32
    torch.testing.assert_close(packed, expected.relu() if relu else expected, rtol=1e-5, atol=1e-5)
    if relu:
        assert bool((packed == 0).any()) and bool((expected < 0).any())


def test_rows_are_padded_to_few_sizes_and_the_padding_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row count made oneDNN build and keep kernels of its own: a server grew by hundreds
    of MB over batches of varied size. Products now run at a few row counts."""
    assert [padded_rows(n) for n in (1, 8, 9, 64, 65, 128, 129, 1000)] == [1, 8, 16, 64, 72, 128, 144, 1024]
    sizes = {padded_rows(n) for n in range(1, 16385)}
    assert len(sizes) <= 80 and all(n <= padded_rows(n) <= max(n + 7, n * 9 // 8) for n in range(1, 16385))
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 48)
    seen: list[int] = []
    kernel = torch.ops.mkldnn._linear_pointwise

    def counting(x: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(x.size(0))
        return kernel(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counting)
    for rows in range(1, 200):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(PackedLinear(layer.weight, layer.bias)(x), layer(x).detach(), rtol=1e-5, atol=1e-5)
    assert len(set(seen)) == len({padded_rows(n) for n in range(1, 200)}) < 40


def test_packed_copy_fuses_each_feed_forward_relu() -> None:
    packed = pack_for_decoding(random_model(seed=1))
    ffns = [layer.feed_forward for layer in (*packed.encoder.layers, *packed.decoder.layers)]
    assert ffns and all(f.relu_in_w_1 and "relu" in repr(f.w_1) for f in ffns)
    assert all("relu" not in repr(f.w_2) for f in ffns)


@pytest.mark.parametrize("tied", [True, False])
def test_packed_copy_replaces_every_linear_and_leaves_the_original(tied: bool) -> None:
    model = random_model(seed=2, tie_embeddings=tied)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    packed = pack_for_decoding(model)
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    assert isinstance(packed.output_product, PackedLinear) and model.output_product is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    src = pad_batch(random_sources(seed=3, n=4))
    with torch.inference_mode():
        torch.testing.assert_close(packed(src, src), model(src, src), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("beam", [1, 4])
def test_packed_search_equals_the_original_search(beam: int) -> None:
    model = random_model(seed=4)
    packed = pack_for_decoding(model)
    sources = random_sources(seed=5, n=6)
    exact = generate(model, pad_batch(sources), beam_size=beam, nbest=beam, length_penalty=1.0)
    fast = generate(packed, pad_batch(sources), beam_size=beam, nbest=beam, length_penalty=1.0)
    assert [[h.tokens for h in n] for n in fast] == [[h.tokens for h in n] for n in exact]
    for src_ids, hyps in zip(sources, fast, strict=True):
        for h in hyps:  # the cached, packed search scores what the plain model scores
            assert h.logprob == pytest.approx(teacher_forced_logprob(model, src_ids, h.tokens), abs=1e-3)


def test_model_for_decoding_packs_only_fp32_on_a_cpu() -> None:
    model = random_model(seed=6)
    packed = model_for_decoding(model, DecodeConfig(), "cpu")
    assert isinstance(packed.output_product, PackedLinear)
    assert model_for_decoding(packed, DecodeConfig(), "cpu") is packed  # made once, kept
    bf16 = model_for_decoding(model, DecodeConfig(bf16=True), "cpu")
    if packing_supported(torch.bfloat16):
        assert bf16.output_product.dtype == torch.bfloat16
    else:
        assert bf16 is model
    assert model_for_decoding(model, DecodeConfig(), "meta") is model


@pytest.mark.skipif(not packing_supported(torch.bfloat16), reason="oneDNN has no bf16 kernels on this CPU")
def test_bf16_packed_copy_computes_what_bf16_autocast_computes() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96)
    x = torch.randn(5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(x).detach()
    out = PackedLinear(layer.weight, layer.bias, torch.bfloat16)(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    model = random_model(seed=7)
    packed = pack_for_decoding(model, torch.bfloat16)
    src = pad_batch(random_sources(seed=8, n=4))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(packed(src, src).float(), model(src, src).float(), rtol=5e-2, atol=5e-2)
        hyps = generate(packed, pad_batch(random_sources(seed=9, n=4)), beam_size=3, length_penalty=1.0)
    assert all(len(h) == 1 for h in hyps)
