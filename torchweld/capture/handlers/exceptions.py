"""Raising and handling exceptions: `raise`, `assert`, and the opcodes of `except` blocks
(capture/exceptions.py unwinds a raise to the handler the exception table names)."""
from __future__ import annotations

from torchweld.capture.exceptions import CapturedRaise, ExceptionValue, exception_of
from torchweld.capture.handlers import handles
from torchweld.capture.values import ConstantValue
from torchweld.errors import Unsupported


@handles("CHECK_EXC_MATCH")
def check_exc_match(tx, inst):
    classes = tx.pop().as_constant()
    tx.push(ConstantValue(issubclass(tx.stack[-1].python_type(), classes)))


@handles("LOAD_ASSERTION_ERROR")
def load_assertion_error(tx, inst):
    from torchweld.capture.objects import ClassValue

    tx.push(ClassValue(AssertionError))


@handles("POP_EXCEPT")
def pop_except(tx, inst):
    if not tx.exc_stack:  # a resume function that starts inside an `except` block
        raise Unsupported("leaving an except block entered before this graph")
    tx.pop()  # the exception handled before this one, which is current again
    tx.exc_stack.pop()


@handles("PUSH_EXC_INFO")
def push_exc_info(tx, inst):
    exception = tx.pop()
    tx.push(tx.exc_stack[-1] if tx.exc_stack else ConstantValue(None))
    tx.exc_stack.append(exception)
    tx.push(exception)


@handles("RAISE_VARARGS")
def raise_varargs(tx, inst):
    if inst.arg == 0:  # a bare `raise`: the exception being handled
        if not tx.exc_stack:
            raise CapturedRaise.of(RuntimeError, "No active exception to reraise")
        raise CapturedRaise(tx.exc_stack[-1])
    if inst.arg == 2:
        tx.pop()  # `from cause`: the cause is not modelled, only what is raised
    raise CapturedRaise(exception_of(tx.pop()))


@handles("RERAISE")
def reraise(tx, inst):
    exception = tx.pop()
    if inst.arg:
        tx.pop()  # the offset the raise came from (lasti)
    if not isinstance(exception, ExceptionValue):
        raise Unsupported(f"re-raising {exception}, which capture does not model")
    raise CapturedRaise(exception)


@handles("WITH_EXCEPT_START")
def with_except_start(tx, inst):
    """An exception leaving a `with` block: its `__exit__` (fourth on the stack) is called with it."""
    from torchweld.capture.objects import ClassValue

    exception = tx.stack[-1]
    tx.push(tx.stack[-4].call(tx, [ClassValue(exception.python_type()), exception, ConstantValue(None)], {}))
