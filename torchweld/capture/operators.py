"""Python's operators on Values: folded at capture time when every operand is a
constant, a graph node when a tensor takes part, container semantics otherwise."""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Callable

import torch

from torchweld.capture.collection_values import set_operator
from torchweld.capture.exceptions import CapturedRaise
from torchweld.capture.number_operands import derived_number
from torchweld.capture.values import (
    ConstantValue, DictValue, GuardedOnUseNumber, ListValue, NullValue, SequenceValue, SymNumberValue, TensorTruthValue,
    TensorValue, TupleValue, Value, const,
)
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator

_INPLACE_TO_PLAIN = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.imod: operator.mod,
    operator.ipow: operator.pow, operator.imatmul: operator.matmul, operator.iand: operator.and_,
    operator.ior: operator.or_, operator.ixor: operator.xor, operator.ilshift: operator.lshift,
    operator.irshift: operator.rshift,
}


def _fold(fn: Callable, *args: Value) -> Value:
    values = [a.as_constant() for a in args]
    try:
        result = fn(*values)
    except Exception as e:  # the eager run raises the same error at the user's line
        raise CapturedRaise.like(e) from None
    return const(result)


def binary(tx: "Translator", fn: Callable, a: Value, b: Value) -> Value:
    """`a <fn> b` for an operator function such as operator.add or operator.iadd."""
    if isinstance(a, TensorValue) or isinstance(b, TensorValue):
        if not isinstance(a, TensorValue):  # `n += t` of a number: Python computes `n + t`, a new tensor
            fn = _INPLACE_TO_PLAIN.get(fn, fn)
        return tx.output.call_function(fn, [a, b], {})  # a float read as an input: number_operands.py
    derived = derived_number(_INPLACE_TO_PLAIN.get(fn, fn), a, b)  # `2 * lr` of a float read as an input
    if derived is not None:
        return derived
    if _symbolic_number(a, b):  # `x.shape[0] // 2`: a graph value; its example a SymInt
        plain = _INPLACE_TO_PLAIN.get(fn, fn)
        if plain in _DIVIDING and isinstance(b, SymNumberValue):
            # guarded nonzero (its answer at capture): a call with 0 must not reach a graph that
            # divides by it, where the ZeroDivisionError would escape the user's `try`
            bool(b.sym != 0)
        return tx.output.call_function(plain, [a, b], {})
    on_sets = set_operator(tx, _INPLACE_TO_PLAIN.get(fn, fn), fn in _INPLACE_TO_PLAIN, a, b)
    if on_sets is not None:
        return on_sets
    if a.is_constant() and b.is_constant() and not isinstance(a, ListValue):
        return _fold(_INPLACE_TO_PLAIN.get(fn, fn), a, b)
    plain = _INPLACE_TO_PLAIN.get(fn, fn)
    if isinstance(a, SequenceValue) or isinstance(b, SequenceValue):
        return _sequence_binary(tx, fn, plain, a, b)
    if isinstance(a, DictValue) and isinstance(b, DictValue) and plain is operator.or_:
        return DictValue({**a.entries, **b.entries})
    raise Unsupported(f"operator {plain.__name__} on {a} and {b} is not supported in capture")


def _sequence_binary(tx, fn, plain, a: Value, b: Value) -> Value:
    if plain is operator.add and isinstance(b, SequenceValue) and not isinstance(a, SequenceValue) and a.is_constant():
        left = a.as_constant()  # `(-1,) + x.shape[1:]` with a symbolic size on the right
        if isinstance(left, tuple) and issubclass(b.python_type(), tuple):
            return TupleValue(a.items(tx) + b.items(tx))
        if type(left) is list and issubclass(b.python_type(), list):
            return ListValue(a.items(tx) + b.items(tx))
    if plain is operator.add and isinstance(a, SequenceValue):
        right = b.items(tx)
        if fn is operator.iadd and isinstance(a, ListValue):
            a.mutate(tx)
            a.elements.extend(right)
            return a
        return type(a)(a.items(tx) + right)
    if plain is operator.mul:
        seq, count = (a, b) if isinstance(a, SequenceValue) else (b, a)
        return type(seq)(seq.items(tx) * count.as_constant())
    raise Unsupported(f"operator {plain.__name__} on {a.python_type().__name__} and {b.python_type().__name__}")


