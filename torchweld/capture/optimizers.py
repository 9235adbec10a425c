"""`opt.step()` of torch.optim.Adam and AdamW, captured as graph operations.

Adam's own `step` is Python that capture cannot follow (profiler records, hooks,
grouping by device, state made lazily in the first step). Its update is known,
though: this module emits it into the graph as foreach operations on the graph's
inputs, in the order Adam's capturable multi-tensor path runs them. A backend then
sees the whole step: weld fuses each parameter's update into one kernel, and the
eager backend runs the same foreach kernels Adam runs.

Guarded (a change recompiles): the optimizer's class (exactly Adam or AdamW) and its
`step` function; no step hooks, on the optimizer or global; every hyperparameter of
every group, as a constant (a new learning rate is a new graph); which parameters
have a gradient (those without are skipped, as Adam skips them); the metadata of
every parameter and gradient; the identity of every state tensor (Adam makes them
like their parameter, and load_state_dict replaces them). Anything else (a closure,
hooks, tensor hyperparameters, fused, differentiable, sparse or complex groups) is
Unsupported: the step runs natively.

What it changes on the optimizer, as torch.compile does: state is made at capture
time for a parameter that has a gradient and none yet (zeros, as Adam's first step
makes it), and `state['step']` moves to its parameter's device, so the bias
corrections are computed there without reading the step back to the host (Adam's
`capturable` path). Adam run natively afterwards accepts both.
"""
from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING

import torch

from torchweld.capture.sources import AttrSource, ItemSource, ModuleGlobalSource, ObjectKeySource
from torchweld.capture.values import ConstantValue, ListValue, TensorValue, Value, const
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.objects import UserObjectValue
    from torchweld.capture.translator import Translator

CAPTURED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)
_ADAM_STEP = ("torch.optim.adam", "Adam.step")
_OPTIMIZER_MODULE = "torch.optim.optimizer"  # where the global step hooks are kept
_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def captures_step(obj: object) -> bool:
    """Whether `obj.step()` is emitted by this module: a stock Adam/AdamW with torch's step."""
    if type(obj) not in CAPTURED_OPTIMIZERS or "step" in vars(obj):
        return False
    fn = inspect.unwrap(type(obj).step)
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) == _ADAM_STEP


class OptimizerStepValue(Value):
    """The bound `step` of a captured optimizer."""

    def __init__(self, optimizer: "UserObjectValue"):
        self.optimizer = optimizer
        self.source = AttrSource(optimizer.source, "step")

    def call(self, tx: "Translator", args: list[Value], kwargs: dict[str, Value]) -> Value:
        opt, source = self.optimizer.obj, self.optimizer.source
        if args or kwargs:
            raise Unsupported(f"{type(opt).__name__}.step() with a closure runs natively")
        guards = tx.output.guards
        guards.identity(AttrSource(AttrSource(source, "__class__"), "step"), type(opt).step)
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
            _no_hooks(guards, AttrSource(source, name), getattr(opt, name))
        for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
            _no_hooks(guards, ModuleGlobalSource(_OPTIMIZER_MODULE, name),
                      getattr(importlib.import_module(_OPTIMIZER_MODULE), name))
        groups = self.optimizer.getattr(tx, "param_groups")
        updates = [_group_update(tx, opt, source, group, real)
                   for group, real in zip(groups.items(tx), opt.param_groups)]
        was_enabled = tx.output.grad_enabled
        tx.output.set_grad_enabled(False)
        for settings, by_device in updates:
            for tensors in by_device.values():
                _emit_adam(tx, settings, *tensors)
        tx.output.set_grad_enabled(was_enabled)
        return ConstantValue(None)

    def __repr__(self) -> str:
        return f"OptimizerStepValue({self.source})"


def _no_hooks(guards, source, hooks: dict) -> None:
    if hooks:
        raise Unsupported("an optimizer with step hooks runs natively")
    guards.length(source, type(hooks), 0)


