"""int8 decoding (mtcli.infer.quantize): accuracy of the layers, an untouched original, a consistent
search, the copy task still solved, and clear errors."""

from __future__ import annotations

import pytest
import torch
from test_search import (
    pad_batch,
    random_model,
    random_sources,
    teacher_forced_logprob,
    toy_batch,
    train_toy,
)

from mtcli.config import ConfigError, load_config
from mtcli.infer.quantize import Int8Linear, int8_supported, quantize_for_decoding
from mtcli.infer.search import generate

pytestmark = pytest.mark.skipif(int8_supported() is not None, reason=f"no int8 kernels: {int8_supported()}")


def test_int8_linear_is_close_to_fp32() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96)
    x = torch.randn(3, 7, 64)
    exact = layer(x).detach()
    approx = Int8Linear(layer.weight, layer.bias)(x)
    assert approx.shape == exact.shape and approx.dtype == torch.float32
    # 8-bit weights and activations: errors of a few percent of the output scale
    error = (approx - exact).abs().max() / exact.abs().max()
    assert 0 < error < 0.05
    fused = Int8Linear(layer.weight, layer.bias, relu=True)(x)
    torch.testing.assert_close(fused, approx.relu(), rtol=1e-5, atol=1e-5)


def test_int8_linear_gives_a_row_the_same_output_beside_any_rows() -> None:
    """Activations quantised per row: a row's output does not change when a row of far larger
    values (or of one sign) is multiplied with it, so a translation does not depend on its batch."""
    torch.manual_seed(1)
    layer = torch.nn.Linear(32, 16)
    int8 = Int8Linear(layer.weight, layer.bias)
    row = torch.randn(1, 32)
    alone = int8(row)
    for other in (100 * torch.randn(1, 32), torch.rand(1, 32), -torch.rand(3, 32)):
        assert torch.equal(int8(torch.cat([row, other]))[:1], alone)


@pytest.mark.parametrize("tied", [True, False])
def test_quantized_copy_replaces_every_linear_and_leaves_the_original(tied: bool) -> None:
    model = random_model(seed=2, tie_embeddings=tied)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantized = quantize_for_decoding(model)
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.modules())
    assert quantized.output_product is not None and model.output_product is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    src = pad_batch(random_sources(seed=3, n=4))
    with torch.inference_mode():
        exact, approx = model(src, src), quantized(src, src)
    assert (approx - exact).abs().max() / exact.abs().max() < 0.1


@pytest.mark.parametrize("beam", [1, 3])
def test_int8_search_scores_are_the_int8_models_logprobs(beam: int) -> None:
    # the cached search and a teacher-forced pass of the same int8 model agree (rows are
    # quantised per call, so allow for the per-call activation scales)
    quantized = quantize_for_decoding(random_model(seed=4))
    sources = random_sources(seed=5, n=4)
    results = generate(quantized, pad_batch(sources), beam_size=beam, nbest=beam, length_penalty=1.0)
    for src_ids, hyps in zip(sources, results, strict=True):
        for h in hyps:
            assert h.logprob == pytest.approx(teacher_forced_logprob(quantized, src_ids, h.tokens), abs=0.05)


def test_int8_model_still_copies() -> None:
    model = train_toy("copy", d_model=32, layers=1, steps=300, max_len=6)
    quantized = quantize_for_decoding(model)
    _, targets, src, _, _ = toy_batch(torch.Generator().manual_seed(123), 40, "copy", 6)
    for beam in (1, 4):
        assert [h[0].tokens for h in generate(quantized, src, beam_size=beam)] == targets


def test_int8_with_bf16_is_a_config_error() -> None:
    from conftest import TOY_CONFIG

    with pytest.raises(ConfigError, match="decode.int8 and decode.bf16"):
        load_config(TOY_CONFIG, ["decode.int8=true", "decode.bf16=true"])


def test_evaluate_with_int8(tiny_run_dir, tmp_path) -> None:
    from mtcli.evaluate import evaluate

    report = evaluate(tiny_run_dir, split="val", overrides=["decode.int8=true", "decode.beam_size=2"],
                      output_dir=tmp_path / "eval")
    assert report["decode"]["int8"] is True
    lines = (tmp_path / "eval").glob("*.hyp")
    assert sum(len(p.read_text(encoding="utf-8").splitlines()) for p in lines) == report["sentences"]


def test_int8_copy_keeps_the_output_vocabulary() -> None:
    """A model with an output vocabulary keeps -inf off the list after quantisation."""
    from mtcli.model import Transformer

    listed = [0, 1, 2, 3, 5, 9, 14]
    base = random_model(seed=6)
    model = Transformer(base.cfg, base.vocab_size, output_ids=listed).eval()
    model.load_state_dict(base.state_dict(), strict=False)
    quantized = quantize_for_decoding(model)
    src = pad_batch(random_sources(seed=7, n=3))
    with torch.inference_mode():
        exact, approx = model.widen(model(src, src)), quantized.widen(quantized(src, src))
    off = torch.ones(base.vocab_size, dtype=torch.bool)
    off[listed] = False
    assert torch.isneginf(approx[..., off]).all() and torch.isfinite(approx[..., ~off]).all()
    assert (approx[..., ~off] - exact[..., ~off]).abs().max() / exact[..., ~off].abs().max() < 0.1
    hyps = generate(quantized, src, beam_size=2)
    assert {t for row in hyps for h in row for t in h.tokens} <= set(listed)


def test_a_product_of_a_relus_output_spends_no_levels_on_negative_values() -> None:
    """The feed-forward network's second product reads a ReLU's output: its 256 levels span
    [0, max], half the step of [-max, max], and a row's output is the same in any batch."""
    torch.manual_seed(3)
    weight, bias = 0.05 * torch.randn(32, 128), 0.1 * torch.randn(32)
    x = torch.relu(torch.randn(10, 128))
    exact = x @ weight.T + bias
    signed, nonnegative = Int8Linear(weight, bias), Int8Linear(weight, bias, nonnegative=True)
    assert (nonnegative(x) - exact).abs().max() < (signed(x) - exact).abs().max()
    assert torch.equal(nonnegative(x[:1]), nonnegative(torch.cat([x[:1], 50 * x[1:]]))[:1])
    model = quantize_for_decoding(random_model(seed=2))
    ffn = model.encoder.layers[0].feed_forward
    assert ffn.w_2.nonnegative and not ffn.w_1.nonnegative
