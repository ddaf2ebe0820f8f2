"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), part by part.

Every class below is named after the paper and its docstring gives the equation it computes:

* :class:`Embeddings` (section 3.4): ``Embedding(x) * sqrt(d_model)``.
* :class:`PositionalEncoding` (section 3.5): the sinusoid table, added to the embeddings.
* :func:`reference_attention` (section 3.2.1, equation 1): ``softmax(QK^T / sqrt(d_k)) V``.
* :class:`MultiHeadAttention` (section 3.2.2): ``Concat(head_1..head_h) W^O``.
* :class:`PositionwiseFeedForward` (section 3.3, equation 2): ``max(0, xW_1 + b_1) W_2 + b_2``.
* :class:`SublayerConnection` (section 3.1 and 5.4): ``LayerNorm(x + Dropout(Sublayer(x)))``.
* :class:`EncoderLayer`, :class:`DecoderLayer`, :class:`Encoder`, :class:`Decoder`, and the
  whole :class:`Transformer` (section 3.1, figure 1).

Beyond the paper, as in common practice: an optional pre-norm arrangement (``cfg.pre_norm``,
``x + Dropout(Sublayer(LayerNorm(x)))`` with a final LayerNorm on each stack), one joint
embedding shared by source, target and the pre-softmax projection (section 3.4, "we share the
same weight matrix between the two embedding layers and the pre-softmax linear
transformation"), dropout on the attention weights and after the ReLU, Xavier-uniform
initialisation of every projection and N(0, d_model^-0.5) embeddings.

Speed (fp32 and bf16 autocast on a CPU, also fine on GPUs): attention runs through
``torch.nn.functional.scaled_dot_product_attention`` (SDPA); self-attention uses one fused
``[W^Q; W^K; W^V]`` projection and cross-attention one fused ``[W^K; W^V]`` projection of the
encoder output; the decoder's causal mask is SDPA's ``is_causal`` (targets are right-padded, so
no real position ever sees a pad key); dropout is skipped when its rate is 0, and on a CPU it
draws its mask from 16-bit slices of 64-bit random integers (:func:`dropout`), about 4x
cheaper than ``F.dropout``. SDPA has no fused attention dropout on a CPU (with ``dropout_p > 0``
it runs its own unfused math), so training with attention dropout on a CPU computes the same
math explicitly (:func:`reference_attention`) with that faster dropout. 16-bit attention on
CUDA avoids SDPA's cuDNN kernel (:func:`sdpa_backends`), whose per-shape graph builds made bf16
training 3-15x slower than fp32 with length-varying batches.

Masks: ``src_pad_mask`` is boolean ``[B, S]``, True at padding (ARCHITECTURE.md). Attention takes
an additive float mask ``[B, 1, 1, S]`` (0 where a key may be attended, -inf at padding), or a
boolean one (True where a key may be attended), exactly as SDPA does.

Incremental decoding (:class:`DecoderCache`): each decoder layer keeps its self-attention keys
and values in a preallocated, time-major buffer ``[max_len, rows, h, d_k]``; the encoder's
cross-attention keys and values are computed once per sentence by :meth:`Transformer.init_cache`
and shared by the ``beam_size`` rows of that sentence (the beams are folded into the query axis
of cross-attention, so the encoder side is never copied per beam).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtcli.config import ModelConfig
from mtcli.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID

LAYER_NORM_EPS = 1e-5

#: SDPA kernels for 16-bit attention on CUDA: everything but cuDNN's, which builds (and caches) a
#: graph per new shape, ~25 ms of host time each on an H100; batches of varying lengths and every
#: decoding step are new shapes (bench/NOTES.md: bf16 training at the base shape went from 0.35x
#: to 2.3x fp32).
NO_CUDNN_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device_type: str, dtype: torch.dtype) -> list[SDPBackend] | None:
    """The SDPA backends to allow for queries on ``device_type`` in ``dtype`` (None: PyTorch's choice)."""
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return NO_CUDNN_BACKENDS
    return None