def _group_update(tx: "Translator", opt: torch.optim.Optimizer, opt_source, group: Value, real: dict):
    """The settings of one param group (`group`, read from the real dict `real`) and its
    tensors with gradients by (device, dtype):
    {key: (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)}."""
    from torchweld.capture.builder import wrap

    entries = getattr(group, "entries", None)
    if entries is None:
        raise Unsupported("an optimizer param group that is not a dict")
    settings = {k: v.as_constant() for k, v in entries.items() if k != "params"}
    if settings.get("fused") or settings.get("differentiable"):
        raise Unsupported("a fused or differentiable Adam runs natively")
    settings.setdefault("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW))
    by_device: dict[tuple, tuple[list, ...]] = {}
    for param, p in zip(entries["params"].items(tx), real["params"]):
        if not isinstance(param, TensorValue):
            raise Unsupported("an optimizer parameter that is not a tensor")
        if p.grad is None:
            wrap(tx, None, AttrSource(param.source, "grad"))  # guards that it stays None
            continue
        if p.is_complex() or p.grad.is_sparse:
            raise Unsupported("Adam on complex parameters or sparse gradients runs natively")
        grad = wrap(tx, p.grad, AttrSource(param.source, "grad"))
        state = _state_of(opt, p, settings["amsgrad"])
        state_source = ObjectKeySource(AttrSource(opt_source, "state"), param.source)
        keys = _STATE_KEYS + (("max_exp_avg_sq",) if settings["amsgrad"] else ())
        # the state is guarded by identity: Adam makes it like its parameter (whose metadata is
        # guarded in full) and remakes it to change it (load_state_dict); ~1 us less per tensor
        tensors = {k: tx.output.input_tensor(ItemSource(state_source, k), state[k], by_identity=True) for k in keys}
        lists = by_device.setdefault((p.device, p.dtype), tuple([] for _ in range(6)))
        for lst, value in zip(lists, (param, grad, tensors["exp_avg"], tensors["exp_avg_sq"],
                                      tensors.get("max_exp_avg_sq"), tensors["step"])):
            lst.append(value)
    return settings, by_device


def _state_of(opt: torch.optim.Optimizer, p: torch.Tensor, amsgrad: bool) -> dict:
    """`opt.state[p]`, made as Adam's first step makes it if empty, its step on p's device."""
    state = opt.state[p]
    if not state:
        scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        state["step"] = torch.zeros((), dtype=scalar_dtype, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if amsgrad:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    missing = [k for k in _STATE_KEYS + (("max_exp_avg_sq",) if amsgrad else ()) if k not in state]
    if missing or not all(isinstance(state[k], torch.Tensor) for k in _STATE_KEYS):
        raise Unsupported(f"optimizer state without {', '.join(missing) or 'tensors'}")
    if state["step"].device != p.device:
        state["step"] = state["step"].to(p.device)
    return state


def _emit_adam(tx: "Translator", s: dict, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) -> None:
    """Adam's update of one (device, dtype) group, as its capturable foreach path runs it."""
    def op(fn, *args):
        return tx.output.call_function(fn, [a if isinstance(a, Value) else const(a) for a in args], {})

    lr, (beta1, beta2), eps, weight_decay = s["lr"], s["betas"], s["eps"], s["weight_decay"]
    if not all(type(x) in (int, float) for x in (lr, beta1, beta2, eps, weight_decay)):
        raise Unsupported("Adam with tensor hyperparameters runs natively")
    params, grads, exp_avgs, exp_avg_sqs, steps = map(ListValue, (params, grads, exp_avgs, exp_avg_sqs, steps))
    if s["maximize"]:
        grads = op(torch._foreach_neg, grads)
    op(torch._foreach_add_, steps, 1)
    if weight_decay != 0:
        if s["decoupled_weight_decay"]:
            op(torch._foreach_mul_, params, 1 - lr * weight_decay)
        else:  # grads + weight_decay * params, a new list: the gradients stay as they are
            grads = tx.output.call_function(torch._foreach_add, [grads, params], {"alpha": const(weight_decay)})
    op(torch._foreach_lerp_, exp_avgs, grads, 1 - beta1)
    op(torch._foreach_mul_, exp_avg_sqs, beta2)
    op(torch._foreach_addcmul_, exp_avg_sqs, grads, grads, 1 - beta2)
    bias_correction1 = op(torch._foreach_pow, beta1, steps)
    bias_correction2 = op(torch._foreach_pow, beta2, steps)
    op(torch._foreach_sub_, bias_correction1, 1)
    op(torch._foreach_sub_, bias_correction2, 1)
    op(torch._foreach_neg_, bias_correction2)
    op(torch._foreach_div_, bias_correction1, lr)
    op(torch._foreach_reciprocal_, bias_correction1)
    op(torch._foreach_sqrt_, bias_correction2)
    step_size, bias_correction2_sqrt = bias_correction1, bias_correction2
    if s["amsgrad"]:
        max_exp_avg_sqs = ListValue(max_exp_avg_sqs)
        op(torch._foreach_maximum_, max_exp_avg_sqs, exp_avg_sqs)
        denom = op(torch._foreach_sqrt, max_exp_avg_sqs)
    else:
        denom = op(torch._foreach_sqrt, exp_avg_sqs)
    op(torch._foreach_div_, denom, bias_correction2_sqrt)
    op(torch._foreach_add_, denom, eps)
    op(torch._foreach_div_, denom, step_size)
    op(torch._foreach_addcdiv_, params, exp_avgs, denom)

