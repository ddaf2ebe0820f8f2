"""Tests for mtcli.model: the Transformer and its parts checked against the paper's equations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mtcli.config import ModelConfig
from mtcli.model import Transformer, Workspace, count_parameters
from mtcli.model.attention import dropout, padding_attn_mask, reference_attention, sdpa_backends
from mtcli.model.layers import EncoderLayer, LayerNorm, SublayerConnection

VOCAB = 40


def small_config(**overrides) -> ModelConfig:
    values = dict(
        d_model=32, n_heads=4, encoder_layers=2, decoder_layers=2, d_ff=64,
        dropout=0.0, attention_dropout=0.0, max_positions=64,
    )
    values.update(overrides)
    return ModelConfig(**values)


def make_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(small_config(**overrides), VOCAB).eval()


def make_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded source (ids + eos) and decoder input (bos + ids) of different lengths."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, VOCAB, (3, 7), generator=g)
    tgt = torch.randint(4, VOCAB, (3, 6), generator=g)
    for row, (s_len, t_len) in enumerate([(7, 6), (4, 3), (2, 5)]):
        src[row, s_len - 1] = 3
        src[row, s_len:] = 0
        tgt[row, t_len:] = 0
    tgt[:, 0] = 2
    return src, tgt


def test_output_shapes() -> None:
    model = make_model()
    src, tgt = make_batch()
    logits = model(src, tgt)
    assert logits.shape == (3, 6, VOCAB)
    enc = model.encode(src)
    assert enc.memory.shape == (3, 7, 32)
    assert enc.src_pad_mask.dtype == torch.bool
    assert enc.src_pad_mask.tolist() == src.eq(0).tolist()
    assert model.decode(tgt, enc).shape == (3, 6, VOCAB)
    cache = model.init_cache(enc, max_len=6)
    assert model.decode(tgt[:, :1], enc, cache).shape == (3, 1, VOCAB)


def test_positional_encoding_matches_formula() -> None:
    model = make_model()
    pe = model.positions.pe
    d = model.cfg.d_model
    assert pe.shape == (model.cfg.max_positions, d)
    for pos in (0, 1, 7, 63):
        for i in (0, 3, d // 2 - 1):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    with pytest.raises(ValueError, match="max_positions"):
        model.positions(torch.zeros(1, 65, d))


def test_embeddings_scaled_by_sqrt_d_model_and_positions_added() -> None:
    model = make_model()
    tokens = torch.tensor([[5, 6, 0]])
    embed = model.encoder.embed
    expected = embed.lut.weight[tokens] * math.sqrt(32)
    assert torch.allclose(embed(tokens), expected)
    assert torch.all(embed.weight[0] == 0)  # pad row
    with_pos = model.positions(embed(tokens), offset=2)
    assert torch.allclose(with_pos, expected + model.positions.pe[2:5])


def test_sdpa_path_matches_reference_attention() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    float_mask = padding_attn_mask(pad)
    bool_mask = ~pad[:, None, None, :]
    for mask in (float_mask, bool_mask):
        ref, weights = reference_attention(q, k, v, mask)
        fast = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert torch.allclose(ref, fast, atol=1e-5)
        assert torch.all(weights[1, :, :, 3:] == 0)  # masked keys get exactly zero weight
        assert torch.allclose(weights.sum(-1), torch.ones(2, 4, 5))
    ref, weights = reference_attention(q, k, v, is_causal=True)
    assert torch.allclose(ref, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
    assert torch.all(weights.triu(1) == 0)


def test_multi_head_attention_module_sdpa_vs_explicit_weights() -> None:
    model = make_model()
    src, tgt = make_batch()
    enc = model.encode(src)
    layer = model.decoder.layers[0].cross_attn
    x = torch.randn(3, 6, 32)
    kv = layer.project_kv(enc.memory)
    fast, none = layer.forward_cross(x, kv, enc.attn_mask)
    slow, weights = layer.forward_cross(x, kv, enc.attn_mask, need_weights=True)
    assert none is None
    assert torch.allclose(fast, slow, atol=1e-5)
    assert weights.shape == (3, 6, 7)
    assert torch.all(weights[1, :, 4:] == 0) and torch.all(weights[2, :, 2:] == 0)


def test_padding_never_changes_real_outputs() -> None:
    model = make_model(pre_norm=True)
    src, tgt = make_batch()
    logits = model(src, tgt)
    more_src = torch.cat([src, torch.zeros(3, 4, dtype=torch.long)], dim=1)
    more_tgt = torch.cat([tgt, torch.zeros(3, 2, dtype=torch.long)], dim=1)
    padded = model(more_src, more_tgt)
    real = tgt.ne(0)
    assert torch.allclose(logits[real], padded[:, :6][real], atol=1e-5)
    # a row alone (no padding anywhere) gives the same outputs as inside the padded batch
    alone = model(src[1:2, :4], tgt[1:2, :3])
    assert torch.allclose(alone[0], logits[1, :3], atol=1e-5)


def test_decoder_is_causal() -> None:
    model = make_model()
    src, tgt = make_batch()
    logits = model(src, tgt)
    changed = tgt.clone()
    changed[:, 3] = (changed[:, 3] + 1) % VOCAB + 4
    other = model(src, changed)
    assert torch.allclose(logits[:, :3], other[:, :3], atol=1e-6)
    assert not torch.allclose(logits[:, 3:], other[:, 3:], atol=1e-3)


def test_post_norm_and_pre_norm() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32) * 3 + 1
    post = EncoderLayer(small_config()).eval()
    pre = EncoderLayer(small_config(pre_norm=True)).eval()
    pre.load_state_dict(post.state_dict())
    out_post, out_pre = post(x, None), pre(x, None)
    # post-norm: LayerNorm(x + Sublayer(x)) is last, so every position is normalised
    assert torch.allclose(out_post.mean(-1), torch.zeros(2, 5), atol=1e-5)
    assert torch.allclose(out_post.std(-1, unbiased=False), torch.ones(2, 5), atol=1e-3)
    # pre-norm: x + Sublayer(LayerNorm(x)) keeps the residual stream un-normalised
    assert out_pre.mean(-1).abs().max() > 0.1
    assert post.sublayer[0].pre_norm is False and pre.sublayer[0].pre_norm is True
    m_post, m_pre = make_model(), make_model(pre_norm=True)
    assert m_post.encoder.norm is None and m_post.decoder.norm is None
    assert m_pre.encoder.norm is not None and m_pre.decoder.norm is not None
    src, tgt = make_batch()
    assert torch.isfinite(m_pre(src, tgt)).all()


def test_tied_and_untied_embeddings() -> None:
    tied, untied = make_model(), make_model(tie_embeddings=False)
    assert tied.encoder.embed is tied.decoder.embed
    assert tied.output_projection is None
    hidden = torch.randn(2, 32)
    assert torch.allclose(tied.project(hidden), hidden @ tied.encoder.embed.weight.T)
    assert untied.encoder.embed.weight.data_ptr() != untied.decoder.embed.weight.data_ptr()
    assert untied.output_projection is not None
    assert count_parameters(untied) - count_parameters(tied) == 2 * VOCAB * 32
    # the shared matrix gets gradient from the source, the target and the projection
    src, tgt = make_batch()
    tied(src, tgt).sum().backward()
    assert tied.encoder.embed.weight.grad is not None


def test_base_parameter_count_matches_paper_ballpark() -> None:
    cfg = ModelConfig()  # the paper's base shape
    vocab = 37000  # the paper's shared source-target BPE vocabulary
    model = Transformer(cfg, vocab)
    d, ff = cfg.d_model, cfg.d_ff
    attn = 4 * (d * d + d)
    ffn = d * ff + ff + ff * d + d
    expected = vocab * d + 6 * (attn + ffn + 2 * 2 * d) + 6 * (2 * attn + ffn + 3 * 2 * d)
    assert count_parameters(model) == expected
    assert 60e6 < expected < 66e6  # the paper reports 65M for its base model


def test_xavier_init_of_each_projection() -> None:
    model = make_model()
    d = 32
    qkv = model.encoder.layers[0].self_attn.qkv_proj.weight
    bound = math.sqrt(6 / (d + d))  # each of W^Q, W^K, W^V is d x d
    assert qkv.abs().max() <= bound
    assert qkv.abs().max() > 0.8 * bound
    w_1 = model.encoder.layers[0].feed_forward.w_1.weight
    assert w_1.abs().max() <= math.sqrt(6 / (32 + 64))
    assert torch.all(model.encoder.layers[0].feed_forward.w_1.bias == 0)
    std = model.encoder.embed.weight[4:].std().item()
    assert std == pytest.approx(d**-0.5, rel=0.15)


def test_incremental_decoding_matches_full_decoding() -> None:
    model = make_model(pre_norm=True)
    src, tgt = make_batch()
    full = model(src, tgt)
    enc = model.encode(src)
    cache = model.init_cache(enc, max_len=6)
    steps = [model.decode(tgt[:, t : t + 1], enc, cache) for t in range(6)]
    real = tgt.ne(0)
    assert torch.allclose(torch.cat(steps, 1)[real], full[real], atol=1e-5)
    with pytest.raises(ValueError, match="full"):
        model.decode(tgt[:, :1], enc, cache)


def test_cache_groups_and_reorder() -> None:
    model = make_model()
    src, tgt = make_batch()
    tgt[:, 1:] = torch.randint(4, VOCAB, (3, 5))  # no padding: every row decodes 6 steps
    full = model(src, tgt).repeat_interleave(2, 0)  # 2 "beams" per sentence
    enc = model.encode(src)
    cache = model.init_cache(enc, beam_size=2, max_len=6)
    rows_tgt = tgt.repeat_interleave(2, 0)
    for t in range(3):
        out = model.decode(rows_tgt[:, t : t + 1], enc, cache)
        assert torch.allclose(out[:, 0], full[:, t], atol=1e-5)
    index = torch.tensor([1, 0, 5, 5])  # swap beams of sentence 0, drop sentence 1
    cache.reorder(index)
    for t in range(3, 6):
        out = model.decode(rows_tgt[index, t : t + 1], enc, cache)
        assert torch.allclose(out[:, 0], full[index, t], atol=1e-5)
    with pytest.raises(ValueError, match="multiple"):
        cache.reorder(torch.tensor([0]))


@pytest.mark.parametrize("index", [[0, 0, 2, 3, 4, 4], [5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5],
                                   [4, 5, 0, 1], [2, 3]])
def test_cache_reorders_in_place(index: list[int]) -> None:
    """Any grouped reorder to as many rows or fewer works in place (the same buffers), also where
    a row is both read and overwritten and where sentences change places or leave (the last two
    indices: sentence 2 takes sentence 0's place, sentence 1 leaves); decoding then goes on as
    the full decode of the rows kept."""
    model = make_model()
    src, tgt = make_batch()
    tgt[:, 1:] = torch.randint(4, VOCAB, (3, 5))  # no padding: every row decodes 6 steps
    full = model(src, tgt).repeat_interleave(2, 0)  # 2 "beams" per sentence
    enc = model.encode(src)
    tokens = tgt.repeat_interleave(2, 0)
    with torch.inference_mode():
        cache = model.init_cache(enc, beam_size=2, max_len=6)
        for t in range(3):
            model.decode(tokens[:, t : t + 1], enc, cache)
        before = [k[: cache.length].clone() for k in cache.self_k + cache.self_v]
        storage = cache.self_k[0].data_ptr()
        order = torch.tensor(index)
        cache.reorder(order)
        assert cache.self_k[0].data_ptr() == storage and cache.rows == len(index)
        for old, new in zip(before, cache.self_k + cache.self_v, strict=True):
            assert torch.equal(new[: cache.length], old[:, order])
        for t in range(3, 6):
            out = model.decode(tokens[order, t : t + 1], enc, cache)
            assert torch.allclose(out[:, 0], full[order, t], atol=1e-5)


def test_cache_reorder_can_change_the_group() -> None:
    """Beam search's first step: one row per sentence, then each row fanned out to 3 beams."""
    model = make_model(pre_norm=True)
    src, tgt = make_batch()
    tgt[:, 1:] = torch.randint(4, VOCAB, (3, 5))
    full = model(src, tgt)
    enc = model.encode(src)
    with torch.no_grad():
        cache = model.init_cache(enc, beam_size=1, max_len=6)
        first = model.decode(tgt[:, :1], enc, cache)
        assert torch.allclose(first[:, 0], full[:, 0], atol=1e-5)
        index = torch.tensor([0, 0, 0, 2, 2, 2])  # sentences 0 and 2, three beams each; drop 1
        cache.reorder(index, group=3)
        assert cache.group == 3 and cache.rows == 6 and cache.cross_k[0].size(0) == 2
        for t in range(1, 6):
            out = model.decode(tgt[index, t : t + 1], enc, cache)
            assert torch.allclose(out[:, 0], full[index, t], atol=1e-5)
    with pytest.raises(ValueError, match="multiple"):
        cache.reorder(torch.tensor([0, 1]), group=4)


def test_workspace_backed_cache_matches_plain_cache() -> None:
    model = make_model()
    src, tgt = make_batch()
    enc = model.encode(src)
    workspace = Workspace()
    with torch.inference_mode():
        for rows in (3, 2, 3):  # sentences kept at the reorder; buffers reused across caches
            plain = model.init_cache(enc, beam_size=2, max_len=6)
            reused = model.init_cache(enc, beam_size=2, max_len=6, workspace=workspace)
            tokens = tgt.repeat_interleave(2, 0)
            for t in range(6):
                a = model.decode(tokens[:, t : t + 1], enc, plain)
                b = model.decode(tokens[:, t : t + 1], enc, reused).clone()
                assert torch.allclose(a, b, atol=1e-6)
                if t == 2:
                    keep = torch.arange(2 * rows).flip(0).view(rows, 2).flip(0).reshape(-1)
                    plain.reorder(keep)
                    reused.reorder(keep)
                    tokens = tokens[keep]
    held = workspace.nbytes()
    assert held > 0
    workspace.clear()
    assert workspace.nbytes() == 0


def test_feed_forward_step_equals_forward() -> None:
    model = make_model()
    ffn = model.decoder.layers[0].feed_forward
    x = torch.randn(5, 1, 32)
    with torch.no_grad():
        assert torch.equal(ffn.step(x), ffn(x))
    assert torch.equal(ffn.step(x), ffn(x))  # with gradients: the same function


def test_cross_attention_weights() -> None:
    model = make_model()
    src, tgt = make_batch()
    weights = model.cross_attention_weights(tgt, model.encode(src))
    assert weights.shape == (3, 2, 6, 7)
    assert torch.allclose(weights.sum(-1), torch.ones(3, 2, 6), atol=1e-5)
    assert torch.all(weights[1, :, :, 4:] == 0)


def test_dropout_rate_scale_and_eval_identity() -> None:
    x = torch.ones(200_000)
    torch.manual_seed(3)
    y = dropout(x, 0.3, True)
    kept = y.ne(0)
    assert kept.float().mean().item() == pytest.approx(0.7, abs=0.005)
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.7))
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.3, True), y)  # seeded like every torch op
    assert dropout(x, 0.3, False) is x and dropout(x, 0.0, True) is x
    model = make_model(dropout=0.3, attention_dropout=0.1, activation_dropout=0.1).train()
    src, tgt = make_batch()
    assert not torch.allclose(model(src, tgt), model(src, tgt))
    torch.manual_seed(5)
    first = model(src, tgt)
    torch.manual_seed(5)
    assert torch.equal(model(src, tgt), first)  # training is reproducible from the seed
    model.eval()
    assert torch.equal(model(src, tgt), model(src, tgt))


