"""The fastest Python entry to an ATen operator that a wrapper calls as an extern.

`torch.ops.aten.X.default._op` converts its Python arguments to the operator's
schema one by one; for an operator with list arguments (a convolution's stride,
padding, dilation) that costs more than the kernel launch: 10-80 us per call on
an H100 host against 15-20 us through `torch.convolution`, whose generated
binding parses them in C++. For the operators listed here, whose only other
overloads are `out=` variants (or take arguments of other types), the public
binding with the same positional arguments selects the `.default` overload, so
weld calls it instead. Any other operator keeps `_op`.
"""
from __future__ import annotations

import torch

_VARIABLE_FUNCTIONS = torch._C._VariableFunctions
_NN = torch._C._nn

# operator name -> the binding module that defines it (the same name there)
_BOUND_BY = {
    "convolution": _VARIABLE_FUNCTIONS,
    "mm": _VARIABLE_FUNCTIONS,
    "bmm": _VARIABLE_FUNCTIONS,
    "addmm": _VARIABLE_FUNCTIONS,
    "baddbmm": _VARIABLE_FUNCTIONS,
    "embedding": _VARIABLE_FUNCTIONS,
    "gather": _VARIABLE_FUNCTIONS,
    "index_select": _VARIABLE_FUNCTIONS,
    "native_layer_norm": _VARIABLE_FUNCTIONS,
    "_native_batch_norm_legit_no_training": _VARIABLE_FUNCTIONS,
    "_scaled_dot_product_efficient_attention": _VARIABLE_FUNCTIONS,
    "_scaled_dot_product_flash_attention": _VARIABLE_FUNCTIONS,
    "_scaled_dot_product_cudnn_attention": _VARIABLE_FUNCTIONS,
    "avg_pool2d": _NN,
    "max_pool2d_with_indices": _NN,
}


def fast_callable(target: object) -> object:
    """What a wrapper calls for extern `target`: the public binding of a listed `.default`
    ATen overload, the C++ operator `_op` of any other OpOverload, else `target` itself."""
    if not isinstance(target, torch._ops.OpOverload):
        return target
    if target.namespace == "aten" and target._overloadname == "default":
        module = _BOUND_BY.get(target._opname)
        binding = getattr(module, target._opname, None) if module is not None else None
        if binding is not None:
            return binding
    return target._op  # an OpOverload's own __call__ is a Python frame around it
