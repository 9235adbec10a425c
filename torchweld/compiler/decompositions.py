"""torchweld's own decompositions of two ops every transformer calls dozens of times, in
place of torch._decomp's (aten_graph.DECOMPOSITIONS takes these over them).

- `addmm`: torch's decomposition casts every operand to float32 for a half-precision
  addmm (`pw_cast_for_opmath`), so a float16 or bfloat16 Linear's matrix product ran in
  float32 on upcast copies of the activations and the weight. Here the product stays in
  the matrices' dtype, as aten's addmm computes it; the bias add after it is a pointwise
  op (weld computes it in float32 and rounds once more, where aten rounds once), and where
  the sum is stored whole weld folds the two back into one aten.addmm (lowering.fold_addmm).
- `native_layer_norm`: the same aten/prims ops as torch._refs' decomposition, in the same
  order (so the same numbers), without the checks and dtype machinery of the reference
  implementation, which took ~10 ms of tracing per layer norm (a quarter of GPT-2's
  aten-graph trace on the development CPU).

Each falls back to torch's own decomposition outside the cases it covers.
"""
from __future__ import annotations

import math

import torch
from torch._decomp import get_decompositions

aten = torch.ops.aten
prims = torch.ops.prims

_TORCH = get_decompositions([aten.addmm.default, aten.native_layer_norm.default])


def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    if not (self.is_floating_point() and mat1.is_floating_point()) or self.dtype != mat1.dtype:
        return _TORCH[aten.addmm.default](self, mat1, mat2, beta=beta, alpha=alpha)
    out = aten.mm.default(mat1, mat2)
    if alpha != 1:
        out = aten.mul.Tensor(out, alpha)
    if beta == 0:
        return out  # aten ignores `self` then, NaNs included
    return aten.add.Tensor(out, self if beta == 1 else aten.mul.Tensor(self, beta))


def native_layer_norm(input, normalized_shape, weight, bias, eps):
    axis = input.dim() - len(normalized_shape)
    covered = (len(normalized_shape) >= 1 and axis >= 0 and input.is_floating_point()
               and tuple(input.shape[axis:]) == tuple(normalized_shape)
               and all(t is None or tuple(t.shape) == tuple(normalized_shape) for t in (weight, bias)))
    n = math.prod(normalized_shape) if covered else 0
    if not covered or n == 0:
        return _TORCH[aten.native_layer_norm.default](input, normalized_shape, weight, bias, eps)
    dims = list(range(axis, input.dim()))
    kept_shape, kept_dims = [*input.shape[:axis], *([1] * len(dims))], list(range(axis))
    compute = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    x = input if input.dtype == compute else aten._to_copy.default(input, dtype=compute)
    var = prims.broadcast_in_dim.default(prims.var.default(x, dims, 0.0), kept_shape, kept_dims)
    total = prims.broadcast_in_dim.default(prims.sum.default(x, dims), kept_shape, kept_dims)
    mean = prims.div.default(total, float(n))
    rstd = aten.rsqrt.default(aten.add.Tensor(var, eps))
    out = aten.mul.Tensor(aten.sub.Tensor(x, mean), rstd)
    if weight is not None:
        out = aten.mul.Tensor(out, weight)
    if bias is not None:
        out = aten.add.Tensor(out, bias)
    if out.dtype != input.dtype:
        out = aten._to_copy.default(out, dtype=input.dtype)
    if input.device.type in ("cpu", "mtia") and mean.dtype != input.dtype:  # as aten's CPU kernel returns them
        mean = aten._to_copy.default(mean, dtype=input.dtype)
        rstd = aten._to_copy.default(rstd, dtype=input.dtype)
    return out, mean, rstd


OWN = {aten.addmm.default: addmm, aten.native_layer_norm.default: native_layer_norm}