@pytest.mark.parametrize("rate", ["attention_dropout", "activation_dropout"])
def test_attention_and_activation_dropout_each_act_alone(rate: str) -> None:
    """model.attention_dropout (on the attention weights) and model.activation_dropout (after the
    feed-forward activation) each take effect on their own, every other rate 0: two training
    passes differ; with that rate 0 too they are equal."""
    src, tgt = make_batch()
    model = make_model(**{rate: 0.3}).train()
    assert not torch.allclose(model(src, tgt), model(src, tgt))
    model = make_model(**{rate: 0.0}).train()
    assert torch.equal(model(src, tgt), model(src, tgt))


def test_model_dropout_drops_each_sublayer_output() -> None:
    """model.dropout on the residual branch: a pre-norm sublayer gives x + Dropout(f(LayerNorm(x)))
    while training (each unit of f's output 0 or f / (1 - p)), x + f(LayerNorm(x)) in eval."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)
    block = SublayerConnection(32, 0.5, pre_norm=True).train()
    branch = block(x, lambda h: h) - x
    normed = block.norm(x)
    kept = branch.ne(0)
    assert 0.3 < kept.float().mean().item() < 0.7
    assert torch.allclose(branch[kept], 2 * normed[kept], atol=1e-6)
    assert torch.allclose(block.eval()(x, lambda h: h), x + normed)


def test_model_dropout_drops_the_encoder_and_decoder_inputs() -> None:
    """model.dropout on the embeddings: the encoder's and the decoder's input is
    Dropout(Embeddings + PE) while training (seen with their layer stacks emptied: each unit 0 or
    (Embeddings + PE) / (1 - p)); eval leaves it whole."""
    model = make_model(dropout=0.5, pre_norm=False).train()
    model.encoder.layers, model.decoder.layers = torch.nn.ModuleList(), torch.nn.ModuleList()
    src, tgt = make_batch()
    torch.manual_seed(0)
    enc = model.encode(src)
    hidden, _ = model.decoder(tgt, enc)
    for stack, ids, out in ((model.encoder, src, enc.memory), (model.decoder, tgt, hidden)):
        whole = stack.positions(stack.embed(ids))
        kept = out.ne(0)
        assert 0.3 < kept.float().mean().item() < 0.7
        assert torch.allclose(out[kept], 2 * whole[kept], atol=1e-5)
    model.eval()
    assert torch.allclose(model.encode(src).memory, model.encoder.positions(model.encoder.embed(src)))


def test_bf16_autocast_forward_backward_and_decoding() -> None:
    model = make_model()
    src, tgt = make_batch()
    reference = model(src, tgt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(src, tgt)
        enc = model.encode(src)
        cache = model.init_cache(enc, max_len=2)
        step = model.decode(tgt[:, :1], enc, cache)
    assert torch.isfinite(logits).all() and torch.isfinite(step).all()
    assert (logits.float() - reference).abs().max() < 0.25
    logits.float().sum().backward()
    assert model.encoder.layers[0].self_attn.qkv_proj.weight.grad is not None


def test_layer_norm_keeps_a_training_stream_in_the_autocast_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    # on a GPU (here: the CPU standing in for one) a post-norm layer hands bf16 to the next one
    monkeypatch.setattr(LayerNorm, "devices", ("cpu",))
    torch.manual_seed(0)
    layer = EncoderLayer(small_config()).train()
    x = torch.randn(2, 5, 32) * 3 + 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x, None)
        assert out.dtype == torch.bfloat16
        again = layer(out, None)
    assert again.dtype == torch.bfloat16
    # the float32 gain and bias get float32 gradients through the cast
    again.float().sum().backward()
    norm = layer.sublayer[0].norm
    assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.float32
    assert torch.isfinite(norm.weight.grad).all() and norm.weight.grad.abs().sum() > 0
    # still a layer norm of the same values, to bf16's precision
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    reference = F.layer_norm(x, (32,), norm.weight, norm.bias, norm.eps)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = norm(x)
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - reference).abs().max() < 0.05
    # evaluation (decoding) and a device not listed keep autocast's float32 output
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm.eval()(x).dtype == torch.float32
        monkeypatch.setattr(LayerNorm, "devices", ())
        assert norm.train()(x).dtype == torch.float32


def test_16_bit_attention_on_cuda_avoids_cudnn_sdpa() -> None:
    from torch.nn.attention import SDPBackend

    backends = sdpa_backends("cuda", torch.bfloat16)
    assert backends and SDPBackend.CUDNN_ATTENTION not in backends and SDPBackend.MATH in backends
    assert sdpa_backends("cuda", torch.float16) == backends
    assert sdpa_backends("cuda", torch.float32) is None and sdpa_backends("cpu", torch.bfloat16) is None


def test_attention_calls_sdpa_under_the_chosen_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every SDPA call of a forward pass and a decoding step runs with cuDNN's kernel switched off
    when :func:`sdpa_backends` says so (simulated here on the CPU, which has no cuDNN kernel)."""
    import mtcli.model.attention as model_module

    model = make_model()
    src, tgt = make_batch()
    reference = model(src, tgt)
    monkeypatch.setattr(model_module, "sdpa_backends", lambda device, dtype: model_module.NO_CUDNN_BACKENDS)
    sdpa, seen = F.scaled_dot_product_attention, []

    def recording_sdpa(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    logits = model(src, tgt)
    assert seen and not any(seen)
    assert torch.allclose(logits, reference, atol=1e-6)


# ----------------------------------------------------------------- output vocabulary

OUTPUT_IDS = [0, 1, 2, 3, 5, 8, 9, 13, 21, 30, 34]  # pad/unk/bos/eos + a few pieces


def test_output_vocabulary_is_the_same_distribution_on_every_path() -> None:
    """The output-vocabulary logits (training), the joint-vocabulary logits with -inf off the list
    (widened), and the cached step-by-step logits give one distribution; nothing off the list gets
    mass."""
    torch.manual_seed(0)
    model = Transformer(small_config(), VOCAB, output_ids=OUTPUT_IDS).eval()
    src, tgt = make_batch()
    ids = torch.tensor(OUTPUT_IDS)
    with torch.no_grad():
        short = model(src, tgt)
        full = model.widen(model(src, tgt))
    assert short.shape == (*tgt.shape, len(OUTPUT_IDS)) and full.shape == (*tgt.shape, VOCAB)
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[ids] = False
    assert torch.isneginf(full[..., off]).all()
    torch.testing.assert_close(full[..., ids], short)
    torch.testing.assert_close(torch.log_softmax(full, -1)[..., ids], torch.log_softmax(short, -1))
    # incremental decoding (the search path, with a workspace) agrees with teacher forcing
    enc = model.encode(src[:1])
    cache = model.init_cache(enc, workspace=Workspace())
    with torch.no_grad():
        for t in range(tgt.size(1)):
            step = model.decode(tgt[:1, t : t + 1], enc, cache)[:, 0]
            torch.testing.assert_close(step, short[:1, t])
            torch.testing.assert_close(model.widen(step), full[:1, t])
    assert model.output_size == len(OUTPUT_IDS)


def test_output_vocabulary_without_a_list_is_the_joint_softmax() -> None:
    model = make_model()
    src, tgt = make_batch()
    with torch.no_grad():
        torch.testing.assert_close(model.widen(model(src, tgt)), model(src, tgt))
    target = torch.tensor([[5, 7, 0]])
    assert torch.equal(model.output_targets(target), target)
    assert model.output_ids is None and "output_ids" not in model.state_dict()


def test_output_targets_map_to_list_positions_and_unlisted_ids_to_unk() -> None:
    model = Transformer(small_config(), VOCAB, output_ids=OUTPUT_IDS)
    target = torch.tensor([[13, 3, 0], [7, 34, 1]])  # 7 is not listed
    assert model.output_targets(target).tolist() == [[7, 3, 0], [1, 10, 1]]
    assert model.state_dict()["output_ids"].tolist() == OUTPUT_IDS  # saved with the weights
    assert "output_index" not in model.state_dict()  # derived, not saved


@pytest.mark.parametrize("ids", [[0, 1, 3, 2, 5], [1, 2, 3, 5], [0, 1, 3, 5], [0, 1, 2, 3],
                                 [0, 1, 2, 3, VOCAB], [0, 1, 2, 3, 5, 5], []])
def test_output_vocabulary_rejects_a_bad_list(ids: list[int]) -> None:
    with pytest.raises(ValueError, match="output_ids"):
        Transformer(small_config(), VOCAB, output_ids=ids)


def test_output_vocabulary_gradient_reaches_only_listed_embeddings_through_the_output() -> None:
    """With untied source embeddings, the shared target/output matrix gets output gradient only
    on listed rows (and input gradient on the rows the decoder reads)."""
    torch.manual_seed(0)
    model = Transformer(small_config(tie_embeddings=False), VOCAB, output_ids=OUTPUT_IDS)
    src, tgt = make_batch()
    model(src, tgt).sum().backward()
    grad = model.output_projection.weight.grad
    listed = torch.zeros(VOCAB, dtype=torch.bool)
    listed[OUTPUT_IDS] = True
    assert grad[~listed].abs().sum() == 0 and grad[listed].abs().sum() > 0
