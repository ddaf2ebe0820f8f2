"""Fused CPU kernels for decoding: the whole fp32 encoder and decoder step, a step's attention,
the search's statistics of the logits and its cache reorder, in one call each.

A decoding step at a few rows is mostly small operations: on a CPU each torch call costs
microseconds whatever its size, and at bf16 the attention's batched matrix products are far
slower than their arithmetic. ``kernels.c`` does a step's self-attention (writing the new key
and value into the cache) and its encoder-decoder attention in one call each, fp32 arithmetic
on fp32 or bf16 tensors, and gives the search each row's chunk maxima and ``log Z`` in two
reads of the logits (:func:`mtcli.infer.search.step_scores`). Exponentials use a polynomial
the compiler vectorizes (relative error about 1e-7, as ``expf``).

For an fp32 decoding copy the whole decoder step is one call, :func:`decoder_step`, with
products of its own over weights laid out once per copy (:class:`Plan`): each product's
weight in panels of :data:`PANEL` outputs, read sequentially, with 8 rows' sums for a panel
held in registers. It is faster than the same step as torch operations at every batch size
measured (1 to 320 rows, bench/NOTES.md): between torch operations oneDNN's products at a few
rows take about twice their time back to back, and the step's hundred-odd torch calls cost
microseconds each whatever their size. The encoder runs the same way (:func:`encoder_layers`),
and :func:`move_rows` does a search's cache reorder for every buffer in one call.

The C file is compiled on first use for this CPU (:mod:`mtcli.native`). Without a
compiler, or when compiling fails, or with ``MTCLI_KERNELS=0``, :func:`available` is False and
decoding runs the same steps as torch operations (a one-time warning says why).

The functions take CPU tensors laid out as :class:`~mtcli.model.incremental.DecoderCache`
keeps them; callers check :func:`usable` first.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from mtcli.native import build, load

SOURCE = Path(__file__).with_name("kernels.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "self_attention_step": [_P, _P, _P, _L, _I, _I, _I, _I, _I, _F, _P, _I],
    "cross_attention_step": [_P, _P, _P, _L, _I, _P, _I, _I, _I, _I, _I, _F, _P, _I],
    "score_statistics": [_P, _I, _I, _I, _P, _P, _I],
    "decoder_step": [_P, _I, _I, _I, _I, _I, _I, _F, _P, _I, _P, _P, _L, _I, _P, _P, _L, _I, _P, _I, _P, _P, _I],
    "encoder_layers": [_P, _I, _I, _I, _I, _I, _F, _P, _I, _I, _P, _P, _I],
    "move_rows": [_P, _I, _I, _L, _L, _P, _P, _I, _P, _I],
}


class _Buffers(Protocol):
    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor: ...


class StepCache(Protocol):
    """What :func:`decoder_step` reads and writes of a
    :class:`~mtcli.model.incremental.DecoderCache` (named by its shape, since ``incremental``
    calls this module to move its rows)."""

    self_k: list[Tensor]
    self_v: list[Tensor]
    cross_k: list[Tensor]
    cross_v: list[Tensor]
    cross_mask: Tensor | None
    length: int
    group: int
    output_product: Callable[[Tensor], Tensor] | None
    workspace: _Buffers | None


def _build() -> tuple[ctypes.CDLL, bool]:
    """The compiled library and whether its OpenMP loops may use torch's threads
    (:func:`mtcli.native.build`: it shares the ``libgomp`` torch loaded, or runs on one thread)."""
    return build(SOURCE, _signatures(), openmp=True)


def _signatures() -> dict[str, tuple[None, list[type]]]:
    return {name: (None, args) for name, args in _SIGNATURES.items()}


@functools.cache
def _library() -> tuple[ctypes.CDLL, bool] | None:
    return load(SOURCE, _signatures(), True, "fused decoding kernels", "decoding uses torch operations")


def _kernel(name: str) -> Callable[..., None]:
    return getattr(_library()[0], name)


def _threads() -> int:
    """Threads the kernels may use: torch's, where they share its OpenMP runtime."""
    return torch.get_num_threads() if _library()[1] else 1


def available() -> bool:
    """Whether the kernels are compiled and loaded (compiles them on the first call)."""
    return _library() is not None


def usable(*tensors: Tensor) -> bool:
    """Whether the kernels can take ``tensors``: available, on the CPU, fp32 or bf16 all alike,
    and no gradient recorded."""
    dtype = tensors[0].dtype
    return (
        not torch.is_grad_enabled()
        and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
        and dtype in _DTYPES
        and available()
    )


