"""What a torch-level FX node (a captured graph's) does besides computing its result: whether
it draws random numbers, changes a tensor in place, or switches grad mode or autocast; and
whether a module it calls keeps state. Capture (dead-code removal, the eager rerun's plan) and
autograd (checkpointed blocks) ask the same questions here; compiler/op_effects.py answers
them for aten nodes from their schemas."""
from __future__ import annotations

import operator

import torch

_IMPURE_FUNCTIONS = {operator.setitem, torch._C._set_grad_enabled, torch.amp._enter_autocast, torch.amp._exit_autocast}

# draws from the random number generator: unused, they still advance it, as in eager
_RANDOM_NAMES = {"bernoulli", "multinomial", "normal", "poisson", "dropout", "alpha_dropout", "feature_alpha_dropout",
                 "dropout1d", "dropout2d", "dropout3d", "rrelu", "gumbel_softmax", "fused_dropout"}


def target_name(target: object) -> str:
    """A call_method's method name, or a function's __name__ ("" for anything else)."""
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def draws_random(name: str) -> bool:
    return "rand" in name or name.lstrip("_") in _RANDOM_NAMES


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
    if target in _IMPURE_FUNCTIONS or name.startswith("i") and getattr(operator, name, None) is target:
        return False
    return not name.endswith("_")


def module_draws_random(module: torch.nn.Module) -> bool:
    """A dropout or RReLU in training mode, in `module` or below it."""
    return any(isinstance(m, (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU)) and m.training
               for m in module.modules())
