"""`opt.step()` of torch.optim.Adam, AdamW and SGD, captured as graph operations.

An optimizer's own `step` is Python that capture cannot follow (profiler records,
hooks, grouping by device, state made lazily in the first step). Its update is
known, though: this module emits it into the graph as foreach operations on the
graph's inputs, in the order the optimizer's multi-tensor path runs them (Adam's
capturable one). A backend then sees the whole step: weld fuses each parameter's
update into one kernel, and the eager backend runs the same foreach kernels the
optimizer runs.

Guarded (a change recompiles): the optimizer's class (exactly Adam, AdamW or SGD) and
its `step` function, or the wrapper an LR scheduler put on the instance (whose one
other effect, `opt._opt_called = True`, is replayed); no step hooks, on the optimizer
or global; every hyperparameter of every group as a constant, except the float
learning rate, Adam's betas and SGD's momentum (its being zero or not guarded), which
the graph reads as 0-d tensor inputs
(number_inputs.py: a scheduler's new rate or momentum is not a new graph) unless the
frame computes with them itself; which parameters have a gradient (those without are
skipped, as the optimizer skips them); the metadata of every parameter and gradient;
the identity of every state tensor (made like their parameter, and load_state_dict
replaces them). Anything else (a closure, hooks, tensor hyperparameters, fused,
differentiable, sparse or complex groups) is Unsupported: the step runs natively.

What it changes on the optimizer, as torch.compile does: state is made at capture
time for a parameter that has a gradient and none yet, as the first step would make
it (Adam's zeros; SGD's momentum buffer as zeros, which the first update turns into
the gradient itself, exactly, when there is no dampening), and Adam's `state['step']`
moves to its parameter's device, so the bias corrections are computed there without
reading the step back to the host (Adam's `capturable` path). The optimizer run
natively afterwards accepts both.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import types
import weakref
from typing import TYPE_CHECKING, Callable

import torch

from torchweld.capture.sources import AttrSource, ItemSource, ModuleGlobalSource, ObjectKeySource, Source
from torchweld.capture.values import (
    ConstantValue, GuardedOnUseNumber, ListValue, TensorValue, TupleValue, Value, const,
)
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.objects import UserObjectValue
    from torchweld.capture.translator import Translator

_SCHEDULER_FILE = inspect.getsourcefile(torch.optim.lr_scheduler)
_SCHEDULER_WRAPPER_NAMES = ("_opt_called", "__get__", "__class__")  # what its wrapper reads and sets
_OPTIMIZER_MODULE = "torch.optim.optimizer"  # where the global step hooks are kept


def captures_step(obj: object) -> bool:
    """Whether `obj.step()` is emitted by this module: a stock Adam/AdamW/SGD with torch's
    step, called directly or through the wrapper an LR scheduler puts on the instance."""
    algorithm = ALGORITHMS.get(type(obj))
    if algorithm is None:
        return False
    fn = inspect.unwrap(type(obj).step)
    if (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) != algorithm.step:
        return False
    return "step" not in vars(obj) or is_scheduler_wrapper(vars(obj)["step"], obj)


def is_scheduler_wrapper(wrapper: object, opt: object) -> bool:
    """Whether `wrapper` is what torch.optim.lr_scheduler sets as `opt.step` (so that the
    scheduler can warn when it steps first): a closure over a weak reference to `opt` and
    the class's step, which sets `opt._opt_called = True` and calls that step, nothing else."""
    if not isinstance(wrapper, types.FunctionType) or not getattr(wrapper, "_wrapped_by_lr_sched", False):
        return False
    code = wrapper.__code__
    if code.co_filename != _SCHEDULER_FILE or code.co_names != _SCHEDULER_WRAPPER_NAMES:
        return False
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in wrapper.__closure__ or ())))
    opt_ref = cells.get("opt_ref")
    return isinstance(opt_ref, weakref.ref) and opt_ref() is opt and cells.get("func") is type(opt).step


