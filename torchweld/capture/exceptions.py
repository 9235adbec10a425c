"""Exceptions raised inside captured code: a `raise`, a missing dict key, an index out of
range, an exhausted iterator. Where eager would raise, capture raises `CapturedRaise`
holding an `ExceptionValue`; the Translator running the instruction unwinds to the handler
its code's exception table names (a `try` of the frame or of an inlined function, CPython
3.11+), which is captured like any other code. An exception no captured handler catches
ends the capture at the top-level instruction that raised it, which then runs natively and
raises it for real (a graph break)."""
from __future__ import annotations

import dis
import types
from typing import TYPE_CHECKING

from torchweld.capture.values import ConstantValue, TupleValue, Value, const
from torchweld.errors import Unsupported

if TYPE_CHECKING:
    from torchweld.capture.translator import Translator


class ExceptionValue(Value):
    """An exception object made in the frame: its class and its arguments."""

    def __init__(self, exc_type: type, args: list[Value]):
        if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
            raise Unsupported(f"raising {exc_type!r}, which is not an exception class")
        self.exc_type, self.args = exc_type, list(args)

    def python_type(self) -> type:
        return self.exc_type

    def as_constant(self) -> object:
        """The exception made for real (its arguments known), for `str(e)` and `e.args`."""
        return self.exc_type(*[a.as_constant() for a in self.args])

    def getattr(self, tx, name):
        if name == "args":
            return TupleValue(self.args)
        if name in ("__traceback__", "__context__", "__cause__"):
            raise Unsupported(f"reading {name} of an exception raised in captured code")
        return const(getattr(self.as_constant(), name))

    def __repr__(self) -> str:
        return f"ExceptionValue({self.exc_type.__name__}, {self.args})"


class CapturedRaise(Exception):
    """Raised by capture where eager raises `value`; the Translator unwinds it (see module doc)."""

    def __init__(self, value: ExceptionValue):
        super().__init__(value)
        self.value = value

    @classmethod
    def of(cls, exc_type: type, *args: object) -> "CapturedRaise":
        return cls(ExceptionValue(exc_type, [const(a) for a in args]))

    @classmethod
    def like(cls, error: BaseException) -> "CapturedRaise":
        """The raise of an exception that a capture-time evaluation (list.index) raised for real."""
        try:
            return cls(ExceptionValue(type(error), [const(a) for a in error.args]))
        except Unsupported:
            return cls(ExceptionValue(type(error), [ConstantValue(str(error))]))


def exception_of(value: Value) -> ExceptionValue:
    """What `raise value` raises: an exception object, or a class called with no arguments."""
    from torchweld.capture.objects import ClassValue

    if isinstance(value, ExceptionValue):
        return value
    if isinstance(value, ClassValue):
        return ExceptionValue(value.cls, [])
    raise Unsupported(f"raise of {value}, which capture does not model")


def handler_for(code: types.CodeType, offset: int):
    """The exception table entry covering `offset` (CPython 3.11+: one, the innermost), or None."""
    for entry in getattr(dis, "_parse_exception_table", lambda c: [])(code):
        if entry.start <= offset < entry.end:
            return entry
    return None


def unwind(tx: "Translator", raised: CapturedRaise, index: int) -> bool:
    """Send `raised`, raised by instruction `index`, to its handler in this frame: the stack cut
    to the handler's depth, the offset (lasti) and the exception pushed. False: none here."""
    entry = handler_for(tx.code, tx.instructions[index].offset)
    if entry is None:
        return False
    del tx.stack[entry.depth:]
    if entry.lasti:
        tx.push(ConstantValue(tx.instructions[index].offset))
    tx.push(raised.value)
    tx.jump_to(entry.target)
    return True