def unary(tx: "Translator", fn: Callable, a: Value) -> Value:
    if fn is operator.not_ and isinstance(a, TensorTruthValue):  # 3.13: `not` after TO_BOOL
        a = a.tensor
    if isinstance(a, TensorValue):
        if fn is operator.not_:
            raise Unsupported("data-dependent control flow: `not` of a tensor needs its value")
        return tx.output.call_function(fn, [a], {})
    if fn is operator.not_:
        return ConstantValue(not a.truth(tx))
    if isinstance(a, SymNumberValue):
        return tx.output.call_function(fn, [a], {})
    derived = derived_number(fn, a)  # `-lr`
    if derived is not None:
        return derived
    return _fold(fn, a)


_COMPARISON_SYMBOLS = {operator.lt: "<", operator.le: "<=", operator.gt: ">", operator.ge: ">=",
                       operator.eq: "==", operator.ne: "!="}


def compare(tx: "Translator", fn: Callable, a: Value, b: Value) -> Value:
    if isinstance(a, TensorValue) or isinstance(b, TensorValue):
        return tx.output.call_function(fn, [a, b], {})
    decided = _compared_input_number(tx, fn, a, b)
    if decided is not None:
        return decided
    if _symbolic_number(a, b):  # `x.shape[0] > 4`: decided now; the ShapeEnv records the answer as a guard
        try:
            return ConstantValue(bool(fn(a.example(), b.example())))
        except TypeError:
            pass
    return _fold(fn, a, b)


def _compared_input_number(tx: "Translator", fn: Callable, a: Value, b: Value) -> Value | None:
    """`lr > 0.5` of a float read as a graph input and a constant number: decided now and
    guarded on its answer, so that another value with the same answer is no new version."""
    symbol = _COMPARISON_SYMBOLS.get(fn)
    number, other, flipped = (a, b, False) if isinstance(a, GuardedOnUseNumber) else (b, a, True)
    if symbol is None or not isinstance(number, GuardedOnUseNumber) or isinstance(other, GuardedOnUseNumber) \
            or not other.is_constant() or type(other.as_constant()) not in (int, float, bool):
        return None
    value = other.as_constant()
    outcome = bool(fn(value, number.value) if flipped else fn(number.value, value))
    if flipped:  # `0.5 < lr` is `lr > 0.5`
        symbol = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}.get(symbol, symbol)
    tx.output.guards.comparison(number.source, symbol, value, outcome)
    return ConstantValue(outcome)


_DIVIDING = (operator.floordiv, operator.truediv, operator.mod)


def _symbolic_number(a: Value, b: Value) -> bool:
    """One operand is a symbolic size and the other a number (or another symbolic size)."""
    if not (isinstance(a, SymNumberValue) or isinstance(b, SymNumberValue)):
        return False
    other = b if isinstance(a, SymNumberValue) else a
    return isinstance(other, SymNumberValue) or (other.is_constant() and type(other.as_constant()) in (int, float, bool))


def is_same(tx: "Translator", a: Value, b: Value) -> bool:
    """`a is b`, decided at capture time."""
    if a is b:
        return True
    if isinstance(a, TensorValue) and isinstance(b, TensorValue):
        if a.node is not b.node and a.source is not None and b.source is not None:
            tx.output.guards.distinct(a.source, b.source)  # two tensors now: fn(a, a) later is a miss
        # an operation that returns its input itself (`x.to(x.dtype)`, `x.contiguous()`, `x.add_(1)`)
        # returns its fake itself too, decided by what the guards hold (dtype, strides)
        return a.node is b.node or a.fake is b.fake
    a_const, b_const = a.is_constant(), b.is_constant()
    if a_const and b_const:
        return a.as_constant() is b.as_constant()
    if a_const or b_const:  # a constant is never the same object as a tensor or container
        known = a.as_constant() if a_const else b.as_constant()
        if known is None or isinstance(known, (bool, int, float, str)):
            return False
    if isinstance(a, NullValue) or isinstance(b, NullValue):
        return False
    from torchweld.capture.new_objects import NewObjectValue

    if isinstance(a, NewObjectValue) or isinstance(b, NewObjectValue):  # made in the frame: nothing else is it
        return False
    real_a, real_b = a.real_object(), b.real_object()
    if real_a is not None and real_b is not None and a.source is not None and b.source is not None:
        tx.output.guards.identity(a.source, real_a)  # sentinels such as dataclasses' markers
        tx.output.guards.identity(b.source, real_b)
        return real_a is real_b
    raise Unsupported(f"cannot decide at capture time whether {a} is {b}")