class OptimizerStepValue(Value):
    """The bound `step` of a captured optimizer."""

    def __init__(self, optimizer: "UserObjectValue"):
        self.optimizer = optimizer
        self.source = AttrSource(optimizer.source, "step")

    def call(self, tx: "Translator", args: list[Value], kwargs: dict[str, Value]) -> Value:
        opt, source = self.optimizer.obj, self.optimizer.source
        algorithm = ALGORITHMS[type(opt)]
        if args or kwargs:
            raise Unsupported(f"{type(opt).__name__}.step() with a closure runs natively")
        guards = tx.output.guards
        guards.identity(AttrSource(AttrSource(source, "__class__"), "step"), type(opt).step)
        wrapper = vars(opt).get("step")
        if wrapper is None:  # and no scheduler wraps it later
            guards.identity(AttrSource(AttrSource(source, "step"), "__func__"), type(opt).step)
        else:  # an LR scheduler's: what it does besides stepping, done after the graph
            guards.identity(AttrSource(source, "step"), wrapper)
            self.optimizer.setattr(tx, "_opt_called", const(True))
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
            _no_hooks(guards, AttrSource(source, name), getattr(opt, name))
        for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
            _no_hooks(guards, ModuleGlobalSource(_OPTIMIZER_MODULE, name),
                      getattr(importlib.import_module(_OPTIMIZER_MODULE), name))
        groups_source = AttrSource(source, "param_groups")
        for i in range(len(opt.param_groups)):  # read as graph inputs (number_inputs.py)
            for path in algorithm.live.values():
                tx.output.number_input_sources.add(_source_at(ItemSource(groups_source, i), path).name())
        groups = self.optimizer.getattr(tx, "param_groups")
        updates = [_group_update(tx, opt, algorithm, source, group, real)
                   for group, real in zip(groups.items(tx), opt.param_groups)]
        was_enabled = tx.output.grad_enabled
        tx.output.set_grad_enabled(False)
        for settings, live_sources, by_device in updates:
            for (device, dtype), tensors in by_device.items():
                algorithm.emit(tx, settings, tensors, _LiveNumbers(tx, live_sources, device, dtype, tensors))
        tx.output.set_grad_enabled(was_enabled)
        return ConstantValue(None)

    def __repr__(self) -> str:
        return f"OptimizerStepValue({self.source})"


def _no_hooks(guards, source, hooks: dict) -> None:
    if hooks:
        raise Unsupported("an optimizer with step hooks runs natively")
    guards.length(source, type(hooks), 0)


# -- one param group ------------------------------------------------------------------


def _source_at(group: Source, path: tuple) -> Source:
    """The source of the entry at `path` in a param group (`("betas", 0)`: its beta1)."""
    for key in path:
        group = ItemSource(group, key)
    return group


def _value_at(tx: "Translator", entries: dict, path: tuple) -> Value | None:
    value = entries.get(path[0])
    for index in path[1:]:
        items = value.items(tx) if isinstance(value, (TupleValue, ConstantValue)) else []
        value = items[index] if index < len(items) else None
    return value


def _peek(value: Value) -> object:
    """A group entry's Python value, the numbers read as graph inputs (GuardedOnUseNumber,
    at the algorithm's live paths) without guarding their values."""
    if isinstance(value, GuardedOnUseNumber):
        return value.value
    if isinstance(value, TupleValue):
        return tuple(_peek(v) for v in value.elements)
    return value.as_constant()


