"""torchweld's own decompositions, in place of torch._decomp's (aten_graph.DECOMPOSITIONS
takes these over them); each falls back to torch's outside the cases it covers.

`addmm`: torch's decomposition casts every operand to float32 for a half-precision addmm
(`pw_cast_for_opmath`), so a float16 or bfloat16 Linear's matrix product ran in float32 on
upcast copies of the activations and the weight. Here the product stays in the matrices'
dtype, as aten's addmm computes it; the bias add after it is a pointwise op (weld computes
it in float32 and rounds once more, where aten rounds once), and where the sum is stored
whole weld folds the two back into one aten.addmm (lowering.fold_addmm). It also leaves out
the two multiplications by 1 torch's traces for alpha and beta: a 12-layer GPT-2's aten graph
traced in 0.38-0.40 s instead of 0.46 on the development CPU.

Batch norm in inference (running statistics): see `_normalized`.
"""
from __future__ import annotations

import torch
from torch._decomp import get_decompositions

aten = torch.ops.aten

_TORCH = get_decompositions([aten.addmm.default, aten.native_batch_norm.default, aten.cudnn_batch_norm.default])


def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    if not (self.is_floating_point() and mat1.is_floating_point()) or self.dtype != mat1.dtype:
        return _TORCH[aten.addmm.default](self, mat1, mat2, beta=beta, alpha=alpha)
    out = aten.mm.default(mat1, mat2)
    if alpha != 1:
        out = aten.mul.Tensor(out, alpha)
    if beta == 0:
        return out  # aten ignores `self` then, NaNs included
    return aten.add.Tensor(out, self if beta == 1 else aten.mul.Tensor(self, beta))


def _normalized(x, weight, bias, mean, var, eps: float):
    """Batch norm with running statistics, (x - mean) * (rsqrt(var + eps) * weight) + bias per channel
    (dim 1), computed in float32 for half inputs; and (mean, invstd) in that precision. Nine ops
    where torch's decomposition records seventeen (two unsqueezes per statistic, copies of float32
    statistics, a multiplication by 1): ResNet-50 has 53 of them."""
    opmath = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    shape = [1, -1] + [1] * (x.dim() - 2)
    mean = mean.to(opmath)
    invstd = torch.rsqrt(var.to(opmath) + eps)
    scale = invstd if weight is None else invstd * weight.to(opmath)
    out = (x.to(opmath) - mean.view(shape)) * scale.view(shape)
    if bias is not None:
        out = out + bias.to(opmath).view(shape)
    return out.to(x.dtype), mean, invstd


def native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if training or running_mean is None or running_var is None:
        return _TORCH[aten.native_batch_norm.default](x, weight, bias, running_mean, running_var, training,
                                                      momentum, eps)
    out, mean, invstd = _normalized(x, weight, bias, running_mean, running_var, eps)
    if x.device.type == "cpu":  # what aten returns as the saved statistics, as torch's decomposition does
        return out, x.new_zeros((0,)), x.new_zeros((0,))
    return out, mean, invstd


def native_batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    return native_batch_norm(x, weight, bias, running_mean, running_var, False, momentum, eps)


def cudnn_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if training or running_mean is None or running_var is None:
        return _TORCH[aten.cudnn_batch_norm.default](x, weight, bias, running_mean, running_var, training,
                                                     momentum, eps)
    out, _, _ = _normalized(x, weight, bias, running_mean, running_var, eps)
    return out, weight.new_zeros((0,)), weight.new_zeros((0,)), x.new_zeros((0,), dtype=torch.uint8)


OWN = {
    aten.addmm.default: addmm,
    aten.native_batch_norm.default: native_batch_norm,
    aten._native_batch_norm_legit_no_training.default: native_batch_norm_no_training,
    aten.cudnn_batch_norm.default: cudnn_batch_norm,
}
