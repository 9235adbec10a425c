"""Torch operations that take a float read as a graph input as the 0-d tensor holding it.

A float that changes between calls (a temperature, a scale, a clip value passed as an
argument, or a config object's attribute) is read as a `values.GuardedOnUseNumber`: guarded
on its type only until capture needs its value. Where it meets a float32 or float64 tensor
in one of the operations below, the graph takes it as a 0-d tensor of that tensor's dtype,
refilled at each call (number_inputs.py), so that a new value is no new version. Only where
that tensor gives eager's result bit for bit:

- `+ - *` (operators, `torch.add/sub/mul` and the methods, in place too; without `alpha=`):
  aten rounds a Python scalar to the tensor's dtype and computes in it, as with the tensor.
- division by the number (`x / s`, `torch.div(x, s)`, `x.div_(s)`; no `rounding_mode`): on the
  CPU as a division by the tensor; on CUDA eager multiplies by the scalar's reciprocal (computed
  in the dtype), so the tensor holds that reciprocal and the graph multiplies by it.
- selections: `clamp`/`clip` bounds (every bound given a number read as an input),
  `clamp_min`, `clamp_max`, `torch.where(c, x, s)`, `masked_fill(m, s)`: the scalar is rounded
  to the dtype and selected or compared, as the tensor is.

Python arithmetic on such a number with constants (`2 * lr`, `1 - decay`, `-s`, `s / 4`) gives a
`values.DerivedNumber`, taken by the operations above as the number is: its holder computes the
arithmetic again from each call's value, in Python on the host, as eager's Python did
(`derived_number`; `1 / s` guards s nonzero). Anywhere else (`s / x`, `c / (2 * s)`, `x ** s`,
`torch.full(size, s)`, an integer or half tensor, two such numbers combined, a comparison of a
derived one) the number is a constant guarded on its value, as before.
"""
from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Callable

import torch

from torchweld.capture.values import DerivedNumber, GuardedOnUseNumber, TensorValue, Value

if TYPE_CHECKING:
    from torchweld.capture.output_graph import OutputGraph

_ARITHMETIC = "arithmetic"  # the number is the operand at position 1 (or 0 for an operator)
_DIVISION = "division"  # the number is the divisor, at position 1
_BOUNDS = "bounds"  # clamp's min and max
_SELECTED = "selected"  # where's / masked_fill's value

# target (a callable, or a Tensor method's name) -> (kind, the number's positions, its keyword names)
_OPERATIONS: dict[object, tuple[str, tuple[int, ...], tuple[str, ...]]] = {
    **{fn: (_ARITHMETIC, (0, 1), ()) for fn in (operator.add, operator.sub, operator.mul,
                                                 operator.iadd, operator.isub, operator.imul)},
    **{fn: (_ARITHMETIC, (1,), ("other",)) for fn in (torch.add, torch.sub, torch.subtract, torch.mul,
                                                       torch.multiply)},
    **{name: (_ARITHMETIC, (1,), ("other",)) for name in ("add", "add_", "sub", "sub_", "subtract", "subtract_",
                                                          "mul", "mul_", "multiply", "multiply_")},
    **{fn: (_DIVISION, (1,), ()) for fn in (operator.truediv, operator.itruediv)},
    **{fn: (_DIVISION, (1,), ("other",)) for fn in (torch.div, torch.divide, torch.true_divide)},
    **{name: (_DIVISION, (1,), ("other",)) for name in ("div", "div_", "divide", "divide_", "true_divide",
                                                        "true_divide_")},
    **{fn: (_BOUNDS, (1, 2), ("min", "max")) for fn in (torch.clamp, torch.clip)},
    **{name: (_BOUNDS, (1, 2), ("min", "max")) for name in ("clamp", "clamp_", "clip", "clip_")},
    **{fn: (_BOUNDS, (1,), ("min",)) for fn in (torch.clamp_min,)},
    **{fn: (_BOUNDS, (1,), ("max",)) for fn in (torch.clamp_max,)},
    **{name: (_BOUNDS, (1,), ("min",)) for name in ("clamp_min", "clamp_min_")},
    **{name: (_BOUNDS, (1,), ("max",)) for name in ("clamp_max", "clamp_max_")},
    torch.where: (_SELECTED, (1, 2), ("input", "other")),
    **{name: (_SELECTED, (2,), ("value",)) for name in ("masked_fill", "masked_fill_")},
}

# division on CUDA becomes a multiplication by the reciprocal the tensor holds
_AS_MULTIPLICATION = {operator.truediv: operator.mul, operator.itruediv: operator.imul, torch.div: torch.mul,
                      torch.divide: torch.mul, torch.true_divide: torch.mul, "div": "mul", "div_": "mul_",
                      "divide": "mul", "divide_": "mul_", "true_divide": "mul", "true_divide_": "mul_"}


