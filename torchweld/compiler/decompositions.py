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

Batch norm in inference (running statistics): see `_normalized`. In training: see
`_batch_norm_training` and `native_batch_norm_backward`. Softmax of integers: `softmax`.
"""
from __future__ import annotations

import torch
from torch._decomp import get_decompositions

aten = torch.ops.aten

_TORCH = get_decompositions([aten.addmm.default, aten.native_batch_norm.default, aten.cudnn_batch_norm.default,
                             aten.native_batch_norm_backward.default, aten._softmax.default,
                             aten._log_softmax.default])


def softmax(x, dim, half_to_float):
    """torch's decomposition for floating x; aten's own kernel, which refuses it, for integer x
    (the decomposition computed a softmax of int64 as zeros where eager raises)."""
    if not x.is_floating_point():
        return NotImplemented
    return _TORCH[aten._softmax.default](x, dim, half_to_float)


def log_softmax(x, dim, half_to_float):
    if not x.is_floating_point():
        return NotImplemented
    return _TORCH[aten._log_softmax.default](x, dim, half_to_float)


def safe_softmax(x, dim, dtype=None):
    """A softmax whose rows of -inf alone (a query that may attend to nothing) are zeros: what
    scaled_dot_product_attention's math path runs under a mask. torch's decomposition finds those
    rows with a reduction of its own, an all() of x == -inf; here they are the rows whose max is
    -inf, the max the softmax computes anyway (a NaN makes that max NaN, as it makes the softmax
    NaN, and the row is no masked row for either). That flag, a boolean accumulator beside the
    max, made BERT's softmax over a symbolic length 1.5x slower on the H200."""
    if dtype is not None:
        x = x.to(dtype)
    if not x.is_floating_point():
        return NotImplemented
    result_dtype = x.dtype
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    x = x.contiguous().to(compute)  # (eager's softmax returns a contiguous tensor)
    row_max = torch.amax(x, dim, keepdim=True)
    unnormalized = torch.exp(x - row_max)
    out = unnormalized / torch.sum(unnormalized, dim, keepdim=True)
    return torch.where(row_max == float("-inf"), 0.0, out).to(result_dtype)


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


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _batch_norm_training(x, weight, bias, running_mean, running_var, momentum: float, eps: float):
    """Batch norm over the batch's statistics: (out, mean, invstd) per channel (dim 1), the
    running statistics updated in place (functionalization makes that an output). The same
    arithmetic as torch's decomposition (native_batch_norm_helper) in fewer ops: the mean
    once (torch's var_mean takes it twice), views instead of squeezes and unsqueezes."""
    opmath = _opmath(x.dtype)
    dims = [0] + list(range(2, x.dim()))
    shape = [1, -1] + [1] * (x.dim() - 2)
    n = x.numel() / x.shape[1]
    xc = x.to(opmath)
    mean = aten.sum.dim_IntList(xc, dims, True) / n
    centered = xc - mean  # computed again below: one node read by the reduction and the output would be stored
    var = aten.sum.dim_IntList(centered * centered, dims, True) / n
    invstd = torch.rsqrt(var + eps)
    out = (xc - mean) * invstd
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    save_mean, save_invstd = mean.view(-1), invstd.view(-1)
    if running_mean is not None:
        running_mean.copy_(momentum * save_mean + (1 - momentum) * running_mean)
    if running_var is not None:
        running_var.copy_(momentum * (var.view(-1) * (n / (n - 1))) + (1 - momentum) * running_var)
    if x.device.type == "cpu":  # aten's CPU kernel returns the statistics in the input's dtype
        save_mean, save_invstd = save_mean.to(x.dtype), save_invstd.to(x.dtype)
    return out.to(x.dtype), save_mean, save_invstd


