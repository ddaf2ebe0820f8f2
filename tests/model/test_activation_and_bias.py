"""The swish feed-forward (``model.activation: swish``) and the output bias
(``model.output_bias``) that models imported from Marian use: every decoding path computes them,
and the defaults leave a model (and its state dict) as before."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtcli.config import ModelConfig
from mtcli.infer.search import generate
from mtcli.model import Transformer
from mtcli.model.layers import PositionwiseFeedForward

VOCAB = 40


def make_model(seed: int = 0, **overrides) -> Transformer:
    values = dict(d_model=16, n_heads=2, encoder_layers=2, decoder_layers=2, d_ff=32, dropout=0.0,
                  attention_dropout=0.0, max_positions=64, activation="swish", output_bias=True)
    values.update(overrides)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**values), VOCAB).eval()
    if model.output_bias is not None:
        model.output_bias.copy_(torch.randn(VOCAB) * 3)
    return model


def sources() -> torch.Tensor:
    src = torch.randint(4, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    src[:, -1] = 3
    src[1, 3:] = 0
    src[1, 2] = 3
    return src


def test_swish_feed_forward_is_silu_and_its_step_agrees() -> None:
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(8, 16, 0.0, "swish").eval()
    x = torch.randn(3, 1, 8)
    expected = ffn.w_2(F.silu(ffn.w_1(x)))
    torch.testing.assert_close(ffn(x), expected)
    with torch.inference_mode():
        torch.testing.assert_close(ffn.step(x), expected)


def test_output_bias_is_added_to_the_logits_on_every_path() -> None:
    model = make_model()
    hidden = torch.randn(2, 3, 16)
    expected = hidden @ model.decoder.embed.weight.T + model.output_bias
    torch.testing.assert_close(model.project(hidden), expected)
    src = sources()
    with torch.inference_mode():
        cached = generate(model, src, beam_size=1, max_len_a=0.0, max_len_b=8)
        uncached = generate(model, src, beam_size=1, max_len_a=0.0, max_len_b=8, use_cache=False)
    assert [h[0].tokens for h in cached] == [h[0].tokens for h in uncached]
    for a, b in zip(cached, uncached, strict=True):
        assert abs(a[0].score - b[0].score) < 1e-4
    rows = model.output_rows(torch.tensor([5, 7, 9]))
    torch.testing.assert_close(rows(hidden), expected[..., [5, 7, 9]])


def test_a_decoding_copy_keeps_swish_unfused_and_the_bias() -> None:
    model = make_model()
    calls: list[bool] = []
    nonnegatives: list[bool] = []

    def make(weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False, nonnegative: bool = False) -> nn.Module:
        calls.append(relu)
        nonnegatives.append(nonnegative)
        linear = nn.Linear(weight.size(1), weight.size(0), bias=bias is not None)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(bias)
        return nn.Sequential(linear, nn.ReLU()) if relu else linear

    copy = model.for_decoding(make)
    assert not any(calls) and not any(nonnegatives)  # nothing fused: a swish network's first product is plain
    src, tgt = sources(), torch.tensor([[2, 5, 6], [2, 7, 8], [2, 9, 10]])
    with torch.inference_mode():
        torch.testing.assert_close(copy(src, tgt), model(src, tgt), rtol=1e-5, atol=1e-5)
        assert [h[0].tokens for h in generate(copy, src, beam_size=2, max_len_a=0.0, max_len_b=6)] == \
            [h[0].tokens for h in generate(model, src, beam_size=2, max_len_a=0.0, max_len_b=6)]
    relu_copy = make_model(activation="relu").for_decoding(make)
    assert relu_copy is not None and calls.count(True) == 4  # ReLU networks fuse as before
    assert nonnegatives.count(True) == 4  # and their second product is told it reads the ReLU's output


def test_the_defaults_add_no_buffer_and_keep_relu() -> None:
    model = make_model(activation="relu", output_bias=False)
    assert model.output_bias is None and "output_bias" not in model.state_dict()
    assert all(layer.feed_forward.activation == "relu" for layer in model.encoder.layers)
    assert "output_bias" in make_model().state_dict()


def test_packed_and_int8_copies_carry_swish_and_the_bias() -> None:
    from mtcli.infer.packed import pack_for_decoding, packing_supported
    from mtcli.infer.quantize import int8_supported, quantize_for_decoding

    model = make_model()
    src, tgt = sources(), torch.tensor([[2, 5, 6], [2, 7, 8], [2, 9, 10]])
    with torch.inference_mode():
        expected = model(src, tgt)
        if packing_supported():
            torch.testing.assert_close(pack_for_decoding(model)(src, tgt), expected, rtol=1e-4, atol=1e-4)
        if int8_supported() is None:
            assert (quantize_for_decoding(model)(src, tgt) - expected).abs().max() < 0.5