def _group_update(tx: "Translator", opt: torch.optim.Optimizer, algorithm: "_Algorithm", opt_source,
                  group: Value, real: dict):
    """The settings of one param group (`group`, read from the real dict `real`), the
    sources of those of its numbers the graph reads as inputs ({"lr": source, ...}; the
    others are constants), and its tensors with gradients by (device, dtype):
    {key: {"param": [...], "grad": [...], and a list per state entry}}."""
    from torchweld.capture.builder import wrap

    name = type(opt).__name__
    entries = getattr(group, "entries", None)
    if entries is None or "lr" not in entries:
        raise Unsupported(f"a {name} param group that is not a dict with a learning rate")
    live_sources = {}
    for number, path in algorithm.live.items():
        value = _value_at(tx, entries, path)
        if isinstance(value, GuardedOnUseNumber):  # not computed with by the frame: unguarded
            live_sources[number] = value.source
    settings = {**algorithm.implied(opt), **{k: _peek(v) for k, v in entries.items() if k != "params"}}
    for number in algorithm.deciding:
        if number in live_sources:
            tx.output.guards.truthiness(live_sources[number], bool(_peek(_value_at(tx, entries, algorithm.live[number]))))
    if settings.get("fused") or settings.get("differentiable"):
        raise Unsupported(f"a fused or differentiable {name} runs natively")
    if not all(type(x) in (int, float) for x in algorithm.numbers(settings)):
        raise Unsupported(f"{name} with tensor hyperparameters runs natively")
    keys = algorithm.state_keys(settings)
    by_device: dict[tuple, dict[str, list]] = {}
    for param, p in zip(entries["params"].items(tx), real["params"]):
        if not isinstance(param, TensorValue):
            raise Unsupported("an optimizer parameter that is not a tensor")
        if p.grad is None:
            wrap(tx, None, AttrSource(param.source, "grad"))  # guards that it stays None
            continue
        if p.is_complex() or p.grad.is_sparse:
            raise Unsupported(f"{name} on complex parameters or sparse gradients runs natively")
        grad = wrap(tx, p.grad, AttrSource(param.source, "grad"))
        state = _state_of(opt, p, keys, settings, algorithm)
        state_source = ObjectKeySource(AttrSource(opt_source, "state"), param.source)
        lists = by_device.setdefault((p.device, p.dtype), {k: [] for k in ("param", "grad", *keys)})
        lists["param"].append(param)
        lists["grad"].append(grad)
        for k in keys:  # guarded by identity: made like their parameter (whose metadata is
            # guarded in full), and load_state_dict replaces them; ~1 us less per tensor
            lists[k].append(tx.output.input_tensor(ItemSource(state_source, k), state[k], by_identity=True))
    return settings, live_sources, by_device


def _state_of(opt: torch.optim.Optimizer, p: torch.Tensor, keys: tuple[str, ...], settings: dict,
              algorithm: "_Algorithm") -> dict:
    """`opt.state[p]`, made as the first step makes it where it has none of `keys` yet."""
    state = opt.state[p]
    algorithm.ready_state(state, p, settings)
    missing = [k for k in keys if not isinstance(state.get(k), torch.Tensor)]
    if missing:
        raise Unsupported(f"optimizer state without tensors {', '.join(missing)}")
    return state


class _LiveNumbers:
    """The terms an update computes from its live numbers (the learning rate, Adam's
    betas): Python numbers where those are constants, else 0-d graph inputs
    (number_inputs.py) that hold the term computed on the host, in the dtype of the
    tensors it meets."""

    def __init__(self, tx: "Translator", sources: dict, device: torch.device, param_dtype: torch.dtype,
                 tensors: dict[str, list]):
        self.tx, self.sources, self.device = tx, sources, device
        self.param_dtype = param_dtype
        steps = tensors.get("step")
        self.step_dtype = steps[0].fake.dtype if steps else param_dtype

    def term(self, name: str, value: float, dtype: torch.dtype, formula: str = "{}", compute=None):
        """`compute(value)` (`formula` spells it) of the live number `name` whose value is `value`."""
        source = self.sources.get(name)
        if source is None:
            return value if compute is None else compute(value)
        return self.tx.output.input_number(source, value, self.device, dtype, formula, compute)


@dataclasses.dataclass(frozen=True)
class _Algorithm:
    """What capture models of one optimizer class."""

    step: tuple[str, str]  # (module, qualname) of the `step` function it models
    live: dict[str, tuple]  # numbers read as graph inputs: name -> path in a param group
    deciding: tuple[str, ...]  # live numbers whose being zero decides the update's form: guarded so
    numbers: Callable[[dict], tuple]  # the settings that must be Python numbers
    implied: Callable[[torch.optim.Optimizer], dict]  # settings a group may lack (older torch)
    state_keys: Callable[[dict], tuple[str, ...]]  # the state tensors of each parameter
    # (state, parameter, settings): a parameter's state made as its first step makes it, if missing
    ready_state: Callable[[dict, torch.Tensor, dict], None]
    emit: Callable  # (tx, settings, tensors, live) -> None: the update of one (device, dtype) group


def _op(tx: "Translator"):
    def op(fn, *args):
        return tx.output.call_function(fn, [a if isinstance(a, Value) else const(a) for a in args], {})

    return op


# -- Adam, AdamW ----------------------------------------------------------------------


def _adam_state_keys(settings: dict) -> tuple[str, ...]:
    return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if settings["amsgrad"] else ())


