"""The Transformer's building blocks (sections 3.1-3.5), named as in the paper.

* :class:`Embeddings` (section 3.4): ``Embedding(x) * sqrt(d_model)``.
* :class:`PositionalEncoding` (section 3.5): the sinusoid table, added to the embeddings.
* :class:`PositionwiseFeedForward` (section 3.3, equation 2): ``max(0, xW_1 + b_1) W_2 + b_2``
  (or swish, ``SiLU(xW_1 + b_1) W_2 + b_2``, with ``model.activation: swish``).
* :class:`SublayerConnection` (sections 3.1 and 5.4): ``LayerNorm(x + Dropout(Sublayer(x)))``,
  or pre-norm ``x + Dropout(Sublayer(LayerNorm(x)))`` with ``model.pre_norm``; its
  :class:`LayerNorm` keeps a mixed-precision training run's residual stream in bf16 or fp16.
* :class:`EncoderLayer`, :class:`DecoderLayer`, :class:`Encoder`, :class:`Decoder` (section 3.1,
  figure 1); the decoder's ``step`` methods run one position with a :class:`DecoderCache`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcli.config import ModelConfig
from mtcli.model.attention import MultiHeadAttention, dropout
from mtcli.model.incremental import DecoderCache, EncoderOutput

LAYER_NORM_EPS = 1e-5


class PositionwiseFeedForward(nn.Module):
    """Position-wise feed-forward network (section 3.3, equation 2).

    ``FFN(x) = max(0, x W_1 + b_1) W_2 + b_2`` with inner width ``d_ff``; with ``activation``
    ``"swish"`` the ReLU is swish, ``SiLU(z) = z * sigmoid(z)`` (Marian's and OPUS-MT's).
    ``activation_dropout`` (if > 0) drops units after the activation while training.
    """

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float, activation: str = "relu") -> None:
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.activation_dropout = activation_dropout
        self.activation = activation
        #: True in a decoding copy whose ``w_1`` applies the ReLU itself, fused into its
        #: product (:meth:`~mtcli.model.Transformer.for_decoding`; never for swish).
        self.relu_in_w_1 = False

    def _activate(self, h: Tensor, inplace: bool = False) -> Tensor:
        if self.activation == "swish":
            return F.silu(h, inplace=inplace)
        return h.relu_() if inplace else F.relu(h)

    def forward(self, x: Tensor) -> Tensor:
        """``[..., d_model]`` -> ``[..., d_model]``."""
        h = self.w_1(x) if self.relu_in_w_1 else self._activate(self.w_1(x))
        return self.w_2(dropout(h, self.activation_dropout, self.training))

    def step(self, x: Tensor) -> Tensor:
        """:meth:`forward` for incremental decoding: the activation in place when no gradient is
        recorded (one fewer ``[rows, d_ff]`` tensor per layer and step)."""
        if self.relu_in_w_1 or self.training or torch.is_grad_enabled():
            return self.forward(x)
        return self.w_2(self._activate(self.w_1(x), inplace=True))


class Embeddings(nn.Module):
    """Token embeddings scaled by sqrt(d_model) (section 3.4): ``E[x] * sqrt(d_model)``.

    Initialised N(0, d_model^-0.5), so that the scaled embeddings have unit variance; the row of
    ``pad_id`` starts at zero and gets no gradient through the lookup. ``weight`` is also the
    pre-softmax projection when embeddings are tied: the pad row is then the pad logit's weight,
    which the softmax does train (pad keys are masked, so no output reads it as an embedding).
    """

    def __init__(self, vocab_size: int, d_model: int, pad_id: int) -> None:
        super().__init__()
        self.lut = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.scale = math.sqrt(d_model)
        nn.init.normal_(self.lut.weight, mean=0.0, std=d_model**-0.5)
        with torch.no_grad():
            self.lut.weight[pad_id].zero_()

    @property
    def weight(self) -> Tensor:
        """The embedding matrix ``[vocab, d_model]``."""
        return self.lut.weight

    def forward(self, tokens: Tensor) -> Tensor:
        """``[B, T]`` ids -> ``[B, T, d_model]``."""
        return self.lut(tokens) * self.scale


class PositionalEncoding(nn.Module):
    """Sinusoidal positional encoding (section 3.5), added to the embeddings.

    ``PE(pos, 2i) = sin(pos / 10000^(2i/d_model))``, ``PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))``
    for ``pos < max_positions``; the table is a precomputed (non-persistent) buffer ``pe``.
    """

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        pos = torch.arange(max_positions, dtype=torch.float64)[:, None]
        two_i = torch.arange(0, d_model, 2, dtype=torch.float64)
        angle = pos / torch.pow(10000.0, two_i / d_model)
        pe = torch.empty(max_positions, d_model, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(angle)
        pe[:, 1::2] = torch.cos(angle)
        self.max_positions = max_positions
        self.register_buffer("pe", pe.float(), persistent=False)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """``x [B, T, d_model]`` + ``PE[offset : offset+T]``, or ``+ PE[positions]`` with each
        slot's own position ``[B, T]`` (packed rows, where every sentence starts at 0)."""
        if positions is not None:
            return x + self.pe[positions]
        t = x.size(1)
        if offset + t > self.max_positions:
            raise ValueError(
                f"sequence of {offset + t} positions exceeds model.max_positions={self.max_positions}"
            )
        return x + self.pe[offset : offset + t]