def python_dunder(tx: "Translator", obj: Value, name: str, args: list[Value]) -> Value | None:
    """`obj.<name>(*args)` when `obj` is a user object whose class defines it in Python."""
    from torchweld.capture.new_objects import NewObjectValue
    from torchweld.capture.objects import UserObjectValue

    if not isinstance(obj, (UserObjectValue, NewObjectValue)):
        return None
    import inspect
    import types

    if not isinstance(inspect.getattr_static(obj.python_type(), name, None), types.FunctionType):
        return None
    return obj.getattr(tx, name).call(tx, args, {})


# the most values `n in (...)` of a symbolic int guards one by one (`n in range(10**6)` reads n's value)
_MEMBERSHIP_GUARDS = 16


def contains(tx: "Translator", item: Value, container: Value) -> bool:
    via_dunder = python_dunder(tx, container, "__contains__", [item])
    if via_dunder is not None:
        return via_dunder.truth(tx)
    if isinstance(container, DictValue):
        return item.as_constant() in container.entries
    if hasattr(container, "contains"):  # os.environ
        return container.contains(tx, item)
    from torchweld.capture.new_objects import NewObjectValue

    if isinstance(container, NewObjectValue) and container.entries is not None:  # a dict subclass made in the frame
        return item.as_constant() in container.entries.entries
    if isinstance(container, TensorValue) or isinstance(item, TensorValue):
        raise Unsupported("data-dependent: `in` on a tensor needs its values")
    if isinstance(item, SymNumberValue) and container.is_constant():
        values = container.as_constant()
        if isinstance(values, (tuple, list, set, frozenset, range)) and len(values) <= _MEMBERSHIP_GUARDS and \
                all(type(v) in (int, float, bool) for v in values):
            # `n in (1, 2)` of a symbolic int: each `n == v` decided now, the ShapeEnv guarding its
            # answer (`n != 1`), not n's value: another value outside the set is no new version
            return any(bool(item.sym == v) for v in values)
    if isinstance(container, SequenceValue):
        for element in container.elements:
            if isinstance(element, TensorValue) or isinstance(item, TensorValue):
                raise Unsupported("`in` over a container of tensors compares their values")
        return item.as_constant() in container.as_constant()
    return item.as_constant() in container.as_constant()


def getitem(tx: "Translator", obj: Value, key: Value) -> Value:
    via_dunder = python_dunder(tx, obj, "__getitem__", [key])
    if via_dunder is not None:
        return via_dunder
    if isinstance(obj, TensorValue):
        return tx.output.call_function(operator.getitem, [obj, key], {})
    if isinstance(obj, (SequenceValue, DictValue)) or hasattr(obj, "getitem"):
        return obj.getitem(tx, key)
    return _fold(operator.getitem, obj, key)


def setitem(tx: "Translator", obj: Value, key: Value, value: Value) -> None:
    if isinstance(obj, TensorValue):
        tx.output.call_function(operator.setitem, [obj, key, value], {})
        return
    if isinstance(obj, ListValue):
        obj.mutate(tx)
        k = key.as_constant()
        try:
            if isinstance(k, slice):
                obj.elements[k] = value.items(tx)
            else:
                obj.elements[k] = value
        except (IndexError, TypeError, ValueError) as e:
            raise CapturedRaise.like(e) from None
        return
    if isinstance(obj, DictValue):
        obj.mutate(tx)
        obj.entries[key.as_constant()] = value
        return
    if python_dunder(tx, obj, "__setitem__", [key, value]) is not None:
        return
    from torchweld.capture.new_objects import NewObjectValue

    if isinstance(obj, NewObjectValue):  # a dict subclass made in the frame
        obj.setitem(tx, key, value)
        return
    raise Unsupported(f"item assignment on {obj} is not supported in capture")


def delitem(tx: "Translator", obj: Value, key: Value) -> None:
    if isinstance(obj, (ListValue, DictValue)):
        obj.mutate(tx)
        container = obj.elements if isinstance(obj, ListValue) else obj.entries
        k = key.as_constant()
        try:
            del container[k]
        except (LookupError, TypeError) as e:
            raise CapturedRaise.like(e) from None
        return
    raise Unsupported(f"del on items of {obj} is not supported in capture")


def tuple_of(tx: "Translator", value: Value) -> TupleValue:
    return TupleValue(value.items(tx))