def _ready_adam_state(state: dict, p: torch.Tensor, settings: dict) -> None:
    """Adam's first step's state if there is none, and its step on p's device (Adam's
    capturable path)."""
    if not state:
        scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        state["step"] = torch.zeros((), dtype=scalar_dtype, device=p.device)
        for k in _adam_state_keys(settings)[1:]:
            state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
    step = state.get("step")
    if isinstance(step, torch.Tensor) and step.device != p.device:
        state["step"] = step.to(p.device)


def _emit_adam(tx: "Translator", s: dict, tensors: dict[str, list], live: _LiveNumbers) -> None:
    """Adam's update of one (device, dtype) group, as its capturable foreach path runs it
    (with tensor betas and learning rate where `live` makes them graph inputs)."""
    op = _op(tx)

    def each(term):  # a foreach op's per-tensor list of one 0-d tensor
        return ListValue([term] * len(tensors["step"])) if isinstance(term, TensorValue) else term

    lr, (beta1, beta2), eps, weight_decay = s["lr"], s["betas"], s["eps"], s["weight_decay"]
    params, grads, exp_avgs, exp_avg_sqs, steps = (
        ListValue(tensors[k]) for k in ("param", "grad", "exp_avg", "exp_avg_sq", "step"))
    param_dtype, step_dtype = live.param_dtype, live.step_dtype
    if s["maximize"]:
        grads = op(torch._foreach_neg, grads)
    op(torch._foreach_add_, steps, 1)
    if weight_decay != 0:
        if s["decoupled_weight_decay"]:
            op(torch._foreach_mul_, params, live.term("lr", lr, param_dtype, f"1 - {{}} * {weight_decay!r}",
                                                      lambda x: 1 - x * weight_decay))
        else:  # grads + weight_decay * params, a new list: the gradients stay as they are
            grads = tx.output.call_function(torch._foreach_add, [grads, params], {"alpha": const(weight_decay)})
    op(torch._foreach_lerp_, exp_avgs, grads, each(live.term("beta1", beta1, param_dtype, "1 - {}", lambda b: 1 - b)))
    op(torch._foreach_mul_, exp_avg_sqs, live.term("beta2", beta2, param_dtype))
    one_minus_beta2 = live.term("beta2", beta2, param_dtype, "1 - {}", lambda b: 1 - b)
    if isinstance(one_minus_beta2, TensorValue):  # addcmul takes no tensor scale: Adam's own order
        op(torch._foreach_addcmul_, exp_avg_sqs, op(torch._foreach_mul, grads, one_minus_beta2), grads, 1)
    else:
        op(torch._foreach_addcmul_, exp_avg_sqs, grads, grads, one_minus_beta2)
    bias_correction1 = op(torch._foreach_pow, each(live.term("beta1", beta1, step_dtype)), steps)
    bias_correction2 = op(torch._foreach_pow, each(live.term("beta2", beta2, step_dtype)), steps)
    op(torch._foreach_sub_, bias_correction1, 1)
    op(torch._foreach_sub_, bias_correction2, 1)
    op(torch._foreach_neg_, bias_correction2)
    op(torch._foreach_div_, bias_correction1, live.term("lr", lr, step_dtype))
    op(torch._foreach_reciprocal_, bias_correction1)
    op(torch._foreach_sqrt_, bias_correction2)
    step_size, bias_correction2_sqrt = bias_correction1, bias_correction2
    if s["amsgrad"]:
        max_exp_avg_sqs = ListValue(tensors["max_exp_avg_sq"])
        op(torch._foreach_maximum_, max_exp_avg_sqs, exp_avg_sqs)
        denom = op(torch._foreach_sqrt, max_exp_avg_sqs)
    else:
        denom = op(torch._foreach_sqrt, exp_avg_sqs)
    op(torch._foreach_div_, denom, bias_correction2_sqrt)
    op(torch._foreach_add_, denom, eps)
    op(torch._foreach_div_, denom, step_size)
    op(torch._foreach_addcdiv_, params, exp_avgs, denom)


_ADAM = _Algorithm(
    step=("torch.optim.adam", "Adam.step"),
    # every LR scheduler changes the rate; OneCycleLR and CyclicLR cycle beta1 as momentum
    live={"lr": ("lr",), "beta1": ("betas", 0), "beta2": ("betas", 1)},
    deciding=(),
    numbers=lambda s: (s["lr"], *s["betas"], s["eps"], s["weight_decay"]),
    implied=lambda opt: {"decoupled_weight_decay": isinstance(opt, torch.optim.AdamW)},
    state_keys=_adam_state_keys,
    ready_state=_ready_adam_state,
    emit=_emit_adam,
)


