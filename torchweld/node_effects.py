"""What a torch-level FX node (a captured graph's) does besides computing its result: whether
it draws random numbers, changes a tensor in place, or switches grad mode or autocast; and
whether a module it calls keeps state. Capture (dead-code removal, the eager rerun's plan) and
autograd (checkpointed blocks) ask the same questions here; compiler/op_effects.py answers
them for aten nodes from their schemas."""
from __future__ import annotations

import operator
import types

import torch

_IMPURE_FUNCTIONS = {operator.setitem, torch._C._set_grad_enabled, torch.amp._enter_autocast, torch.amp._exit_autocast}

# draws from the random number generator: unused, they still advance it, as in eager
_RANDOM_NAMES = {"bernoulli", "multinomial", "normal", "poisson", "dropout", "alpha_dropout", "feature_alpha_dropout",
                 "dropout1d", "dropout2d", "dropout3d", "rrelu", "gumbel_softmax", "fused_dropout"}


# modules whose Python functions compute their result and do nothing else: torch's functional
# API. A Python function of any other module may act (a collective, a check that raises, a
# user's function allowed in the graph): its node stays even when nothing reads its result.
_PURE_PYTHON_MODULES = ("torch.nn.functional", "torch.functional", "torch._refs", "math")


def _pure_python_function(fn: types.FunctionType) -> bool:
    module = fn.__module__ or ""
    return module in _PURE_PYTHON_MODULES or module == "torch" and fn.__name__.startswith(("sym_", "_sym_"))


def target_name(target: object) -> str:
    """A call_method's method name, or a function's __name__ ("" for anything else)."""
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def draws_random(name: str) -> bool:
    return "rand" in name or name.lstrip("_") in _RANDOM_NAMES


def writes_first_argument(target: object) -> bool:
    """A call_method's name or a function that changes its first argument in place: `add_`,
    `torch.relu_`, `operator.iadd` (`t += u` of a tensor)."""
    name = target_name(target)
    if isinstance(target, str):
        return name.endswith("_") and not name.startswith("__")
    return name.endswith("_") and not name.startswith("__") or _is_inplace_operator(target)


def _is_inplace_operator(target: object) -> bool:
    name = getattr(target, "__name__", "")
    return name.startswith("i") and getattr(operator, name, None) is target


def is_pure_node(node: torch.fx.Node) -> bool:
    """A call that changes nothing: no in-place change, no output argument, no random draw, no
    grad-mode or autocast switch."""
    if node.kwargs.get("out") is not None or node.kwargs.get("inplace"):
        return False
    if node.op == "call_method":
        return not node.target.endswith("_") and not draws_random(node.target)
    target = node.target
    name = getattr(target, "__name__", "")
    if draws_random(name):
        return False
    if target in _IMPURE_FUNCTIONS or _is_inplace_operator(target):
        return False
    if isinstance(target, types.FunctionType) and not _pure_python_function(target):
        return False
    return not name.endswith("_")


def module_draws_random(module: torch.nn.Module) -> bool:
    """A dropout or RReLU in training mode, in `module` or below it."""
    return any(isinstance(m, (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU)) and m.training
               for m in module.modules())