class LayerNorm(nn.LayerNorm):
    """Layer normalisation, ``(x - mean) / sqrt(var + eps) * gain + bias`` over the last axis.

    While training under autocast on a GPU it returns the autocast dtype (bf16 or fp16), where
    autocast would return float32. The post-norm residual stream, the output of every
    sublayer's norm, is then bf16 from layer to layer, as in fairseq's ``--bf16`` and Marian's
    fp16 training, and the norm, dropout and residual kernels, forward and backward, which are
    bound by memory traffic, move half the bytes. The input is normalised in its own dtype, so a
    float32 input (the embeddings, a pre-norm stream) keeps its precision, and the mean and
    variance are accumulated in float32 either way. A CPU keeps the float32 stream (its bf16
    element-wise kernels convert to float32 and back, and were slower there), and evaluation and
    decoding are unchanged.
    """

    #: the device types whose training keeps the residual stream in the autocast dtype
    devices: tuple[str, ...] = ("cuda",)

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., d]`` normalised over ``d``."""
        device = x.device.type
        if not (self.training and device in self.devices and torch.is_autocast_enabled(device)):
            return super().forward(x)
        with torch.autocast(device, enabled=False):
            out = F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)
        return out.to(torch.get_autocast_dtype(device))


class SublayerConnection(nn.Module):
    """Residual connection around a sublayer, with LayerNorm and dropout (sections 3.1, 5.4).

    Post-norm (the paper): ``LayerNorm(x + Dropout(Sublayer(x)))``.
    Pre-norm (``pre_norm=True``): ``x + Dropout(Sublayer(LayerNorm(x)))``.
    """

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm = LayerNorm(d_model, eps=LAYER_NORM_EPS)
        self.dropout = dropout
        self.pre_norm = pre_norm

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        """Apply ``sublayer`` to ``x`` with the residual connection and normalisation."""
        y = dropout(sublayer(self.norm(x) if self.pre_norm else x), self.dropout, self.training)
        return x + y if self.pre_norm else self.norm(x + y)


class EncoderLayer(nn.Module):
    """Encoder layer (section 3.1): self-attention, then the feed-forward network.

    ``x = SublayerConnection(x, SelfAttention)``; ``x = SublayerConnection(x, FFN)``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, True)
        self.feed_forward = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout, cfg.activation)
        self.sublayer = nn.ModuleList(
            SublayerConnection(cfg.d_model, cfg.dropout, cfg.pre_norm) for _ in range(2)
        )

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """``x [B, S, d_model]``; ``mask`` the additive source padding mask or None."""
        x = self.sublayer[0](x, lambda h: self.self_attn.forward_self(h, mask))
        return self.sublayer[1](x, self.feed_forward)


