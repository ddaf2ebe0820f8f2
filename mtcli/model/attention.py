"""Attention (sections 3.2.1-3.2.2) and the dropout every sublayer uses (section 5.4).

Attention runs through ``torch.nn.functional.scaled_dot_product_attention`` (SDPA);
self-attention uses one fused ``[W^Q; W^K; W^V]`` projection and cross-attention one fused
``[W^K; W^V]`` projection of the encoder output; the decoder's causal mask is SDPA's
``is_causal`` (targets are right-padded, so no real position ever sees a pad key). SDPA has no
fused attention dropout on a CPU (with ``dropout_p > 0`` it runs its own unfused math), so
training with attention dropout on a CPU computes the same math explicitly
(:func:`reference_attention`) with the faster :func:`dropout`. 16-bit attention on CUDA avoids
SDPA's cuDNN kernel (:func:`sdpa_backends`), whose per-shape graph builds made bf16 training
3-15x slower than fp32 with length-varying batches.

Masks: attention takes an additive float mask ``[B, 1, 1, S]`` (0 where a key may be attended,
-inf at padding), or a boolean one (True where a key may be attended), exactly as SDPA does.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

#: SDPA kernels for 16-bit attention on CUDA: everything but cuDNN's, which builds (and caches) a
#: graph per new shape, ~25 ms of host time each on an H100; batches of varying lengths and every
#: decoding step are new shapes (docs/performance.md: bf16 training at the base shape went from 0.35x
#: to 2.3x fp32).
NO_CUDNN_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device_type: str, dtype: torch.dtype) -> list[SDPBackend] | None:
    """The SDPA backends to allow for queries on ``device_type`` in ``dtype`` (None: PyTorch's choice)."""
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return NO_CUDNN_BACKENDS
    return None



def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Dropout (section 5.4): zero each unit with probability ``p``, scale the rest by ``1/(1-p)``.

    Returns ``x`` itself (no op at all) when not training or ``p == 0``. On a CPU the keep mask
    is drawn from 16-bit slices of 64-bit random integers (``p`` rounded to a multiple of
    1/65536): about 4x faster than ``F.dropout``, whose per-element Bernoulli sampling costs more
    than the rest of a dropout by far. It uses torch's default generator, so seeding and RNG
    state checkpoints work as usual. Other devices, and ``torch.compile``, use ``F.dropout``
    (fused there).
    """
    if p <= 0.0 or not training:
        return x
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return F.dropout(x, p, True)
    n = x.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), 2**63 - 1)
    uniform16 = bits.view(torch.int16)[:n].view(x.shape)  # uniform over [-32768, 32767]
    keep = uniform16 >= round(p * 65536) - 32768
    return x * keep.to(x.dtype).mul_(1.0 / (1.0 - p))


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

    0 where a key is a real token, -inf at padding; on a CPU, None when there is no padding at
    all (so SDPA runs without a mask). On a GPU, and under ``torch.compile``, the mask is always
    built: asking whether there is padding would wait for the device (a host sync per batch) or
    break the compiled graph, and a mask of zeros costs next to nothing there.
    """
    if not (src_pad_mask.is_cuda or torch.compiler.is_compiling()) and not bool(src_pad_mask.any()):
        return None
    mask = torch.zeros(src_pad_mask.shape, dtype=dtype, device=src_pad_mask.device)
    return mask.masked_fill_(src_pad_mask, float("-inf"))[:, None, None, :]


def packed_attn_masks(src_segments: Tensor, tgt_segments: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Boolean masks (True: may attend) that keep the sentence pairs of packed rows apart
    (:mod:`mtcli.data.packing`): ``(encoder self-attention [B, 1, S, S], decoder self-attention
    [B, 1, T, T], encoder-decoder attention [B, 1, T, S])`` from the segments ``[B, S]`` and
    ``[B, T]`` (1, 2, ... per pair within a row, 0 at padding).

    A query attends to the keys of its own segment only, the decoder's causally (keys ``<= t``).
    Padding is a segment of its own, so every query has a key: a padding query attends to the
    padding of its row, and in encoder-decoder attention (where a full source row has none) to
    the row's first key. Padding's outputs are never scored; this only keeps them finite.
    """
    src_q, src_k = src_segments[:, None, :, None], src_segments[:, None, None, :]
    tgt_q, tgt_k = tgt_segments[:, None, :, None], tgt_segments[:, None, None, :]
    t, s = tgt_segments.size(1), src_segments.size(1)
    causal = torch.ones(t, t, dtype=torch.bool, device=tgt_segments.device).tril()
    first_key = torch.arange(s, device=src_segments.device) == 0
    cross = (tgt_q == src_k) | ((tgt_q == 0) & first_key)
    return src_q == src_k, (tgt_q == tgt_k) & causal, cross


def packed_block_masks(src_segments: Tensor, tgt_segments: Tensor) -> tuple[BlockMask, BlockMask, BlockMask]:
    """:func:`packed_attn_masks` as FlexAttention block masks: the same rule, evaluated inside
    the attention kernel instead of read from a ``[B, 1, L, L]`` tensor (attention dropout is not
    available with them)."""
    b, s, t = src_segments.size(0), src_segments.size(1), tgt_segments.size(1)

    def encoder(row: Tensor, head: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return src_segments[row, q] == src_segments[row, k]

    def decoder(row: Tensor, head: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return (tgt_segments[row, q] == tgt_segments[row, k]) & (q >= k)

    def cross(row: Tensor, head: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return (tgt_segments[row, q] == src_segments[row, k]) | ((tgt_segments[row, q] == 0) & (k == 0))

    device = src_segments.device
    return (create_block_mask(encoder, b, None, s, s, device=device),
            create_block_mask(decoder, b, None, t, t, device=device),
            create_block_mask(cross, b, None, t, s, device=device))


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
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | BlockMask | None, is_causal: bool = False
    ) -> Tensor:
        """SDPA (or FlexAttention, given a block mask) over heads, then ``Concat(heads) W^O``:
        ``[B, h, T, d_k]`` -> ``[B, T, d_model]``."""
        dropout_p = self.dropout if self.training else 0.0
        if isinstance(mask, BlockMask):
            if dropout_p > 0.0:
                raise ValueError("attention dropout needs the packed rows' mask tensors, not block masks")
            out = flex_attention(q, k, v, block_mask=mask)
        elif dropout_p > 0.0 and q.device.type == "cpu":
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
        d_model]``. On a CPU the explicit ``softmax(Q K^T / sqrt(d_k) + M) V`` with two batched
        matmuls is cheaper than SDPA for the few queries per sentence.
        """
        n, g, _ = x.shape
        q = self.q_proj(x)
        q = q.view(n, g, self.n_heads, self.d_k).transpose(1, 2)  # [n, h, g, d_k]
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
        qkv = self.qkv_proj(x)
        qkv = qkv.view(n, 3, self.n_heads, self.d_k)
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
