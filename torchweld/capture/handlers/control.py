"""Jumps, loops and returns. A jump on a value known at capture time is taken
or not; a jump on a tensor's value ends the capture (data-dependent control flow)."""
from __future__ import annotations

import sys

from torchweld.capture import operators
from torchweld.capture.handlers import handles
from torchweld.capture.values import ConstantValue, IteratorValue, TensorValue
from torchweld.errors import Unsupported

_JUMP_IF = [
    ("POP_JUMP_IF_FALSE", False), ("POP_JUMP_IF_TRUE", True),
    ("POP_JUMP_FORWARD_IF_FALSE", False), ("POP_JUMP_FORWARD_IF_TRUE", True),
    ("POP_JUMP_BACKWARD_IF_FALSE", False), ("POP_JUMP_BACKWARD_IF_TRUE", True),
]
_JUMP_IF_NONE = [
    ("POP_JUMP_IF_NONE", True), ("POP_JUMP_IF_NOT_NONE", False),
    ("POP_JUMP_FORWARD_IF_NONE", True), ("POP_JUMP_FORWARD_IF_NOT_NONE", False),
    ("POP_JUMP_BACKWARD_IF_NONE", True), ("POP_JUMP_BACKWARD_IF_NOT_NONE", False),
]


def _truth(tx, value) -> bool:
    if isinstance(value, TensorValue):
        raise Unsupported("data-dependent control flow: branching on a tensor's value")
    return value.truth(tx)


def _register_jump_if(name: str, when: bool) -> None:
    def pop_jump_if(tx, inst):
        if _truth(tx, tx.pop()) is when:
            tx.jump_to(inst.argval)
    pop_jump_if.__name__ = name.lower()
    handles(name, since=(3, 12) if "FORWARD" not in name and "BACKWARD" not in name else None,
            until=(3, 11) if ("FORWARD" in name or "BACKWARD" in name) else None)(pop_jump_if)


def _register_jump_if_none(name: str, when_none: bool) -> None:
    def pop_jump_if_none(tx, inst):
        is_none = operators.is_same(tx, tx.pop(), ConstantValue(None))
        if is_none is when_none:
            tx.jump_to(inst.argval)
    pop_jump_if_none.__name__ = name.lower()
    versioned = "FORWARD" in name or "BACKWARD" in name
    handles(name, since=None if versioned else (3, 12), until=(3, 11) if versioned else None)(pop_jump_if_none)


for _name, _when in _JUMP_IF:
    _register_jump_if(_name, _when)
for _name, _when in _JUMP_IF_NONE:
    _register_jump_if_none(_name, _when)


@handles("JUMP_IF_FALSE_OR_POP", "JUMP_IF_TRUE_OR_POP", until=(3, 11))
def jump_if_or_pop(tx, inst):
    when = inst.opname == "JUMP_IF_TRUE_OR_POP"
    if _truth(tx, tx.stack[-1]) is when:
        tx.jump_to(inst.argval)
    else:
        tx.pop()


@handles("JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT")
def jump(tx, inst):
    tx.jump_to(inst.argval)


@handles("GET_ITER")
def get_iter(tx, inst):
    value = tx.pop()
    tx.push(value if isinstance(value, IteratorValue) else IteratorValue(value.items(tx)))


@handles("FOR_ITER")
def for_iter(tx, inst):
    iterator = tx.stack[-1]
    if not isinstance(iterator, IteratorValue):
        raise Unsupported(f"for-loop over {iterator}")
    item = iterator.next()
    if item is not None:
        tx.push(item)
        return
    tx.pop()
    tx.jump_to(inst.argval)
    if sys.version_info >= (3, 12) and tx.instructions[tx.ip].opname == "END_FOR":
        # the exhausted iterator is popped here, so FOR_ITER skips the END_FOR (3.12), or
        # the END_FOR and the POP_TOP after it (3.13), that pop it on other paths
        tx.ip += 1 if sys.version_info < (3, 13) else 2


@handles("RETURN_VALUE")
def return_value(tx, inst):
    tx.returned = tx.pop()


@handles("RETURN_CONST", since=(3, 12))
def return_const(tx, inst):
    from torchweld.capture.values import const

    tx.returned = const(inst.argval)


@handles("RETURN_GENERATOR")
def return_generator(tx, inst):
    if tx.yielded is None and not tx.is_generator:
        raise Unsupported("generators are not captured; the generator runs eagerly")
    tx.push(ConstantValue(None))  # the generator object, popped right away


@handles("YIELD_VALUE")
def yield_value(tx, inst):
    if tx.is_generator:  # a generator advanced by its consumer: pause here (capture/generators.py)
        tx.paused_at = tx.pop()
    elif tx.yielded is not None:
        tx.yielded.append(tx.pop())
    else:
        raise Unsupported("yield outside a generator")
    tx.push(ConstantValue(None))  # what the consumer sends back
