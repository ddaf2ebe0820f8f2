"""CPU decoding with every weight matrix prepacked for oneDNN's matrix kernels, in fp32 or bf16.

A decoder step multiplies a few rows (the beams of the sentences still being decoded) by every
weight matrix of the decoder and by the output projection. ``torch.nn.functional.linear`` on a
CPU hands each product to the BLAS it was built with (MKL), which re-lays-out the weight on every
call and is slow for skinny inputs; the output projection, ``[rows, d_model] x [d_model, vocab]``,
is the largest product of the step. oneDNN can lay a weight out once, in the blocked format its
kernels read, and then run every product on that copy. :func:`pack_for_decoding` returns a copy of
a trained :class:`~mtcli.model.Transformer` whose ``nn.Linear`` layers and output projection are
:class:`PackedLinear` s:

- fp32 (the default): the same fp32 ``x W^T + b`` (the sums run in a different order, so results
  agree to float rounding, not bit for bit);
- bf16 (``decode.bf16`` on a CPU with bf16 units): the weights stored in bf16 and each product
  taking its input in bf16, accumulating in fp32 and returning bf16, which is what bf16 autocast
  computes, without autocast casting the weights again for every batch.

oneDNN builds a kernel for each shape it is given and keeps it in its cache, and the number of
rows changes from step to step (the beams of the sentences still live, the tokens of a batch), so
a long-running process would build, and hold memory for, a kernel for every row count it ever saw:
a server grew by hundreds of MB. :class:`PackedLinear` therefore pads its rows up to one of a few
sizes (:func:`padded_rows`: at most 1/8 more rows above 64) and drops the padding from the result.

docs/performance.md has the measurements. The kernels are PyTorch's ``mkldnn`` operators (the ones its
compiler uses for the same purpose); :func:`packing_supported` checks that a build has them and
that they compute ``x W^T + b``, and :func:`pack_for_decoding` returns the model unchanged when
they do not.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcli.model import Transformer


def padded_rows(n: int) -> int:
    """The row count a product of ``n`` rows runs at: ``n`` itself up to 8, then ``n`` rounded up
    to a multiple of ``max(8, 2^(floor(log2 n) - 3))``: at most 7 rows more below 64, at most 1/8
    more above, eight sizes an octave.

    So a weight sees at most 79 kernel shapes up to 16,384 rows, however many row counts the
    batches make."""
    if n <= 8:
        return n
    granule = max(8, 1 << (n.bit_length() - 4))
    return -(-n // granule) * granule


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W [out, in]`` stored in oneDNN's blocked layout, in ``dtype``;
    with ``relu=True``, ``max(0, x W^T + b)`` in the same kernel (no second pass over ``y``).

    Takes ``x [..., in]`` (any float dtype; cast to ``dtype``) and returns ``[..., out]`` in
    ``dtype``: fp32 like the ``nn.Linear`` it replaces, or bf16 as under bf16 autocast.
    """

    def __init__(
        self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype = torch.float32, relu: bool = False,
        nonnegative: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = weight.size(1), weight.size(0), dtype
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous())
        self._bias = None if bias is None else bias.detach().float().contiguous()
        self._post = "relu" if relu else "none"

    def forward(self, x: Tensor) -> Tensor:
        """``[..., in]`` -> ``[..., out]``, the rows padded to :func:`padded_rows` for the kernel."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(self.dtype)
        n = rows.size(0)
        padding = padded_rows(n) - n
        if padding:
            rows = F.pad(rows, (0, 0, 0, padding))
        out = torch.ops.mkldnn._linear_pointwise(rows, self._packed, self._bias, self._post, [], "")
        return out[:n].view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        relu = ", relu" if self._post == "relu" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, packed {self.dtype}{relu}"


@functools.cache
def packing_supported(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this PyTorch build has the oneDNN operators and they compute ``x W^T + b`` (and
    its ReLU) in ``dtype`` (fp32, or bf16 where oneDNN runs bf16 on this CPU)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 16, generator=generator, dtype=torch.float32)  # (whatever the default dtype)
    bias = torch.randn(24, generator=generator, dtype=torch.float32)
    x = torch.randn(3, 16, generator=generator, dtype=torch.float32)
    try:
        out = PackedLinear(weight, bias, dtype)(x).float()
        out_relu = PackedLinear(weight, bias, dtype, relu=True)(x).float()
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    expected = F.linear(x, weight, bias)
    return bool(torch.allclose(out, expected, rtol=tolerance, atol=tolerance)
                and torch.allclose(out_relu, expected.relu(), rtol=tolerance, atol=tolerance))


def pack_for_decoding(model: Transformer, dtype: torch.dtype = torch.float32) -> Transformer:
    """A copy of ``model`` for CPU decoding with every ``nn.Linear`` and the output projection
    as :class:`PackedLinear` in ``dtype`` (fp32, or bf16 for ``decode.bf16``; see the module
    docstring); ``model`` itself when it is not an fp32 model on the CPU or this build cannot
    pack in ``dtype``. The copy is in eval mode and serves inference only (the packed weights
    take no gradient)."""
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in model.parameters()):
        return model
    if not packing_supported(dtype):
        return model
    return model.for_decoding(functools.partial(PackedLinear, dtype=dtype))


__all__ = ["PackedLinear", "pack_for_decoding", "packing_supported", "padded_rows"]
