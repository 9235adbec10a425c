"""Example values of common modules without running them on fake tensors.

Capture runs every call on fake tensors to learn its result's shape, strides, dtype and
whether it requires grad. A batch norm's fake run goes through torch's Python
decomposition: ~8 ms for each new input shape, and every layer of a DenseNet has one
(0.55 s of densenet121's 1.1 s capture on the development CPU). Its result is laid out
like its input, so where nothing about the call is unusual this module makes it directly:
a clone of the fake input, which has the input's strides and, where the input requires
grad, a grad_fn (so that the ReLU(inplace=True) after it may write into it, as eager's may).

    example = batch_norm_example(module, args, kwargs, grad_enabled)   # None: run it on fakes
"""
from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def batch_norm_example(module: nn.Module, args: list, kwargs: dict, grad_enabled: bool) -> torch.Tensor | None:
    """The example result of a plain `nn.BatchNorm{1,2,3}d` call on a contiguous or
    channels-last fake input of the parameters' dtype, or None where the call must run on
    fakes: a subclass with its own forward, an input whose layout or dtype makes the result's
    layout a question, sizes of 1 or none (whose strides implementations choose differently), a call
    eager would reject (wrong rank or channel count, one value per channel in training),
    hooks, or parameters that require grad when the input does not (the result's grad_fn
    would be missing). Call it inside the capture's fake mode, outside autocast."""
    if type(module) not in _BATCH_NORMS or kwargs or len(args) != 1 or _hooked(module):
        return None
    (x,) = args
    if not isinstance(x, FakeTensor) or not x.is_floating_point() or x.numel() == 0 or 1 in x.shape[1:]:
        return None
    try:
        module._check_input_dim(x)
    except ValueError:
        return None
    if x.dim() < 2 or x.shape[1] != module.num_features:
        return None
    state = [t for t in (module.weight, module.bias, module.running_mean, module.running_var) if t is not None]
    if any(t.dtype != x.dtype or t.device != x.device for t in state):
        return None
    layouts = [torch.contiguous_format] + [{4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())]
    if not any(f is not None and x.is_contiguous(memory_format=f) for f in layouts):
        return None
    uses_batch_statistics = module.training or module.running_mean is None
    if uses_batch_statistics and x.numel() // x.shape[1] <= 1:
        return None
    params_need_grad = grad_enabled and any(p is not None and p.requires_grad for p in (module.weight, module.bias))
    if params_need_grad and not x.requires_grad:
        return None
    with torch.set_grad_enabled(grad_enabled):
        return x.clone()


def _hooked(module: nn.Module) -> bool:
    """Whether a call of `module` runs hooks, its own or global ones, which may change its result."""
    from torch.nn.modules import module as m

    own = module._forward_hooks or module._forward_pre_hooks
    return bool(own or m._global_forward_hooks or m._global_forward_pre_hooks)