def _rows_contiguous(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are alike: each entry of the first axis contiguous, one stride
    between entries (which the kernels take as a number)."""
    return a.shape == b.shape and a.stride(0) == b.stride(0) and a[0].is_contiguous() and b[0].is_contiguous()


def self_attention_step(qkv: Tensor, cache_k: Tensor, cache_v: Tensor, length: int) -> Tensor:
    """Causal self-attention of the newest position, with the key/value cache (eq. 1).

    ``qkv [N, 3 * d_model]`` (contiguous) holds each row's query, key and value; the key and
    value are written at time ``length`` of ``cache_k``/``cache_v`` ``[max_len, N, h, d_k]``
    (rows contiguous within a time step), and the result ``[N, d_model]`` is
    ``softmax(q K^T / sqrt(d_k)) V`` over times ``0..length``, per head.
    """
    _, n, h, d_k = cache_k.shape
    if not (qkv.is_contiguous() and _rows_contiguous(cache_k, cache_v)):
        raise ValueError("self_attention_step: qkv must be contiguous and the caches rows-contiguous")
    out = torch.empty(n, h * d_k, dtype=qkv.dtype)
    _kernel("self_attention_step")(
        qkv.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), cache_k.stride(0), length, n, h, d_k,
        _DTYPES[qkv.dtype], d_k**-0.5, out.data_ptr(), _threads(),
    )
    return out


def cross_attention_step(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Encoder-decoder attention of one step, ``group`` queries per sentence (eq. 1).

    ``q [sentences, group, d_model]`` (contiguous), ``k``/``v [sentences, h, S, d_k]``
    (contiguous within a sentence), ``mask`` additive fp32 ``[sentences, 1, 1, S]`` or None.
    Returns ``[sentences * group, d_model]``.
    """
    sentences, h, s, d_k = k.shape
    group = q.size(1)
    if not (q.is_contiguous() and _rows_contiguous(k, v)
            and (mask is None or (mask.is_contiguous() and mask.dtype == torch.float32))):
        raise ValueError("cross_attention_step: q, mask and each sentence's keys/values must be contiguous")
    out = torch.empty(sentences * group, h * d_k, dtype=q.dtype)
    _kernel("cross_attention_step")(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), s,
        None if mask is None else mask.data_ptr(), sentences, group, h, d_k, _DTYPES[q.dtype],
        d_k**-0.5, out.data_ptr(), _threads(),
    )
    return out


