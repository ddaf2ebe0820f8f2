"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017): the whole model.

Its parts are named after the paper, each with the equation it computes in its docstring:
:mod:`mtcli.model.attention` (equation 1 and multi-head attention), :mod:`mtcli.model.layers`
(embeddings, positions, the feed-forward network, residual connections, the layers and stacks)
and :mod:`mtcli.model.incremental` (the decoding state).

Beyond the paper, as in common practice: an optional pre-norm arrangement (``cfg.pre_norm``,
``x + Dropout(Sublayer(LayerNorm(x)))`` with a final LayerNorm on each stack), one joint
embedding shared by source, target and the pre-softmax projection (section 3.4, "we share the
same weight matrix between the two embedding layers and the pre-softmax linear
transformation"), dropout on the attention weights and after the ReLU, Xavier-uniform
initialisation of every projection and N(0, d_model^-0.5) embeddings.

Masks: ``src_pad_mask`` is boolean ``[B, S]``, True at padding (ARCHITECTURE.md).

Output vocabulary (``model.output_vocab: target``): the decoder's softmax may cover only the
pieces the training targets use (:attr:`Transformer.output_ids`). Every method that returns
logits returns them over that output vocabulary, ``[..., output_size]``; :meth:`Transformer.widen`
maps them to the joint vocabulary (-inf off the list) and :meth:`Transformer.output_targets` maps
joint ids to positions. Without an output vocabulary both are the identity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from copy import deepcopy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcli.config import ModelConfig
from mtcli.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from mtcli.model.attention import packed_attn_masks, packed_block_masks, padding_attn_mask
from mtcli.model.incremental import DecoderCache, EncoderOutput, Workspace
from mtcli.model.layers import (
    Decoder,
    Embeddings,
    Encoder,
    PositionalEncoding,
    PositionwiseFeedForward,
)

#: Makes a decoding-time product ``x W^T + b`` from ``(W, b)``, or ``max(0, x W^T + b)`` when
#: called with ``relu=True`` (see :meth:`Transformer.for_decoding`).
ProductMaker = Callable[..., nn.Module]


class Transformer(nn.Module):
    """The encoder-decoder Transformer (section 3, figure 1) with a pre-softmax projection.

    ``logits = Decoder(tgt_in, Encoder(src)) W_E^T`` where ``W_E`` is the joint embedding when
    ``cfg.tie_embeddings`` (section 3.4), else a separate output projection; source and target
    embeddings are then separate too. ``pad_id`` marks padding in ``src`` and ``tgt_in``.

    Output vocabulary. ``output_ids`` (sorted ids into the joint vocabulary, ``pad_id`` and the
    other specials among them; ``model.output_vocab: target``) restricts the softmax to the pieces
    the training targets use: a joint vocabulary also holds source-only pieces the decoder never
    has to produce. Every logits-returning method computes ``hidden W_E[output_ids]^T`` only,
    ``[..., output_size]`` (training indexes them with :meth:`output_targets`, search maps
    positions back to ids), so the largest product of the step shrinks by the source-only share
    and the label-smoothing mass stays on producible pieces; :meth:`widen` gives the same
    distribution over the joint vocabulary (-inf off the list). Without ``output_ids`` (the
    default) the softmax covers the whole joint vocabulary. ``output_ids`` is a buffer, saved in
    checkpoints.

    Output bias (``model.output_bias``, a model imported from Marian by ``mtcli import-hf``): the
    logits are ``hidden W^T + b`` with ``b`` the buffer :attr:`output_bias` (``[vocab]``, saved in
    checkpoints, not trained, like Marian's ``final_logits_bias``). Without it (the default) there
    is no bias and no such buffer.
    """

    #: Keep packed rows apart with FlexAttention block masks (:func:`packed_block_masks`) instead
    #: of mask tensors: timed on a GPU by bench/bench_train.py's ``-flex`` variant before it is
    #: chosen for anyone (FlexAttention has no attention dropout, and no backward on a CPU).
    flex_packed = False

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
        # a fixed bias on the logits [vocab] (model.output_bias: Marian's final_logits_bias,
        # not trained); None (and absent from the state dict) by default
        self.output_bias: Tensor | None
        self.register_buffer("output_bias", torch.zeros(vocab_size) if cfg.output_bias else None)
        # a decoding-time stand-in for ``hidden W^T`` over the output vocabulary: int8
        # (mtcli.infer.quantize) or oneDNN-packed fp32/bf16 (mtcli.infer.packed); see for_decoding
        self.output_product: nn.Module | None = None
        self._decoding_output: tuple[Tensor, Tensor | None, ProductMaker] | None = None
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
        """Width of the logits: the output vocabulary's size, else ``vocab``."""
        return self.vocab_size if self.output_ids is None else self.output_ids.numel()

    def output_weight(self) -> Tensor:
        """The pre-softmax weight ``W [vocab, d_model]``: the tied embedding or the projection's."""
        if self.output_projection is None:
            return self.decoder.embed.weight
        return self.output_projection.weight

    def project(self, hidden: Tensor) -> Tensor:
        """The pre-softmax linear transformation over the output vocabulary,
        ``hidden W[output_ids]^T`` -> ``[..., output_size]`` (``hidden W^T`` without one). Position
        ``i`` is id ``output_ids[i]``; the special ids are their own positions."""
        if self.output_product is not None:  # built over the output vocabulary's rows
            return self.output_product(hidden)
        return F.linear(hidden, self.output_rows_weight(), self.output_rows_bias())

    def output_rows_weight(self) -> Tensor:
        """The pre-softmax weight over the output vocabulary, ``W[output_ids] [output_size,
        d_model]`` (``W`` itself without one)."""
        weight = self.output_weight()
        return weight if self.output_ids is None else weight.index_select(0, self.output_ids)

    def output_rows_bias(self) -> Tensor | None:
        """The logits' bias over the output vocabulary (``model.output_bias``), or None."""
        bias = self.output_bias
        if bias is None or self.output_ids is None:
            return bias
        return bias.index_select(0, self.output_ids)

    def for_decoding(self, make: ProductMaker) -> Transformer:
        """A copy in eval mode for decoding in another precision or layout: every ``nn.Linear``
        becomes ``make(weight, bias)``, a feed-forward network's first one
        ``make(weight, bias, relu=True)`` (its ReLU fused into the product; a swish network's
        stays a plain ``make(weight, bias)`` followed by the swish) and its second
        ``make(weight, bias, nonnegative=True)`` (its input is that ReLU's), and the output product
        ``make(W[output_ids], b[output_ids])`` (``b`` the output bias, None without one; a tied
        ``W`` is also the embedding table, which
        stays as it is for the lookups). The copy serves inference only; :meth:`output_rows`
        makes its products over a subset the same way."""
        copy = deepcopy(self).eval()
        output = copy.output_rows_weight().detach()
        bias = copy.output_rows_bias()
        for parent in list(copy.modules()):
            if isinstance(parent, PositionwiseFeedForward) and parent.activation == "relu":
                parent.w_1 = make(parent.w_1.weight, parent.w_1.bias, relu=True)
                parent.w_2 = make(parent.w_2.weight, parent.w_2.bias, nonnegative=True)  # it reads w_1's ReLU
                parent.relu_in_w_1 = True
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, make(child.weight, child.bias))
        copy.output_product = make(output, bias)
        copy._decoding_output = (output, bias, make)
        return copy

    def output_rows(self, positions: Tensor) -> Callable[[Tensor], Tensor]:
        """``hidden -> hidden W[output_ids][positions]^T``: the output product over some of the
        output vocabulary's positions (a shortlist), in this model's precision (see
        :meth:`for_decoding`)."""
        bias = self.output_rows_bias()
        bias = None if bias is None else bias.index_select(0, positions)
        if self._decoding_output is None:
            weight = self.output_rows_weight().detach().index_select(0, positions)
            return lambda hidden: F.linear(hidden, weight, bias)
        output, _, make = self._decoding_output
        return make(output.index_select(0, positions), bias)

    def widen(self, logits: Tensor) -> Tensor:
        """Output-vocabulary logits ``[..., V_out]`` -> joint-vocabulary ``[..., vocab]``, -inf off it."""
        if self.output_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy(logits.dim() - 1, self.output_ids, logits)

    def output_targets(self, target: Tensor) -> Tensor:
        """Joint-vocabulary ids -> their positions among the logits (:meth:`project`).

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

    def decode(self, tgt_in: Tensor, enc: EncoderOutput, cache: DecoderCache | None = None) -> Tensor:
        """Logits ``[B, T, output_size]`` for ``tgt_in [B, T]`` (bos + ids, right-padded).

        Without a cache the whole target is processed at once (causal self-attention). With a
        ``cache`` (from :meth:`init_cache`) ``tgt_in`` is the newest token ``[rows, 1]``, the
        result is ``[rows, 1, output_size]`` for that position and the cache advances one step;
        the encoder side then comes from the cache (``enc`` is not read), and the cache's
        ``output_product``, when set, gives the logits (a shortlist's columns). When the cache was made
        with a :class:`Workspace` (and no autocast is on) the logits are a view of its
        ``"logits"`` buffer, overwritten by the next step: copy them to keep them.
        """
        if cache is None:
            hidden, _ = self.decoder(tgt_in, enc)
        else:
            if tgt_in.shape != (cache.rows, 1):
                raise ValueError(f"decode with a cache takes [{cache.rows}, 1] tokens, got {list(tgt_in.shape)}")
            if cache.length >= cache.max_len:
                raise ValueError(f"decoder cache is full ({cache.max_len} positions)")
            hidden = self.decoder.step(tgt_in, cache)
            if cache.output_product is not None:
                return cache.output_product(hidden)
        if cache is None or torch.is_grad_enabled() or self.output_product is not None:
            return self.project(hidden)
        return self._cached_projection(hidden, cache)

    def _cached_projection(self, hidden: Tensor, cache: DecoderCache) -> Tensor:
        """:meth:`project` of one step ``[rows, 1, d]`` with the transposed weight
        kept in the cache and the result in its workspace (a plain ``mm`` is faster on a CPU)."""
        if cache.output_t is None:
            cache.output_t = self.output_rows_weight().t().contiguous()
        hidden = hidden.view(-1, hidden.size(-1))
        bias = self.output_rows_bias()
        if cache.workspace is None or torch.is_autocast_enabled(hidden.device.type):
            if bias is not None:
                return torch.addmm(bias, hidden, cache.output_t).unsqueeze(1)
            return torch.mm(hidden, cache.output_t).unsqueeze(1)
        out = cache.workspace.get(
            "logits", (hidden.size(0), cache.output_t.size(1)), hidden.dtype, hidden.device
        )
        if bias is not None:
            return torch.addmm(bias, hidden, cache.output_t, out=out).unsqueeze(1)
        return torch.mm(hidden, cache.output_t, out=out).unsqueeze(1)

    def forward(self, src: Tensor, tgt_in: Tensor, *layout: Tensor) -> Tensor:
        """Teacher-forced logits ``[B, T, output_size]`` for ``src [B, S]`` and ``tgt_in [B, T]``
        (widen them with :meth:`widen` for the joint vocabulary); with a packed batch's
        ``layout`` (its segments and positions), :meth:`forward_packed`."""
        if layout:
            return self.forward_packed(src, tgt_in, *layout)
        return self.decode(tgt_in, self.encode(src))

    def forward_packed(self, src: Tensor, tgt_in: Tensor, src_segments: Tensor, tgt_segments: Tensor,
                       src_positions: Tensor, tgt_positions: Tensor) -> Tensor:
        """Teacher-forced logits ``[B, T, output_size]`` of packed rows (:mod:`mtcli.data.packing`):
        several pairs per row, kept apart by :func:`~mtcli.model.attention.packed_attn_masks`, each
        sentence's positions starting at 0. Every real slot gets what :meth:`forward` gives its
        pair alone."""
        masks = packed_block_masks if self.flex_packed else packed_attn_masks
        encoder_mask, decoder_mask, cross_mask = masks(src_segments, tgt_segments)
        memory = self.encoder(src, encoder_mask, positions=src_positions)
        enc = EncoderOutput(memory, src.eq(self.pad_id), cross_mask)
        hidden, _ = self.decoder(tgt_in, enc, positions=tgt_positions, self_mask=decoder_mask)
        return self.project(hidden)

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