# ----------------------------------------------------------------------------------------------
# Dropout


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Dropout (section 5.4): zero each unit with probability ``p``, scale the rest by ``1/(1-p)``.

    Returns ``x`` itself (no op at all) when not training or ``p == 0``. On a CPU the keep mask
    is drawn from 16-bit slices of 64-bit random integers (``p`` rounded to a multiple of
    1/65536): about 4x faster than ``F.dropout``, whose per-element Bernoulli sampling costs more
    than the rest of a dropout by far. It uses torch's default generator, so seeding and RNG
    state checkpoints work as usual. Other devices use ``F.dropout`` (fused there).
    """
    if p <= 0.0 or not training:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, True)
    n = x.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), 2**63 - 1)
    uniform16 = bits.view(torch.int16)[:n].view(x.shape)  # uniform over [-32768, 32767]
    keep = uniform16 >= round(p * 65536) - 32768
    return x * keep.to(x.dtype).mul_(1.0 / (1.0 - p))


# ----------------------------------------------------------------------------------------------
# Attention


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention written out (equation 1), for tests and attention plots.

    ``Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V`` with ``q [..., T, d_k]``,
    ``k [..., S, d_k]``, ``v [..., S, d_v]``. ``mask`` follows SDPA: boolean True where a key may
    be attended, or an additive float mask (-inf where not); ``is_causal`` lets query ``t`` see
    keys ``<= t`` only. A masked key gets exactly zero weight (``exp(-inf) = 0``). ``dropout_p``
    drops attention weights (training). Returns ``(output [..., T, d_v], weights [..., T, S])``,
    the weights before dropout.
    """
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    if is_causal:
        t, s = scores.shape[-2:]
        future = torch.ones(t, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(dropout(weights, dropout_p, True), v), weights


def padding_attn_mask(src_pad_mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor | None:
    """Additive attention mask ``[B, 1, 1, S]`` from a boolean ``[B, S]`` padding mask.

    0 where a key is a real token, -inf at padding; None when there is no padding at all (so SDPA
    runs without a mask).
    """
    if not bool(src_pad_mask.any()):
        return None
    mask = torch.zeros(src_pad_mask.shape, dtype=dtype, device=src_pad_mask.device)
    return mask.masked_fill_(src_pad_mask, float("-inf"))[:, None, None, :]


class MultiHeadAttention(nn.Module):
    """Multi-head attention (section 3.2.2).

    ``MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O`` with
    ``head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)`` and ``d_k = d_v = d_model / h``.

    ``self_attention=True``: Q, K and V are projections of the same input through one fused
    ``[W^Q; W^K; W^V]`` (``qkv_proj``). ``self_attention=False`` (encoder-decoder attention):
    ``q_proj`` projects the decoder state, one fused ``[W^K; W^V]`` (``kv_proj``) the encoder
    output. ``dropout`` is applied to the attention weights while training.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float, self_attention: bool) -> None:
        super().__init__()
        self.d_model, self.n_heads, self.d_k = d_model, n_heads, d_model // n_heads
        self.dropout = dropout
        self.self_attention = self_attention
        if self_attention:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        else:
            self.q_proj = nn.Linear(d_model, d_model)
            self.kv_proj = nn.Linear(d_model, 2 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def _heads(self, x: Tensor, parts: int) -> tuple[Tensor, ...]:
        """``[B, T, parts*d_model]`` -> ``parts`` views ``[B, h, T, d_k]`` (no copy)."""
        b, t, _ = x.shape
        return x.view(b, t, parts, self.n_heads, self.d_k).permute(2, 0, 3, 1, 4).unbind(0)

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool = False
    ) -> Tensor:
        """SDPA over heads, then ``Concat(heads) W^O``: ``[B, h, T, d_k]`` -> ``[B, T, d_model]``."""
        dropout_p = self.dropout if self.training else 0.0
        if dropout_p > 0.0 and q.device.type == "cpu":
            # SDPA has no fused attention dropout on a CPU (it runs its unfused math path then),
            # so write the same math out and use the faster dropout() above.
            out = reference_attention(q, k, v, mask, is_causal, dropout_p)[0]
        else:
            if mask is not None and mask.dtype not in (torch.bool, q.dtype):
                mask = mask.to(q.dtype)  # bf16 autocast: SDPA wants the mask in the query's dtype
            backends = sdpa_backends(q.device.type, q.dtype)
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p
                )
        b, _, t, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, t, self.d_model))

    def forward_self(self, x: Tensor, mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        """Self-attention over ``x [B, T, d_model]`` (Q = K = V = x)."""
        q, k, v = self._heads(self.qkv_proj(x), 3)
        return self._attend(q, k, v, mask, is_causal)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values ``[B, h, S, d_k]`` of the encoder output (``memory W^K``, ``memory W^V``)."""
        k, v = self._heads(self.kv_proj(memory), 2)
        return k, v

    def forward_cross(
        self, x: Tensor, kv: tuple[Tensor, Tensor], mask: Tensor | None, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Encoder-decoder attention: queries from ``x [B, T, d_model]``, keys/values ``kv``.

        With ``need_weights`` the weights are computed explicitly (:func:`reference_attention`)
        and returned averaged over heads, ``[B, T, S]``; otherwise the second item is None.
        """
        (q,) = self._heads(self.q_proj(x), 1)
        k, v = kv
        if not need_weights:
            return self._attend(q, k, v, mask), None
        out, weights = reference_attention(q, k, v, mask)
        b, _, t, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, t, self.d_model)), weights.mean(1)

    def forward_cross_step(
        self, x: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
    ) -> Tensor:
        """Encoder-decoder attention for one decoding step, ``group`` queries per sentence.

        ``x [sentences, group, d_model]`` (the beams of a sentence folded into its query axis),
        ``k``/``v [sentences, h, S, d_k]`` contiguous (from :meth:`Transformer.init_cache`),
        ``mask [sentences, 1, 1, S]`` additive or None. Returns ``[sentences * group, 1,
        d_model]``. On a CPU the few queries per sentence make the explicit
        ``softmax(Q K^T / sqrt(d_k) + M) V`` with two batched matmuls cheaper than SDPA.
        """
        n, g, _ = x.shape
        q = self.q_proj(x).view(n, g, self.n_heads, self.d_k).transpose(1, 2)  # [n, h, g, d_k]
        if x.device.type != "cpu":
            return self._attend(q, k, v, mask).view(n * g, 1, self.d_model)
        scores = torch.matmul(q, k.transpose(-2, -1)).mul_(1.0 / math.sqrt(self.d_k))
        if mask is not None:
            scores = scores.add_(mask)
        out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [n, h, g, d_k]
        return self.out_proj(out.transpose(1, 2).reshape(n * g, 1, self.d_model))

    def forward_step(self, x: Tensor, cache_k: Tensor, cache_v: Tensor, length: int) -> Tensor:
        """One decoding step of causal self-attention with a key/value cache.

        ``x [N, 1, d_model]`` is the newest position; its key and value are written at time
        ``length`` of the time-major buffers ``cache_k``/``cache_v`` ``[max_len, N, h, d_k]`` and
        the query attends to times ``0..length`` (all of them are in its past: no mask needed).
        """
        n = x.size(0)
        qkv = self.qkv_proj(x).view(n, 3, self.n_heads, self.d_k)
        cache_k[length] = qkv[:, 1]
        cache_v[length] = qkv[:, 2]
        q = qkv[:, 0].unsqueeze(2)  # [N, h, 1, d_k]
        k = cache_k[: length + 1].permute(1, 2, 0, 3)  # [N, h, length+1, d_k], a view
        v = cache_v[: length + 1].permute(1, 2, 0, 3)
        if x.device.type == "cpu":
            # One query per row: on a CPU the plain matmul form is about 2x faster than SDPA
            # here (equation 1, the scaling and softmax done in place on the small scores).
            scores = torch.matmul(q, k.transpose(-2, -1)).mul_(1.0 / math.sqrt(self.d_k))
            out = torch.matmul(torch.softmax(scores, dim=-1), v)
            return self.out_proj(out.reshape(n, 1, self.d_model))
        return self._attend(q, k, v, None)


# ----------------------------------------------------------------------------------------------
# Feed-forward, embeddings, positions, residual connections


class PositionwiseFeedForward(nn.Module):
    """Position-wise feed-forward network (section 3.3, equation 2).

    ``FFN(x) = max(0, x W_1 + b_1) W_2 + b_2`` with inner width ``d_ff``; ``activation_dropout``
    (if > 0) drops units after the ReLU while training.
    """

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float) -> None:
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.activation_dropout = activation_dropout

    def forward(self, x: Tensor) -> Tensor:
        """``[..., d_model]`` -> ``[..., d_model]``."""
        h = F.relu(self.w_1(x))
        return self.w_2(dropout(h, self.activation_dropout, self.training))

    def step(self, x: Tensor) -> Tensor:
        """:meth:`forward` for incremental decoding: the ReLU in place when no gradient is
        recorded (one fewer ``[rows, d_ff]`` tensor per layer and step)."""
        if self.training or torch.is_grad_enabled():
            return self.forward(x)
        return self.w_2(self.w_1(x).relu_())


class Embeddings(nn.Module):
    """Token embeddings scaled by sqrt(d_model) (section 3.4): ``E[x] * sqrt(d_model)``.

    Initialised N(0, d_model^-0.5), so that the scaled embeddings have unit variance; the row of
    ``pad_id`` is zero and gets no gradient. ``weight`` is also the pre-softmax projection when
    embeddings are tied.
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

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """``x [B, T, d_model]`` + ``PE[offset : offset+T]``."""
        t = x.size(1)
        if offset + t > self.max_positions:
            raise ValueError(
                f"sequence of {offset + t} positions exceeds model.max_positions={self.max_positions}"
            )
        return x + self.pe[offset : offset + t]


class SublayerConnection(nn.Module):
    """Residual connection around a sublayer, with LayerNorm and dropout (sections 3.1, 5.4).

    Post-norm (the paper): ``LayerNorm(x + Dropout(Sublayer(x)))``.
    Pre-norm (``pre_norm=True``): ``x + Dropout(Sublayer(LayerNorm(x)))``.
    """

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS)
        self.dropout = dropout
        self.pre_norm = pre_norm

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        """Apply ``sublayer`` to ``x`` with the residual connection and normalisation."""
        y = dropout(sublayer(self.norm(x) if self.pre_norm else x), self.dropout, self.training)
        return x + y if self.pre_norm else self.norm(x + y)


# ----------------------------------------------------------------------------------------------
# Layers and stacks


class EncoderLayer(nn.Module):
    """Encoder layer (section 3.1): self-attention, then the feed-forward network.

    ``x = SublayerConnection(x, SelfAttention)``; ``x = SublayerConnection(x, FFN)``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, True)
        self.feed_forward = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
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
        self.feed_forward = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
        self.sublayer = nn.ModuleList(
            SublayerConnection(cfg.d_model, cfg.dropout, cfg.pre_norm) for _ in range(3)
        )

    def forward(
        self, x: Tensor, kv: tuple[Tensor, Tensor], mask: Tensor | None, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Whole target ``x [B, T, d_model]`` at once (training, uncached decoding).

        ``kv`` are this layer's encoder keys/values, ``mask`` the source padding mask. Returns the
        output and, with ``need_weights``, the head-averaged cross-attention weights ``[B, T, S]``.
        """
        x = self.sublayer[0](x, lambda h: self.self_attn.forward_self(h, None, is_causal=True))
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
        self.norm = nn.LayerNorm(cfg.d_model, eps=LAYER_NORM_EPS) if cfg.pre_norm else None

    def forward(self, src: Tensor, mask: Tensor | None) -> Tensor:
        """``src [B, S]`` ids -> ``memory [B, S, d_model]``."""
        x = dropout(self.positions(self.embed(src)), self.dropout, self.training)
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
        self.norm = nn.LayerNorm(cfg.d_model, eps=LAYER_NORM_EPS) if cfg.pre_norm else None

    def forward(
        self, tgt_in: Tensor, enc: EncoderOutput, need_weights: bool = False
    ) -> tuple[Tensor, list[Tensor]]:
        """``tgt_in [B, T]`` -> hidden ``[B, T, d_model]`` and, with ``need_weights``, a list of
        per-layer head-averaged cross-attention weights ``[B, T, S]`` (else an empty list)."""
        x = dropout(self.positions(self.embed(tgt_in)), self.dropout, self.training)
        weights: list[Tensor] = []
        for layer in self.layers:
            kv = layer.cross_attn.project_kv(enc.memory)
            x, w = layer(x, kv, enc.attn_mask, need_weights)
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


# ----------------------------------------------------------------------------------------------
# Encoder output and the incremental decoding cache


@dataclass
class EncoderOutput:
    """What the encoder hands to the decoder.

    ``memory [B, S, d_model]``; ``src_pad_mask [B, S]`` bool, True at padding; ``attn_mask`` the
    same as an additive ``[B, 1, 1, S]`` mask, or None when the batch has no padding.
    """

    memory: Tensor
    src_pad_mask: Tensor
    attn_mask: Tensor | None = None

    def select(self, index: Tensor) -> EncoderOutput:
        """Rows ``index`` (e.g. the sentences still being decoded)."""
        mask = self.attn_mask.index_select(0, index) if self.attn_mask is not None else None
        return EncoderOutput(
            self.memory.index_select(0, index), self.src_pad_mask.index_select(0, index), mask
        )

    def repeat_interleave(self, repeats: int) -> EncoderOutput:
        """Each row ``repeats`` times in a row (``[B, ...]`` -> ``[B*repeats, ...]``), for beams."""
        mask = self.attn_mask.repeat_interleave(repeats, 0) if self.attn_mask is not None else None
        return EncoderOutput(
            self.memory.repeat_interleave(repeats, 0),
            self.src_pad_mask.repeat_interleave(repeats, 0),
            mask,
        )


class Workspace:
    """Flat buffers that incremental decoding reuses from one call to the next.

    A fresh large tensor is fresh memory from the operating system, and its first touch costs a
    page fault per 4 KiB page: on a CPU, decoding a batch of 64 sentences with beam 5 spent
    ~10% of its time in the kernel faulting in new key/value caches and logits. A workspace
    keeps those buffers (key/value caches, logits, scratch) alive between batches instead, at
    the price of holding that memory (~100 MB for batch 64, beam 5 of the Multi30k model) until
    :meth:`clear` or until the workspace is dropped.

    ``get(key, shape, ...)`` returns a view of the buffer named ``key`` (grown when too small);
    a later ``get`` of the same key may overwrite or replace it, so one key serves one purpose.
    Not thread-safe: use one workspace per thread.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def get(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """A tensor of ``shape`` (contents undefined) in the buffer named ``key``."""
        numel = math.prod(shape)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel].view(shape)

    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Release every buffer."""
        self._buffers.clear()


class DecoderCache:
    """Decoder state for incremental decoding (one new target position per call).

    Rows come in groups: row ``r`` belongs to sentence ``r // group`` (``group`` is the beam size).

    * ``self_k[l]``, ``self_v[l]``: layer ``l``'s self-attention keys/values, preallocated
      time-major ``[max_len, rows, h, d_k]``, filled up to ``length``.
    * ``cross_k[l]``, ``cross_v[l]``: encoder keys/values ``[sentences, h, S, d_k]``, computed once.
    * ``cross_mask``: the source padding mask ``[sentences, 1, 1, S]`` or None.
    * ``output_t``: the pre-softmax weight transposed and contiguous ``[d_model, vocab]``, made
      once per cache by :meth:`Transformer.decode` (``hidden @ W^T`` is then one plain ``mm``,
      about 10% faster on a CPU than ``linear`` with the ``[vocab, d_model]`` weight).

    :meth:`reorder` selects rows (beam reordering, dropping finished sentences) and can change
    ``group`` (beam search runs its first step with one row per sentence). Time-major
    buffers make the filled part ``[:length]`` contiguous, so a reorder copies exactly that part,
    into a second preallocated set of buffers that then swaps with the first (ping-pong): after
    the first reorder, decoding allocates nothing. With a :class:`Workspace` both sets (and the
    logits, see :meth:`Transformer.decode`) live in the workspace's buffers ``"cache_a"``,
    ``"cache_b"`` and ``"logits"``, kept for the next cache made with it.
    """

    def __init__(
        self, self_k: list[Tensor], self_v: list[Tensor], cross_k: list[Tensor],
        cross_v: list[Tensor], cross_mask: Tensor | None, group: int,
        workspace: Workspace | None = None, storage_key: str = "cache_a",
    ) -> None:
        self.self_k, self.self_v = self_k, self_v
        self.cross_k, self.cross_v, self.cross_mask = cross_k, cross_v, cross_mask
        self.group = group
        self.length = 0
        self.output_t: Tensor | None = None
        self.workspace = workspace
        self._spare: list[Tensor] = []  # flat storage for the next reorder
        self._storage = [t.view(-1) for t in self_k + self_v]  # flat storage of the current state
        self._keys = (storage_key, "cache_b" if storage_key == "cache_a" else "cache_a")

    def _allocate(self, count: int, size: int, like: Tensor) -> list[Tensor]:
        """``count`` flat buffers of ``size`` elements for the next reorder."""
        if self.workspace is None:
            return [like.new_empty(size) for _ in range(count)]
        flat = self.workspace.get(self._keys[1], (count, size), like.dtype, like.device)
        return list(flat.unbind(0))

    @property
    def rows(self) -> int:
        """Number of decoder rows (sentences x group)."""
        return self.self_k[0].size(1)

    @property
    def max_len(self) -> int:
        """Most positions this cache can hold."""
        return self.self_k[0].size(0)

    def reorder(self, index: Tensor, group: int | None = None) -> None:
        """Keep rows ``index`` (LongTensor, new row ``i`` = old row ``index[i]``).

        ``index`` must keep rows grouped: each run of ``group`` new rows (``group`` defaults to
        the current one; a new value, e.g. the beam size after a first step of one row per
        sentence, replaces it) comes from one old sentence, sentences in increasing order (what
        beam search and dropping finished sentences produce). The encoder side is then selected
        per sentence, and left untouched when no sentence was dropped.
        """
        n_new, old_group = index.numel(), self.group
        group = old_group if group is None else group
        if group < 1 or n_new % group:
            raise ValueError(f"reorder: {n_new} rows is not a multiple of group={group}")
        self.group = group
        if n_new // group != self.cross_k[0].size(0):
            sentences = index.view(-1, group)[:, 0] // old_group
            self.cross_k = [t.index_select(0, sentences) for t in self.cross_k]
            self.cross_v = [t.index_select(0, sentences) for t in self.cross_v]
            if self.cross_mask is not None:
                self.cross_mask = self.cross_mask.index_select(0, sentences)
        old = self.self_k + self.self_v
        shape = (old[0].size(0), n_new) + tuple(old[0].shape[2:])
        size = math.prod(shape)
        if not self._spare or self._spare[0].numel() < size:
            self._spare = self._allocate(len(old), size, old[0])
        new = [flat[:size].view(shape) for flat in self._spare]
        with torch.no_grad():  # the cache serves inference; no gradient flows through a reorder
            for src, dst in zip(old, new, strict=True):
                torch.index_select(src[: self.length], 1, index, out=dst[: self.length])
        self._spare, self._storage = self._storage, self._spare
        self._keys = self._keys[::-1]
        half = len(new) // 2
        self.self_k, self.self_v = new[:half], new[half:]


# ----------------------------------------------------------------------------------------------
# The model


class Transformer(nn.Module):
    """The encoder-decoder Transformer (section 3, figure 1) with a pre-softmax projection.

    ``logits = Decoder(tgt_in, Encoder(src)) W_E^T`` where ``W_E`` is the joint embedding when
    ``cfg.tie_embeddings`` (section 3.4), else a separate output projection; source and target
    embeddings are then separate too. ``pad_id`` marks padding in ``src`` and ``tgt_in``.

    Output vocabulary. ``output_ids`` (sorted ids into the joint vocabulary, ``pad_id`` and the
    other specials among them; ``model.output_vocab: target``) restricts the softmax to the pieces
    the training targets use: a joint vocabulary also holds source-only pieces the decoder never
    has to produce. Training computes ``hidden W_E[output_ids]^T`` only (``forward(...,
    shortlist=True)`` with :meth:`output_targets`), so the largest product of the step shrinks by
    the source-only share and the label-smoothing mass stays on producible pieces. Search does
    the same (``decode(..., shortlist=True)``) and maps positions back to ids; the other paths
    return full-vocabulary logits with ``-inf`` off the list, the same distribution. Without
    ``output_ids`` (the default) the softmax covers the whole joint vocabulary. ``output_ids``
    is a buffer, saved in checkpoints.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, pad_id: int = 0,
                 output_ids: Tensor | Sequence[int] | None = None) -> None:
        super().__init__()
        self.cfg, self.vocab_size, self.pad_id = cfg, vocab_size, pad_id
        # buffers (None: no output vocabulary, not saved): the list, and joint id -> position in
        # the list (unk's for an id off the list)
        self.output_ids: Tensor | None
        self.output_index: Tensor | None
        for name in ("output_ids", "output_index"):
            self.register_buffer(name, None)
        if output_ids is not None:
            self._set_output_vocabulary(torch.as_tensor(output_ids, dtype=torch.long))
        self.positions = PositionalEncoding(cfg.d_model, cfg.max_positions)
        src_embed = Embeddings(vocab_size, cfg.d_model, pad_id)
        tgt_embed = src_embed if cfg.tie_embeddings else Embeddings(vocab_size, cfg.d_model, pad_id)
        self.encoder = Encoder(cfg, src_embed, self.positions)
        self.decoder = Decoder(cfg, tgt_embed, self.positions)
        self.output_projection = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, vocab_size, bias=False)
        )
        # set by mtcli.quantize.quantize_for_decoding: an int8 stand-in for ``hidden W^T``
        self.int8_output: nn.Module | None = None
        self._init_projections()

    def _init_projections(self) -> None:
        """Xavier-uniform for every projection (each of W^Q, W^K, W^V separately), zero biases."""
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                blocks = module.weight.size(0) // self.cfg.d_model if "attn" in name else 1
                for block in module.weight.chunk(max(blocks, 1), dim=0):
                    nn.init.xavier_uniform_(block)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if self.output_projection is not None:
            nn.init.normal_(self.output_projection.weight, mean=0.0, std=self.cfg.d_model**-0.5)

    def _set_output_vocabulary(self, ids: Tensor) -> None:
        """Register ``ids`` as the output vocabulary (see the class docstring)."""
        ids = ids.reshape(-1)
        specials = torch.tensor(sorted((PAD_ID, UNK_ID, BOS_ID, EOS_ID)))  # 0-3: their own positions
        if ids.numel() <= len(specials) or not torch.equal(ids[: len(specials)].cpu(), specials) \
                or bool((ids[1:] <= ids[:-1]).any()) or int(ids[-1]) >= self.vocab_size:
            raise ValueError(f"output_ids must be sorted, distinct ids below {self.vocab_size} that "
                             f"start with the special ids 0-{int(specials[-1])} and list a piece")
        self.register_buffer("output_ids", ids)
        index = torch.full((self.vocab_size,), UNK_ID, dtype=torch.long)  # unk's position is its id
        index[ids] = torch.arange(ids.numel())
        self.register_buffer("output_index", index, persistent=False)

    @property
    def max_positions(self) -> int:
        """Longest sequence (``<s>`` or ``</s>`` included) the positional table covers."""
        return self.cfg.max_positions

    @property
    def output_size(self) -> int:
        """Width of :meth:`project_shortlist`'s logits: the output vocabulary's size, else ``vocab``."""
        return self.vocab_size if self.output_ids is None else self.output_ids.numel()

    def output_weight(self) -> Tensor:
        """The pre-softmax weight ``W [vocab, d_model]``: the tied embedding or the projection's."""
        if self.output_projection is None:
            return self.decoder.embed.weight
        return self.output_projection.weight

    def project_shortlist(self, hidden: Tensor) -> Tensor:
        """Logits over the output vocabulary only, ``hidden W[output_ids]^T`` -> ``[..., V_out]``
        (the full ``[..., vocab]`` without one). Position ``i`` is id ``output_ids[i]``; the
        special ids are their own positions. Index them with :meth:`output_targets`."""
        if self.int8_output is not None:  # built over the output vocabulary's rows
            return self.int8_output(hidden)
        weight = self.output_weight()
        if self.output_ids is not None:
            weight = weight.index_select(0, self.output_ids)
        return F.linear(hidden, weight)

    def project(self, hidden: Tensor) -> Tensor:
        """Pre-softmax linear transformation ``hidden W^T`` -> logits ``[..., vocab]``
        (``-inf`` outside the output vocabulary, when there is one)."""
        logits = self.project_shortlist(hidden)
        return logits if self.output_ids is None else self.widen(logits)

    def widen(self, logits: Tensor) -> Tensor:
        """Output-vocabulary logits ``[..., V_out]`` -> joint-vocabulary ``[..., vocab]``, -inf off it."""
        if self.output_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy(logits.dim() - 1, self.output_ids, logits)

    def output_targets(self, target: Tensor) -> Tensor:
        """Joint-vocabulary ids -> their positions among the logits of :meth:`project_shortlist`.

        Pad stays pad (the special ids are their own positions). An id outside the output
        vocabulary (a held-out piece the training targets never used) becomes unk's position."""
        if self.output_index is None:
            return target
        return self.output_index[target]

    def encode(self, src: Tensor) -> EncoderOutput:
        """``src [B, S]`` (ids + eos, right-padded with ``pad_id``) -> :class:`EncoderOutput`."""
        src_pad_mask = src.eq(self.pad_id)
        attn_mask = padding_attn_mask(src_pad_mask)
        return EncoderOutput(self.encoder(src, attn_mask), src_pad_mask, attn_mask)

    def decode(self, tgt_in: Tensor, enc: EncoderOutput, cache: DecoderCache | None = None,
               shortlist: bool = False) -> Tensor:
        """Logits ``[B, T, vocab]`` for ``tgt_in [B, T]`` (bos + ids, right-padded).

        Without a cache the whole target is processed at once (causal self-attention). With a
        ``cache`` (from :meth:`init_cache`) ``tgt_in`` is the newest token ``[rows, 1]``, the
        result is ``[rows, 1, vocab]`` for that position and the cache advances one step; the
        encoder side then comes from the cache (``enc`` is not read). ``shortlist=True``: logits
        over the output vocabulary, ``[..., V_out]`` (:meth:`project_shortlist`; what search
        uses). When the cache was made with a :class:`Workspace` (and no autocast is on) the
        shortlist logits are a view of its ``"logits"`` buffer, overwritten by the next step:
        copy them to keep them.
        """
        if cache is None:
            hidden, _ = self.decoder(tgt_in, enc)
        else:
            if tgt_in.shape != (cache.rows, 1):
                raise ValueError(f"decode with a cache takes [{cache.rows}, 1] tokens, got {list(tgt_in.shape)}")
            if cache.length >= cache.max_len:
                raise ValueError(f"decoder cache is full ({cache.max_len} positions)")
            hidden = self.decoder.step(tgt_in, cache)
        if cache is None or torch.is_grad_enabled() or self.int8_output is not None:
            logits = self.project_shortlist(hidden)
        else:
            logits = self._cached_projection(hidden, cache)
        return logits if shortlist else self.widen(logits)

    def _cached_projection(self, hidden: Tensor, cache: DecoderCache) -> Tensor:
        """:meth:`project_shortlist` of one step ``[rows, 1, d]`` with the transposed weight
        kept in the cache and the result in its workspace (a plain ``mm`` is faster on a CPU)."""
        if cache.output_t is None:
            weight = self.output_weight()
            if self.output_ids is not None:
                weight = weight.index_select(0, self.output_ids)
            cache.output_t = weight.t().contiguous()
        hidden = hidden.view(-1, hidden.size(-1))
        if cache.workspace is None or torch.is_autocast_enabled(hidden.device.type):
            return torch.mm(hidden, cache.output_t).unsqueeze(1)
        out = cache.workspace.get(
            "logits", (hidden.size(0), cache.output_t.size(1)), hidden.dtype, hidden.device
        )
        return torch.mm(hidden, cache.output_t, out=out).unsqueeze(1)

    def forward(self, src: Tensor, tgt_in: Tensor, shortlist: bool = False) -> Tensor:
        """Teacher-forced logits ``[B, T, vocab]`` for ``src [B, S]`` and ``tgt_in [B, T]``.

        ``shortlist=True`` (training): logits over the output vocabulary only, ``[B, T, V_out]``,
        see :meth:`project_shortlist`; the same as the default without an output vocabulary."""
        return self.decode(tgt_in, self.encode(src), shortlist=shortlist)

    def init_cache(
        self, enc: EncoderOutput, beam_size: int = 1, max_len: int | None = None,
        workspace: Workspace | None = None,
    ) -> DecoderCache:
        """An empty :class:`DecoderCache` for ``enc`` (one row per sentence) times ``beam_size``.

        Computes each layer's encoder keys/values once. ``max_len`` (default
        ``cfg.max_positions``) is the longest target, bos included, the cache will hold.
        ``workspace``: take the cache's buffers (and the logits of :meth:`decode`) from it.
        """
        max_len = min(max_len or self.cfg.max_positions, self.cfg.max_positions)
        rows = enc.memory.size(0) * beam_size
        h, d_k = self.cfg.n_heads, self.cfg.d_model // self.cfg.n_heads
        dtype = enc.memory.dtype
        if torch.is_autocast_enabled(enc.memory.device.type):
            dtype = torch.get_autocast_dtype(enc.memory.device.type)
        # contiguous [B, h, S, d_k]: the per-step attention then never copies the encoder side
        cross = [
            tuple(t.contiguous() for t in layer.cross_attn.project_kv(enc.memory))
            for layer in self.decoder.layers
        ]
        shape = (max_len, rows, h, d_k)
        count = 2 * len(self.decoder.layers)
        if workspace is None:
            empty = [torch.empty(shape, dtype=dtype, device=enc.memory.device) for _ in range(count)]
        else:
            flat = workspace.get("cache_a", (count, math.prod(shape)), dtype, enc.memory.device)
            empty = [t.view(shape) for t in flat.unbind(0)]
        half = len(empty) // 2
        mask = enc.attn_mask if enc.attn_mask is not None else padding_attn_mask(enc.src_pad_mask)
        return DecoderCache(
            empty[:half], empty[half:], [k for k, _ in cross], [v for _, v in cross], mask,
            beam_size, workspace,
        )

    def cross_attention_weights(self, tgt_in: Tensor, enc: EncoderOutput) -> Tensor:
        """Head-averaged encoder-decoder attention of every layer, ``[B, layers, T, S]``.

        Teacher-forced over ``tgt_in [B, T]`` with the weights computed explicitly (slow path;
        used for attention plots and ``Hypothesis.attention``, never during search).
        """
        _, weights = self.decoder(tgt_in, enc, need_weights=True)
        return torch.stack(weights, dim=1)


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of (trainable) parameters; a tied embedding is counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