# -- SGD ------------------------------------------------------------------------------


def _sgd_state_keys(settings: dict) -> tuple[str, ...]:
    return ("momentum_buffer",) if settings["momentum"] != 0 else ()


def _ready_sgd_state(state: dict, p: torch.Tensor, settings: dict) -> None:
    """A zero momentum buffer where there is none: the first update (buf * momentum +
    grad) makes it the gradient, as SGD's first step does by copying it; with
    dampening it would not."""
    if settings["momentum"] == 0 or isinstance(state.get("momentum_buffer"), torch.Tensor):
        return
    if settings["dampening"] != 0:
        raise Unsupported("SGD's first step with dampening runs natively (its momentum buffer is the gradient)")
    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _emit_sgd(tx: "Translator", s: dict, tensors: dict[str, list], live: _LiveNumbers) -> None:
    """SGD's update of one (device, dtype) group, as its foreach path runs it."""
    op = _op(tx)
    momentum, weight_decay = s["momentum"], s["weight_decay"]
    params, grads = ListValue(tensors["param"]), ListValue(tensors["grad"])
    if s["maximize"]:
        grads = op(torch._foreach_neg, grads)
    if weight_decay != 0:
        grads = tx.output.call_function(torch._foreach_add, [grads, params], {"alpha": const(weight_decay)})
    if momentum != 0:
        bufs = ListValue(tensors["momentum_buffer"])
        momentum_term = live.term("momentum", momentum, live.param_dtype)
        op(torch._foreach_mul_, bufs, momentum_term)
        tx.output.call_function(torch._foreach_add_, [bufs, grads], {"alpha": const(1 - s["dampening"])})
        if s["nesterov"]:
            if isinstance(momentum_term, TensorValue):
                addend, kwargs = op(torch._foreach_mul, bufs, momentum_term), {}
            else:
                addend, kwargs = bufs, {"alpha": const(momentum)}
            # SGD's multi-tensor path adds in place (to the gradients themselves where not
            # copied above); its one-tensor path (CPU tensors by default) makes new tensors
            if _runs_foreach(s, params):
                tx.output.call_function(torch._foreach_add_, [grads, addend], kwargs)
            else:
                grads = tx.output.call_function(torch._foreach_add, [grads, addend], kwargs)
        else:
            grads = bufs
    neg_lr = live.term("lr", s["lr"], live.param_dtype, "-{}", lambda x: -x)
    if isinstance(neg_lr, TensorValue):  # SGD's own form for a tensor rate
        op(torch._foreach_add_, params, op(torch._foreach_mul, grads, neg_lr))
    else:
        tx.output.call_function(torch._foreach_add_, [params, grads], {"alpha": const(neg_lr)})


def _runs_foreach(settings: dict, params: ListValue) -> bool:
    """Whether the optimizer runs its multi-tensor path on these parameters: its `foreach`
    setting, or where that is None, torch's default (tensors on a device with foreach
    kernels; the CPU has none)."""
    if settings.get("foreach") is not None:
        return bool(settings["foreach"])
    try:
        from torch.optim.optimizer import _get_foreach_kernels_supported_devices
        devices = _get_foreach_kernels_supported_devices()
    except ImportError:  # an older or newer torch: CUDA has them
        devices = ["cuda"]
    return all(p.fake.device.type in devices for p in params.elements)


_SGD = _Algorithm(
    step=("torch.optim.sgd", "SGD.step"),
    live={"lr": ("lr",), "momentum": ("momentum",)},  # OneCycleLR and CyclicLR cycle the momentum
    deciding=("momentum",),  # none (0) is another update: no buffer
    numbers=lambda s: (s["lr"], s["momentum"], s["dampening"], s["weight_decay"]),
    implied=lambda opt: {},
    state_keys=_sgd_state_keys,
    ready_state=_ready_sgd_state,
    emit=_emit_sgd,
)

ALGORITHMS: dict[type, _Algorithm] = {torch.optim.Adam: _ADAM, torch.optim.AdamW: _ADAM, torch.optim.SGD: _SGD}