def take_numbers(output: "OutputGraph", target: object, args: list[Value],
                 kwargs: dict[str, Value]) -> tuple[object, list[Value], dict[str, Value]]:
    """(target, args, kwargs) of the operation, with each float read as a graph input
    replaced by its 0-d tensor where this module's rules allow; unchanged elsewhere."""
    rule = _OPERATIONS.get(target) if isinstance(target, str) or _hashable(target) else None
    if rule is None:
        return target, args, kwargs
    kind, positions, names = rule
    slots = [("arg", i) for i in positions if i < len(args)] + [("kw", k) for k in names if k in kwargs]
    numbers = [slot for slot in slots if isinstance(_at(slot, args, kwargs), _NUMBER_INPUTS)]
    if not numbers or (kind == _ARITHMETIC and "alpha" in kwargs) or (kind == _DIVISION and _rounds(kwargs)):
        return target, args, kwargs
    if kind == _BOUNDS and not all(isinstance(_at(s, args, kwargs), _NUMBER_INPUTS)
                                   or _is_none(_at(s, args, kwargs)) for s in slots):
        return target, args, kwargs  # a bound that is a tensor or a constant: clamp takes both alike or not at all
    tensors = [v for v in [*args, *kwargs.values()] if isinstance(v, TensorValue)]
    if not tensors or len(numbers) > 1 and kind in (_ARITHMETIC, _SELECTED):
        return target, args, kwargs
    example = (tensors[1] if kind == _SELECTED and target is torch.where and len(tensors) > 1 else tensors[0]).example()
    if example.dtype not in (torch.float32, torch.float64) or example.device.type not in ("cpu", "cuda"):
        return target, args, kwargs
    args, kwargs = list(args), dict(kwargs)
    reciprocal = kind == _DIVISION and example.device.type == "cuda"
    for slot in numbers:
        number = _at(slot, args, kwargs)
        base, compute, formula = _computed_from(number)
        if reciprocal:
            held = output.input_number(base.source, base.value, example.device, example.dtype, f"1 / ({formula})",
                                       lambda x, compute=compute, of=_reciprocal_in(example.dtype): of(compute(x)))
        else:
            held = output.input_number(base.source, base.value, example.device, example.dtype, formula, compute)
        if slot[0] == "arg":
            args[slot[1]] = held
        else:
            kwargs[slot[1]] = held
    return (_AS_MULTIPLICATION[target] if reciprocal else target), args, kwargs


_NUMBER_INPUTS = (GuardedOnUseNumber, DerivedNumber)
# Python's arithmetic on floats that a number holder can do again at each call
_PYTHON_ARITHMETIC = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/"}


def _computed_from(number: Value) -> tuple[GuardedOnUseNumber, Callable[[float], float], str]:
    """(the float read as an input, the arithmetic from its value to `number`'s, that arithmetic
    spelled over `{}`)."""
    if isinstance(number, DerivedNumber):
        return number.base, number.compute, number.formula
    return number, _same_value, "{}"


def _same_value(x: float) -> float:
    return x


def derived_number(fn: Callable, a: Value, b: Value | None = None) -> DerivedNumber | None:
    """`a <fn> b` (or `fn(a)` for negation) where one operand is a float read as a graph input
    (or derived from one) and the other an int or float constant, as a DerivedNumber; None where
    that does not apply (the caller folds it as a constant, guarding the input's value).
    Dividing by the input itself (`1 / t`) guards it nonzero, so that a call with 0 is another
    version, which raises ZeroDivisionError at the user's line; by a number derived from it is
    left to the caller."""
    if b is None:
        if fn is not operator.neg or not isinstance(a, _NUMBER_INPUTS):
            return None
        base, compute, formula = _computed_from(a)
        return DerivedNumber(-a.value, base, lambda x: -compute(x), f"-({formula})")
    symbol = _PYTHON_ARITHMETIC.get(fn)
    flipped = not isinstance(a, _NUMBER_INPUTS)
    number, other = (b, a) if flipped else (a, b)
    if symbol is None or not isinstance(number, _NUMBER_INPUTS) or isinstance(other, (*_NUMBER_INPUTS, TensorValue)):
        return None
    if not other.is_constant():
        return None
    constant = other.as_constant()
    if type(constant) not in (int, float) or not math.isfinite(constant):
        return None
    if fn is operator.truediv and (constant == 0 if not flipped else
                                   isinstance(number, DerivedNumber) or number.value == 0):
        return None
    if fn is operator.truediv and flipped:
        number.guard_nonzero()
    base, compute, formula = _computed_from(number)
    if flipped:
        value = fn(constant, number.value)
        return DerivedNumber(value, base, lambda x: fn(constant, compute(x)), f"{constant!r} {symbol} ({formula})")
    value = fn(number.value, constant)
    return DerivedNumber(value, base, lambda x: fn(compute(x), constant), f"({formula}) {symbol} {constant!r}")


def _at(slot: tuple[str, object], args: list[Value], kwargs: dict[str, Value]) -> Value:
    return args[slot[1]] if slot[0] == "arg" else kwargs[slot[1]]


def _is_none(value: Value) -> bool:
    return not isinstance(value, TensorValue) and value.is_constant() and value.as_constant() is None


def _rounds(kwargs: dict[str, Value]) -> bool:
    return "rounding_mode" in kwargs and not _is_none(kwargs["rounding_mode"])


def _hashable(target: object) -> bool:
    try:
        hash(target)
    except TypeError:
        return False
    return True


def _reciprocal_in(dtype: torch.dtype) -> Callable[[float], float]:
    """1 / x computed as CUDA's division by a scalar computes it: the scalar rounded to `dtype`,
    divided in `dtype` (1 / 0 is inf, as there)."""
    def reciprocal(x: float) -> float:
        return (torch.ones((), dtype=dtype) / torch.tensor(x, dtype=dtype)).item()

    return reciprocal