def score_statistics(logits: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """``(chunk_max [R, chunks], lse [R])`` of fp32 ``logits [R, chunks * width]`` (contiguous):
    the maximum of every run of ``width`` columns, and ``logZ = log sum_v exp(logits[r, v])``
    (a row's maximum must be finite)."""
    rows, columns = logits.shape
    if not (logits.is_contiguous() and logits.dtype == torch.float32 and columns % width == 0):
        raise ValueError("score_statistics: contiguous fp32 logits, a whole number of chunks wide")
    chunk_max = torch.empty(rows, columns // width)
    lse = torch.empty(rows)
    _kernel("score_statistics")(
        logits.data_ptr(), rows, columns // width, width, chunk_max.data_ptr(), lse.data_ptr(), _threads()
    )
    return chunk_max, lse


#: Outputs per panel of a product's weight in a :class:`Plan` (``BLOCK`` in kernels.c).
PANEL = 32


def panels(wt: Tensor) -> Tensor:
    """``W^T [in, out]`` as :data:`PANEL`-wide panels ``[blocks, in, PANEL]``, the last one
    padded with zeros: each block of outputs' weights in one sequential run, as
    :func:`decoder_step`'s products read them."""
    d_in, d_out = wt.shape
    blocks = -(-d_out // PANEL)
    padded = wt.new_zeros(d_in, blocks * PANEL)
    padded[:, :d_out] = wt
    return padded.view(d_in, blocks, PANEL).transpose(0, 1).contiguous()


def _panelled(linear: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """``(panels of W^T, b)`` fp32 of a product, or None for one the step cannot read."""
    if isinstance(linear, nn.Linear):
        if linear.weight.dtype != torch.float32:
            return None
        return panels(linear.weight.detach().t()), linear.bias
    transposed = getattr(linear, "transposed", None)  # a decoding copy's packed product
    if transposed is None or getattr(linear, "dtype", None) != torch.float32:
        return None
    wt, bias = transposed()
    return panels(wt), bias


class Plan:
    """A model's encoder or decoder weights laid out for :func:`encoder_layers` or
    :func:`decoder_step`: each product's ``W^T`` as :func:`panels` (fp32), LayerNorms as they
    are, in the C function's order. Built once per decoding model (about the stack's size again
    in memory); :meth:`encoder` and :meth:`decoder` give None for a model the C code cannot run
    (another precision, int8 products, a LayerNorm without bias)."""

    def __init__(self, tensors: list[Tensor | None], layers: int, d: int, h: int, dff: int,
                 vout: int, pre_norm: bool, eps: float) -> None:
        self.tensors = [t.detach().float().contiguous() if t is not None else None for t in tensors]
        pointers = [0 if t is None else t.data_ptr() for t in self.tensors]
        self.pointers = (ctypes.c_void_p * len(pointers))(*pointers)
        self.layers, self.d, self.h, self.dff, self.vout = layers, d, h, dff, vout
        self.pre_norm, self.eps = pre_norm, eps

    @classmethod
    def _of(cls, stack: nn.Module, products: Callable[[nn.Module], list[nn.Module]],
            tail: list[Tensor | None], vout: int) -> Plan | None:
        """Each layer's products and its sublayers' LayerNorms (after the product of the
        sublayer they belong to: qkv, o, norm 0, ...), the final LayerNorm, then ``tail``."""
        tensors: list[Tensor | None] = []
        for layer in stack.layers:
            parts = [_panelled(p) for p in products(layer)]
            norms = [sub.norm for sub in layer.sublayer]
            if any(p is None for p in parts) or any(n.bias is None for n in norms):
                return None
            per_norm = len(parts) // len(norms)
            for i, norm in enumerate(norms):
                for weight, bias in parts[i * per_norm : (i + 1) * per_norm]:
                    tensors += [weight, bias]
                tensors += [norm.weight, norm.bias]
        final = stack.norm
        tensors += [None if final is None else final.weight, None if final is None else final.bias, *tail]
        first = stack.layers[0]
        return cls(tensors, len(stack.layers), first.self_attn.d_model, first.self_attn.n_heads,
                   first.feed_forward.w_2.in_features, vout, final is not None, first.sublayer[0].norm.eps)

    @classmethod
    def encoder(cls, model: nn.Module) -> Plan | None:
        """The encoder's plan of ``model`` (a :class:`~mtcli.model.Transformer` or its
        decoding copy)."""
        return cls._of(model.encoder, lambda layer: [
            layer.self_attn.qkv_proj, layer.self_attn.out_proj, layer.feed_forward.w_1, layer.feed_forward.w_2,
        ], [], 0)

    @classmethod
    def decoder(cls, model: nn.Module) -> Plan | None:
        """The decoder's plan of ``model``, the output product last."""
        decoding = getattr(model, "_decoding_output", None)
        output = decoding[0] if decoding is not None else model.output_rows_weight()
        return cls._of(model.decoder, lambda layer: [
            layer.self_attn.qkv_proj, layer.self_attn.out_proj, layer.cross_attn.q_proj,
            layer.cross_attn.out_proj, layer.feed_forward.w_1, layer.feed_forward.w_2,
        ], [panels(output.detach().t())], output.size(0))


def decoder_step_takes(cache: StepCache) -> bool:
    """Whether :func:`decoder_step` can run this step: fp32 caches laid out as
    :class:`~mtcli.model.incremental.DecoderCache` makes them, no
    autocast, no gradient, and the kernels available."""
    k, c = cache.self_k[0], cache.cross_k[0]
    selfs, crosses = cache.self_k + cache.self_v, cache.cross_k + cache.cross_v
    return (
        k.dtype == torch.float32 and not torch.is_autocast_enabled("cpu") and usable(k, c)
        and all(_rows_contiguous(k, t) for t in selfs)
        and all(_rows_contiguous(c, t) and t.dtype == k.dtype for t in crosses)
        and (cache.cross_mask is None or cache.cross_mask.is_contiguous())
    )


def decoder_step(plan: Plan, x: Tensor, cache: StepCache) -> Tensor:
    """One decoder step in one call: ``x [n, 1, d_model]`` (the newest tokens' embeddings plus
    positions, overwritten) through every layer, writing the caches at ``cache.length``, and the
    output product: logits ``[n, 1, output_size]``, fp32 throughout; the caller advances
    ``cache.length``. With the cache's :class:`~mtcli.model.incremental.Workspace` the logits
    are a view of its ``"logits"`` buffer (as :meth:`~mtcli.model.Transformer.decode` says).
    When the cache has its own ``output_product`` (a shortlist), the result is that product of
    the step's hidden states."""
    n = x.size(0)
    x = x.reshape(n, plan.d).contiguous()
    k0, c0 = cache.self_k[0], cache.cross_k[0]
    mask = cache.cross_mask
    vout = plan.vout if cache.output_product is None else 0  # 0: the hidden states
    scratch, width = n * (6 * plan.d + plan.dff), vout or plan.d
    if cache.workspace is None:
        logits, work = torch.empty(n, width), torch.empty(scratch)
    else:
        logits = cache.workspace.get("logits" if vout else "hidden", (n, width), torch.float32, x.device)
        work = cache.workspace.get("step", (scratch,), torch.float32, x.device)
    self_k = (ctypes.c_void_p * plan.layers)(*[t.data_ptr() for t in cache.self_k])
    self_v = (ctypes.c_void_p * plan.layers)(*[t.data_ptr() for t in cache.self_v])
    cross_k = (ctypes.c_void_p * plan.layers)(*[t.data_ptr() for t in cache.cross_k])
    cross_v = (ctypes.c_void_p * plan.layers)(*[t.data_ptr() for t in cache.cross_v])
    _kernel("decoder_step")(
        plan.pointers, plan.layers, plan.d, plan.h, plan.dff, vout, int(plan.pre_norm), plan.eps,
        x.data_ptr(), n, self_k, self_v, k0.stride(0), cache.length, cross_k, cross_v, c0.stride(0),
        c0.size(2), None if mask is None else mask.data_ptr(), cache.group, logits.data_ptr(),
        work.data_ptr(), _threads(),
    )
    if not vout:
        return cache.output_product(logits.view(n, 1, plan.d))
    return logits.view(n, 1, vout)


def encoder_takes(embeddings: Tensor) -> bool:
    """Whether :func:`encoder_layers` can run the encoder of a model with these ``embeddings``:
    fp32 on the CPU, no autocast, no gradient, and the kernels available."""
    return embeddings.dtype == torch.float32 and not torch.is_autocast_enabled("cpu") and usable(embeddings)


def encoder_layers(plan: Plan, x: Tensor, mask: Tensor | None) -> Tensor:
    """The encoder stack in one call: ``x [B, S, d_model]`` (the embeddings plus positions,
    overwritten) through every layer and the final LayerNorm (pre-norm): the memory
    ``[B, S, d_model]``, fp32. ``mask``: the additive padding mask ``[B, 1, 1, S]`` or None."""
    b, s, d = x.shape
    x = x.contiguous()
    if mask is not None:
        mask = mask.reshape(b, s).float().contiguous()
    work = torch.empty(b * s * (6 * d + plan.dff))
    _kernel("encoder_layers")(
        plan.pointers, plan.layers, plan.d, plan.h, plan.dff, int(plan.pre_norm), plan.eps, x.data_ptr(),
        b, s, None if mask is None else mask.data_ptr(), work.data_ptr(), _threads(),
    )
    return x


def move_rows(buffers: list[Tensor], sources: Tensor, targets: Tensor, times: int | None) -> bool:
    """In place, row ``targets[i]`` of every buffer becomes its old row ``sources[i]`` (each
    source read before any row is written), in one call for all the buffers; False (nothing
    done) unless the buffers are contiguous CPU tensors of one shape and dtype the kernels take.

    With ``times``, the buffers are time-major ``[max_len, capacity, ...]`` and only times
    ``0..times-1`` move; otherwise the rows are the first axis."""
    first = buffers[0]
    if not (usable(*buffers) and all(b.is_contiguous() and b.shape == first.shape for b in buffers)):
        return False
    size = first.element_size()
    if times is None:
        times, time_bytes, row_bytes = 1, 0, first[0].numel() * size
    else:
        time_bytes, row_bytes = first[0].numel() * size, first[0, 0].numel() * size
    sources, targets = sources.to(torch.int64).contiguous(), targets.to(torch.int64).contiguous()
    threads = _threads()
    tmp = torch.empty(threads * sources.numel() * row_bytes, dtype=torch.uint8)
    pointers = (ctypes.c_void_p * len(buffers))(*[b.data_ptr() for b in buffers])
    _kernel("move_rows")(pointers, len(buffers), times, time_bytes, row_bytes, sources.data_ptr(),
                         targets.data_ptr(), sources.numel(), tmp.data_ptr(), threads)
    return True