def native_batch_norm_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd,
                               train, eps, output_mask):
    """(grad_input, grad_weight, grad_bias) of batch norm over the batch's statistics, with
    torch's decomposition's arithmetic in fewer ops (views for its unsqueezes); torch's
    outside training."""
    if not train or save_mean is None or save_invstd is None:
        return _TORCH[aten.native_batch_norm_backward.default](
            grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask)
    input_dtype, opmath = x.dtype, _opmath(x.dtype)
    dims = [0] + list(range(2, x.dim()))
    shape = [1, -1] + [1] * (x.dim() - 2)
    norm = 1.0 / (x.numel() / x.shape[1])
    g = grad_out.to(opmath)
    invstd = save_invstd.to(opmath)
    x, mean = x.to(opmath), save_mean.to(opmath).view(shape)
    grad_sum = aten.sum.dim_IntList(g, dims)
    dot = aten.sum.dim_IntList(g * (x - mean), dims)  # x - mean again below (one node would be stored)
    grad_mean = (grad_sum * norm).view(shape)
    proj_scale = ((dot * norm) * (invstd * invstd)).view(shape)
    grad_scale = (invstd * weight.to(opmath) if weight is not None else invstd * 1.0).view(shape)
    grad_input = ((g - (x - mean) * proj_scale) - grad_mean) * grad_scale
    weight_dtype = weight.dtype if weight is not None else input_dtype
    grad_weight = (dot * invstd).to(weight_dtype) if output_mask[1] else None
    grad_bias = grad_sum.to(weight_dtype) if output_mask[2] else None
    return grad_input.to(input_dtype), grad_weight, grad_bias


def cudnn_batch_norm_backward(x, grad_out, weight, running_mean, running_var, save_mean, save_var, eps, reserve):
    # cuDNN's saved "var" is the inverse standard deviation
    return native_batch_norm_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_var, True,
                                      eps, [True, True, True])


def native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        return _batch_norm_training(x, weight, bias, running_mean, running_var, momentum, eps)
    if running_mean is None or running_var is None:
        return _TORCH[aten.native_batch_norm.default](x, weight, bias, running_mean, running_var, training,
                                                      momentum, eps)
    out, mean, invstd = _normalized(x, weight, bias, running_mean, running_var, eps)
    if x.device.type == "cpu":  # what aten returns as the saved statistics, as torch's decomposition does
        return out, x.new_zeros((0,)), x.new_zeros((0,))
    return out, mean, invstd


def native_batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    return native_batch_norm(x, weight, bias, running_mean, running_var, False, momentum, eps)


def cudnn_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        out, mean, invstd = _batch_norm_training(x, weight, bias, running_mean, running_var, momentum, eps)
        return out, mean, invstd, x.new_zeros((0,), dtype=torch.uint8)
    if running_mean is None or running_var is None:
        return _TORCH[aten.cudnn_batch_norm.default](x, weight, bias, running_mean, running_var, training,
                                                     momentum, eps)
    out, _, _ = _normalized(x, weight, bias, running_mean, running_var, eps)
    return out, weight.new_zeros((0,)), weight.new_zeros((0,)), x.new_zeros((0,), dtype=torch.uint8)


def slice_backward(grad_output, input_sizes, dim, start, end, step):
    """The gradient of x[start:end] along `dim`: zeros but there. aten's decomposition is
    new_zeros and slice_scatter, an extern fill and an extern copy (a Llama's rotary embedding,
    rotate_half's two slices of q and of k: 4 of each a layer, 1 ms of a 1.1B model's bf16 step);
    with step 1 it is a pad of the gradient, one pointwise kernel with a mask that fuses with
    what reads it. A step, or sizes that are symbols: aten's op."""
    if step != 1 or not all(type(n) is int for n in (*input_sizes, start, end)):
        return NotImplemented
    dim = dim % len(input_sizes)
    size = input_sizes[dim]
    start, end, _ = slice(start, end).indices(size)
    if grad_output.shape[dim] != max(end - start, 0):
        return NotImplemented
    pad = [0, 0] * (len(input_sizes) - 1 - dim) + [start, size - end]
    return aten.constant_pad_nd.default(grad_output, pad)


# backward ops, for the joint trace (autograd/joint.py)
OWN_BACKWARD = {
    aten.slice_backward.default: slice_backward,
    aten.native_batch_norm_backward.default: native_batch_norm_backward,
    aten.cudnn_batch_norm_backward.default: cudnn_batch_norm_backward,
}

OWN = {
    aten.addmm.default: addmm,
    aten._softmax.default: softmax,
    aten._log_softmax.default: log_softmax,
    aten._safe_softmax.default: safe_softmax,
    aten.native_batch_norm.default: native_batch_norm,
    aten._native_batch_norm_legit_no_training.default: native_batch_norm_no_training,
    aten.cudnn_batch_norm.default: cudnn_batch_norm,
}
