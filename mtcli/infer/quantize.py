"""int8 decoding on a CPU: dynamic quantisation of every Linear layer and the output projection.

``decode.int8`` trades a little accuracy for speed where the matrix products dominate (beam
search on a CPU without bf16 matmul units). :func:`quantize_for_decoding` returns a copy of a
trained :class:`~mtcli.model.Transformer` in which

- each weight matrix ``W [out, in]`` is stored as int8 with one scale per output row
  (symmetric: ``W ~= s_o * W_q``, ``s_o = max_i |W_oi| / 127``), and
- each product ``x W^T + b`` quantises the activations ``x`` on the fly with one scale per row
  of ``x``, computed from the row itself ("dynamic": ``x_r ~= t_r * x_q``, ``t_r = max_i |x_ri|
  / 127``), multiplies in int8 with exact int32 sums (``torch._int_mm``) and rescales:
  ``y_ro = t_r s_o (x_q W_q^T)_ro + b_o``.

A row's scale comes from that row alone and the int32 sums are exact, so a row's product does
not depend on the rows multiplied with it. The fp32 parts around it (attention, LayerNorm) can
still differ in their last bits between batch shapes, and a row near a rounding edge then
rounds the other way: scores move by about 1e-3, which a near tie can feel. A product
whose input is a ReLU's (``nonnegative``: the feed-forward network's second) spends all 256
levels on [0, max]: ``x_q = round(x / t) - 128`` with ``t = max / 255``, and the 128 taken
away comes back as ``128 * sum_i W_q[o, i]``, kept per output.

The tied output projection (the largest product in a decoder step, ``[rows, d_model] x
[d_model, vocab]``) is quantised the same way; embeddings, LayerNorm, attention over the
cache and the softmax stay fp32. The original model is not modified. When this PyTorch build
has no CPU int8 product, :func:`quantize_for_decoding` raises a one-line
:class:`~mtcli.errors.ConfigError` instead of failing mid-decode.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mtcli.errors import ConfigError
from mtcli.model import Transformer


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` in int8 (per-row scales) and ``x`` quantised per row (see the
    module docstring); with ``relu=True``, ``max(0, x W^T + b)``; ``nonnegative``: ``x`` is
    never negative (a ReLU's output).

    Takes ``x [..., in]`` fp32 and returns ``[..., out]`` fp32, like the ``nn.Linear`` it replaces.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, relu: bool = False, nonnegative: bool = False) -> None:
        super().__init__()
        w = weight.detach().float()
        self.in_features, self.out_features, self.relu, self.nonnegative = w.size(1), w.size(0), relu, nonnegative
        self.weight_scale = (w.abs().amax(dim=1) / 127.0).clamp_(min=1e-12)  # [out]
        self.weight_t = torch.round(w / self.weight_scale[:, None]).to(torch.int8).t().contiguous()  # [in, out]
        self.offset = 128 * self.weight_t.sum(dim=0, dtype=torch.int32) if nonnegative else None  # [out]
        self.bias = None if bias is None else bias.detach().float().clone()

    def forward(self, x: Tensor) -> Tensor:
        """``[..., in]`` -> ``[..., out]``."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        levels = 255.0 if self.nonnegative else 127.0
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30).div_(levels)  # [rows, 1]
        quantized = rows.div(scale).round_()
        if self.offset is not None:
            quantized.sub_(128.0).clamp_(min=-128.0)  # (a negative input, which a ReLU's never is, at the floor)
        sums = torch._int_mm(quantized.to(torch.int8), self.weight_t)
        if self.offset is not None:
            sums.add_(self.offset)
        out = sums.float().mul_(scale).mul_(self.weight_scale)
        if self.bias is not None:
            out.add_(self.bias)
        if self.relu:
            out.relu_()
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        relu = ", relu" if self.relu else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8{relu}"


def int8_supported() -> str | None:
    """None when this PyTorch build can run :class:`Int8Linear`, else why not (one line)."""
    if not hasattr(torch, "_int_mm"):
        return "this PyTorch build has no int8 matrix product (torch._int_mm)"
    try:
        draws = torch.Generator().manual_seed(0)  # its own: a caller's random numbers stay as they were
        f32 = torch.float32  # whatever the default dtype
        Int8Linear(torch.randn(4, 8, generator=draws, dtype=f32), torch.zeros(4, dtype=f32), relu=True,
                   nonnegative=True)(torch.rand(2, 8, generator=draws, dtype=f32))
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
