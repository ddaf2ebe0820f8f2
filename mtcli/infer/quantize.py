"""int8 decoding on a CPU: dynamic quantisation of every Linear layer and the output projection.

``decode.int8`` trades a little accuracy for speed where the matrix products dominate (beam
search on a CPU without bf16 matmul units). :func:`quantize_for_decoding` returns a copy of a
trained :class:`~mtcli.model.Transformer` in which

- each weight matrix ``W [out, in]`` is stored as int8 with one scale per output row
  (symmetric: ``W ~= s_o * W_q``, ``s_o = max_i |W_oi| / 127``), and
- each product ``x W^T + b`` quantises the activations ``x`` on the fly with one scale per row
  (computed from the row itself: "dynamic"), multiplies in int8 with int32 accumulation and
  rescales to fp32 (PyTorch's fbgemm/oneDNN ``quantized::linear_dynamic`` kernel).

A row's scale comes from that row alone, so its output does not depend on the rows decoded with
it (a translation is the same in any batch). The kernel takes one scale for all the rows it is
given, from their smallest and largest value; so each row is divided by its largest magnitude
``m_r`` and given two more columns, 1 and -1, against two zero columns of ``W``: every row then
spans [-1, 1] exactly, the kernel's scale is the same for any rows, and the product, times
``m_r``, plus ``b``, is ``x W^T + b`` with ``x`` quantised per row. A product whose input is a
ReLU's (``nonnegative``: the feed-forward network's second) gets the columns 1 and 0 instead:
its rows span [0, 1], and the kernel's levels are not spent on values that never come.

The tied output projection (the largest product in a decoder step, ``[rows, d_model] x
[d_model, vocab]``) is quantised the same way; embeddings, LayerNorm, attention over the
cache and the softmax stay fp32. The original model is not modified.

The kernels come from PyTorch's quantized-tensor API, which recent releases mark as deprecated;
when a build no longer has it, :func:`quantize_for_decoding` raises a one-line
:class:`~mtcli.errors.ConfigError` instead of failing mid-decode.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from mtcli.errors import ConfigError
from mtcli.model import Transformer


def _pack(weight: Tensor, bias: Tensor | None) -> object:
    """int8 per-output-row symmetric quantisation of ``weight [out, in]``, packed for the kernel."""
    w = weight.detach().float().contiguous()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_(min=1e-12).double()
    zeros = torch.zeros(w.size(0), dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "quantized tensor creation functions are deprecated"
        qweight = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
        b = None if bias is None else bias.detach().float().contiguous()
        return torch.ops.quantized.linear_prepack(qweight, b)


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` in int8 (per-row scales) and ``x`` quantised per row (see the
    module docstring); with ``relu=True``, ``max(0, x W^T + b)``; ``nonnegative``: ``x`` is
    never negative (a ReLU's output).

    Takes ``x [..., in]`` fp32 and returns ``[..., out]`` fp32, like the ``nn.Linear`` it replaces.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, relu: bool = False, nonnegative: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.relu = weight.size(1), weight.size(0), relu
        self._span = torch.tensor([1.0, 0.0 if nonnegative else -1.0])
        self._packed = _pack(torch.cat([weight.detach().float(), weight.new_zeros(weight.size(0), 2)], dim=1), None)
        self._bias = None if bias is None else bias.detach().float().clone()

    def forward(self, x: Tensor) -> Tensor:
        """``[..., in]`` -> ``[..., out]``."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        peak = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)
        span = self._span.expand(rows.size(0), 2)
        out = torch.ops.quantized.linear_dynamic(torch.cat([rows / peak, span], dim=1), self._packed, True)
        out.mul_(peak)
        if self._bias is not None:
            out.add_(self._bias)
        if self.relu:
            out.relu_()
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        relu = ", relu" if self.relu else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8{relu}"


def int8_supported() -> str | None:
    """None when this PyTorch build can run :class:`Int8Linear`, else why not (one line)."""
    if not hasattr(torch.ops.quantized, "linear_dynamic"):
        return "this PyTorch build has no quantized::linear_dynamic kernel"
    try:
        Int8Linear(torch.randn(4, 8), torch.zeros(4), relu=True)(torch.randn(2, 8))
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return f"int8 kernels unavailable ({str(exc).splitlines()[0][:120]})"
    return None


def quantize_for_decoding(model: Transformer) -> Transformer:
    """A copy of ``model`` for CPU decoding with every ``nn.Linear`` as :class:`Int8Linear` and
    the (tied or separate) output projection quantised too (see the module docstring).

    The copy is in eval mode; use it under ``torch.inference_mode()`` (no gradients flow).
    Raises :class:`ConfigError` when the model is not on the CPU or the kernels are missing.
    """
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ConfigError("decode.int8 runs on the CPU only (use decode.bf16 on a GPU)")
    why = int8_supported()
    if why is not None:
        raise ConfigError(f"decode.int8: {why}")
    return model.for_decoding(Int8Linear)


__all__ = ["Int8Linear", "int8_supported", "quantize_for_decoding"]
