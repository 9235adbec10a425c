"""Operators: binary, unary, comparisons, identity, membership and subscripts."""
from __future__ import annotations

import dis
import operator
import sys

from torchweld.capture import operators
from torchweld.capture.handlers import handles
from torchweld.capture.values import ConstantValue, TensorTruthValue, TensorValue, TupleValue, Value, slice_of
from torchweld.errors import Unsupported

BINARY_OPERATORS = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "//": operator.floordiv,
    "%": operator.mod, "**": operator.pow, "@": operator.matmul, "&": operator.and_, "|": operator.or_,
    "^": operator.xor, "<<": operator.lshift, ">>": operator.rshift,
    "+=": operator.iadd, "-=": operator.isub, "*=": operator.imul, "/=": operator.itruediv,
    "//=": operator.ifloordiv, "%=": operator.imod, "**=": operator.ipow, "@=": operator.imatmul,
    "&=": operator.iand, "|=": operator.ior, "^=": operator.ixor, "<<=": operator.ilshift, ">>=": operator.irshift,
}
COMPARE_OPERATORS = {
    "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">": operator.gt, ">=": operator.ge,
}


@handles("BINARY_OP")
def binary_op(tx, inst):
    b = tx.pop()
    a = tx.pop()
    symbol = dis._nb_ops[inst.arg][1]
    tx.push(operators.binary(tx, BINARY_OPERATORS[symbol], a, b))


@handles("COMPARE_OP")
def compare_op(tx, inst):
    b = tx.pop()
    a = tx.pop()
    result = operators.compare(tx, COMPARE_OPERATORS[inst.argval], a, b)
    tx.push(truth_value(tx, result) if compare_makes_bool(inst) else result)


def compare_makes_bool(inst) -> bool:
    """CPython 3.13 folds a TO_BOOL into a comparison that a jump reads: `bool(a > b)`."""
    return sys.version_info >= (3, 13) and bool(inst.arg & 16)


@handles("TO_BOOL", since=(3, 13))
def to_bool(tx, inst):
    tx.push(truth_value(tx, tx.pop()))


def truth_value(tx, value):
    """`bool(value)`, as TO_BOOL leaves it for the jump or `not` after it; of a tensor, a
    TensorTruthValue, on which that jump or `not` breaks the graph."""
    if isinstance(value, TensorValue):
        return TensorTruthValue(value)
    return ConstantValue(value.truth(tx))


@handles("UNARY_NEGATIVE")
def unary_negative(tx, inst):
    tx.push(operators.unary(tx, operator.neg, tx.pop()))


@handles("UNARY_NOT")
def unary_not(tx, inst):
    tx.push(operators.unary(tx, operator.not_, tx.pop()))


@handles("UNARY_INVERT")
def unary_invert(tx, inst):
    tx.push(operators.unary(tx, operator.invert, tx.pop()))


@handles("UNARY_POSITIVE", until=(3, 11))
def unary_positive(tx, inst):
    tx.push(operators.unary(tx, operator.pos, tx.pop()))


@handles("CALL_INTRINSIC_1", since=(3, 12))
def call_intrinsic_1(tx, inst):
    name = inst.argrepr
    if name == "INTRINSIC_UNARY_POSITIVE":
        tx.push(operators.unary(tx, operator.pos, tx.pop()))
    elif name == "INTRINSIC_LIST_TO_TUPLE":
        tx.push(TupleValue(tx.pop().items(tx)))
    else:
        raise Unsupported(f"unsupported intrinsic {name}")


@handles("IS_OP")
def is_op(tx, inst):
    b = tx.pop()
    a = tx.pop()
    tx.push(ConstantValue(operators.is_same(tx, a, b) != bool(inst.arg)))


@handles("CONTAINS_OP")
def contains_op(tx, inst):
    container = tx.pop()
    item = tx.pop()
    tx.push(ConstantValue(operators.contains(tx, item, container) != bool(inst.arg)))


@handles("BINARY_SUBSCR")
def binary_subscr(tx, inst):
    key = tx.pop()
    obj = tx.pop()
    tx.push(operators.getitem(tx, obj, key))


@handles("STORE_SUBSCR")
def store_subscr(tx, inst):
    key = tx.pop()
    obj = tx.pop()
    value = tx.pop()
    operators.setitem(tx, obj, key, value)


@handles("DELETE_SUBSCR")
def delete_subscr(tx, inst):
    key = tx.pop()
    obj = tx.pop()
    operators.delitem(tx, obj, key)


@handles("BINARY_SLICE", since=(3, 12))
def binary_slice(tx, inst):
    end = tx.pop()
    start = tx.pop()
    obj = tx.pop()
    tx.push(operators.getitem(tx, obj, _slice(start, end)))


@handles("STORE_SLICE", since=(3, 12))
def store_slice(tx, inst):
    end = tx.pop()
    start = tx.pop()
    obj = tx.pop()
    value = tx.pop()
    operators.setitem(tx, obj, _slice(start, end), value)


def _slice(start, end) -> Value:
    return slice_of([start, end])