class DecoderLayer(nn.Module):
    """Decoder layer (section 3.1): masked self-attention, encoder-decoder attention, FFN.

    Self-attention is causal (position ``t`` attends to positions ``<= t``); in encoder-decoder
    attention the queries come from the decoder and the keys/values from the encoder output.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, True)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, False)
        self.feed_forward = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout, cfg.activation)
        self.sublayer = nn.ModuleList(
            SublayerConnection(cfg.d_model, cfg.dropout, cfg.pre_norm) for _ in range(3)
        )

    def forward(
        self, x: Tensor, kv: tuple[Tensor, Tensor], mask: Tensor | None, need_weights: bool = False,
        self_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Whole target ``x [B, T, d_model]`` at once (training, uncached decoding).

        ``kv`` are this layer's encoder keys/values, ``mask`` the source padding mask. Returns the
        output and, with ``need_weights``, the head-averaged cross-attention weights ``[B, T, S]``.
        ``self_mask`` replaces the causal self-attention's own mask (packed rows: causal within
        each sentence).
        """
        x = self.sublayer[0](x, lambda h: self.self_attn.forward_self(h, self_mask, is_causal=self_mask is None))
        weights: list[Tensor | None] = [None]

        def cross(h: Tensor) -> Tensor:
            out, weights[0] = self.cross_attn.forward_cross(h, kv, mask, need_weights)
            return out

        x = self.sublayer[1](x, cross)
        return self.sublayer[2](x, self.feed_forward), weights[0]

    def step(self, x: Tensor, cache: DecoderCache, layer: int) -> Tensor:
        """One new position ``x [N, 1, d_model]`` for the ``N`` rows of ``cache``."""
        k_buf, v_buf = cache.self_k[layer], cache.self_v[layer]
        x = self.sublayer[0](x, lambda h: self.self_attn.forward_step(h, k_buf, v_buf, cache.length))
        n_sent, group = cache.cross_k[layer].size(0), cache.group
        k, v = cache.cross_k[layer], cache.cross_v[layer]
        # The `group` beams of a sentence share its encoder keys/values: fold them into the query
        # axis, [N, 1, D] -> [sentences, group, D], instead of copying the encoder side per beam.
        x = self.sublayer[1](
            x,
            lambda h: self.cross_attn.forward_cross_step(
                h.view(n_sent, group, -1), k, v, cache.cross_mask
            ),
        )
        return self.sublayer[2](x, self.feed_forward.step)


class Encoder(nn.Module):
    """The encoder stack (section 3.1): ``N`` identical :class:`EncoderLayer` s.

    Input is ``Dropout(Embeddings(src) + PE)``; pre-norm adds a final LayerNorm.
    """

    def __init__(self, cfg: ModelConfig, embed: Embeddings, positions: PositionalEncoding) -> None:
        super().__init__()
        self.embed, self.positions, self.dropout = embed, positions, cfg.dropout
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.norm = LayerNorm(cfg.d_model, eps=LAYER_NORM_EPS) if cfg.pre_norm else None

    def forward(self, src: Tensor, mask: Tensor | None, positions: Tensor | None = None) -> Tensor:
        """``src [B, S]`` ids -> ``memory [B, S, d_model]`` (``positions``: each slot's, when packed)."""
        x = dropout(self.positions(self.embed(src), positions=positions), self.dropout, self.training)
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x) if self.norm is not None else x


class Decoder(nn.Module):
    """The decoder stack (section 3.1): ``N`` identical :class:`DecoderLayer` s.

    Input is ``Dropout(Embeddings(tgt_in) + PE)``; pre-norm adds a final LayerNorm. Returns the
    final hidden states; the pre-softmax projection lives in :class:`Transformer`.
    """

    def __init__(self, cfg: ModelConfig, embed: Embeddings, positions: PositionalEncoding) -> None:
        super().__init__()
        self.embed, self.positions, self.dropout = embed, positions, cfg.dropout
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.norm = LayerNorm(cfg.d_model, eps=LAYER_NORM_EPS) if cfg.pre_norm else None

    def forward(
        self, tgt_in: Tensor, enc: EncoderOutput, need_weights: bool = False,
        positions: Tensor | None = None, self_mask: Tensor | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        """``tgt_in [B, T]`` -> hidden ``[B, T, d_model]`` and, with ``need_weights``, a list of
        per-layer head-averaged cross-attention weights ``[B, T, S]`` (else an empty list).
        Packed rows give each slot's ``positions`` and the self-attention's ``self_mask``."""
        x = dropout(self.positions(self.embed(tgt_in), positions=positions), self.dropout, self.training)
        weights: list[Tensor] = []
        for layer in self.layers:
            kv = layer.cross_attn.project_kv(enc.memory)
            x, w = layer(x, kv, enc.attn_mask, need_weights, self_mask)
            if w is not None:
                weights.append(w)
        return (self.norm(x) if self.norm is not None else x), weights

    def step(self, tgt_in: Tensor, cache: DecoderCache) -> Tensor:
        """The newest position ``tgt_in [N, 1]`` -> hidden ``[N, 1, d_model]``; advances the cache."""
        x = dropout(self.positions(self.embed(tgt_in), cache.length), self.dropout, self.training)
        for i, layer in enumerate(self.layers):
            x = layer.step(x, cache, i)
        cache.length += 1
        return self.norm(x) if self.norm is not None else x
