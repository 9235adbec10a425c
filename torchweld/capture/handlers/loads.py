"""Loading and storing names: fast locals, globals, closure cells, attributes, constants."""
from __future__ import annotations

import sys

from torchweld.capture.handlers import CALLABLE_BELOW_NULL, handles
from torchweld.capture.values import NULL, CellValue, ConstantValue, Value, const
from torchweld.errors import Unsupported


class _Unbound(Value):
    """What LOAD_FAST_AND_CLEAR saves for a local that had no value."""


UNBOUND = _Unbound()


@handles("LOAD_CONST")
def load_const(tx, inst):
    value = inst.argval
    if hasattr(value, "co_code"):  # a code object, for MAKE_FUNCTION
        tx.push(ConstantValue(value))
        return
    tx.push(const(value))


@handles("LOAD_FAST")
def load_fast(tx, inst):
    tx.push(_fast(tx, inst.argval))


def _fast(tx, name: str) -> Value:
    if sys.version_info >= (3, 13) and (name in tx.code.co_cellvars or name in tx.code.co_freevars):
        return tx.cell(name)  # 3.13 loads a closure's cells with LOAD_FAST (LOAD_CLOSURE before)
    return tx.load_local(name)


handles("LOAD_FAST_CHECK", since=(3, 12))(load_fast)


@handles("LOAD_FAST_LOAD_FAST", since=(3, 13))
def load_fast_load_fast(tx, inst):
    for name in inst.argval:
        tx.push(_fast(tx, name))


@handles("LOAD_FAST_AND_CLEAR", since=(3, 12))
def load_fast_and_clear(tx, inst):
    name = inst.argval
    value = tx.load_local(name) if (name in tx.locals or name in tx.pending_locals) else UNBOUND
    tx.locals.pop(name, None)
    tx.pending_locals.pop(name, None)
    tx.push(value)


@handles("STORE_FAST")
def store_fast(tx, inst):
    value = tx.pop()
    if value is UNBOUND:
        tx.locals.pop(inst.argval, None)
    else:
        tx.store_local(inst.argval, value)


@handles("STORE_FAST_STORE_FAST", since=(3, 13))
def store_fast_store_fast(tx, inst):
    for name in inst.argval:  # the top of the stack goes to the first name
        store_fast(tx, _named(inst, name))


@handles("STORE_FAST_LOAD_FAST", since=(3, 13))
def store_fast_load_fast(tx, inst):
    stored, loaded = inst.argval
    store_fast(tx, _named(inst, stored))
    tx.push(_fast(tx, loaded))


def _named(inst, name: str):
    """One half of a 3.13 superinstruction on two locals, as the plain instruction's handler reads it."""
    return inst._replace(argval=name)


@handles("DELETE_FAST")
def delete_fast(tx, inst):
    tx.load_local(inst.argval)
    tx.locals.pop(inst.argval, None)


@handles("LOAD_GLOBAL")
def load_global(tx, inst):
    push_maybe_callable(tx, tx.load_global(inst.argval), with_null=bool(inst.arg & 1))


def push_maybe_callable(tx, value: Value, with_null: bool) -> None:
    """Push `value`, and where the instruction loads a callable for CALL, a NULL in CPython's order."""
    if with_null and not CALLABLE_BELOW_NULL:
        tx.push(NULL)
    tx.push(value)
    if with_null and CALLABLE_BELOW_NULL:
        tx.push(NULL)


@handles("STORE_GLOBAL")
def store_global(tx, inst):
    tx.store_global(inst.argval, tx.pop())


@handles("MAKE_CELL")
def make_cell(tx, inst):
    name = inst.argval
    if name in tx.locals or name in tx.pending_locals:
        tx.cells[name] = CellValue(tx.load_local(name))
    else:
        tx.cells[name] = CellValue()


@handles("COPY_FREE_VARS")
def copy_free_vars(tx, inst):
    pass  # free variables were bound when the Translator was made


@handles("LOAD_CLOSURE")
def load_closure(tx, inst):
    tx.push(tx.cell(inst.argval))


@handles("LOAD_DEREF")
def load_deref(tx, inst):
    cell = tx.cell(inst.argval)
    tx.push(cell.load() if isinstance(cell, CellValue) else cell.load(tx))


@handles("STORE_DEREF")
def store_deref(tx, inst):
    cell = tx.cell(inst.argval)
    if not isinstance(cell, CellValue):
        raise Unsupported(f"assigning closure variable {inst.argval!r} of an enclosing function is a side effect capture does not model yet")
    cell.contents = tx.pop()


@handles("LOAD_ATTR")
def load_attr(tx, inst):
    obj = tx.pop()
    method_form = sys.version_info >= (3, 12) and inst.arg & 1
    # the method form is loaded as a bound method, with a NULL beside it: [NULL, method] or [method, NULL]
    push_maybe_callable(tx, attribute(tx, obj, inst.argval), with_null=bool(method_form))


def attribute(tx, obj: Value, name: str) -> Value:
    """`obj.name`; `obj.__class__` is the type capture knows it by (fixed by the guard on `obj`,
    or made in the frame), for any kind of value: torchvision reads a function's."""
    from torchweld.capture.new_objects import NewObjectValue
    from torchweld.capture.objects import ClassValue

    if name == "__class__" and not isinstance(obj, NewObjectValue):
        return ClassValue(obj.python_type())
    return obj.getattr(tx, name)


@handles("LOAD_METHOD", until=(3, 11))
def load_method(tx, inst):
    obj = tx.pop()
    tx.push(NULL)
    tx.push(obj.getattr(tx, inst.argval))


@handles("DELETE_ATTR")
def delete_attr(tx, inst):
    from torchweld.capture.new_objects import NewObjectValue

    obj = tx.pop()
    if not isinstance(obj, NewObjectValue):
        raise Unsupported(f"deleting attribute {inst.argval!r} of {obj}, an object from outside the frame")
    obj.delete(inst.argval)


@handles("STORE_ATTR")
def store_attr(tx, inst):
    obj = tx.pop()
    value = tx.pop()
    obj.setattr(tx, inst.argval, value)


@handles("IMPORT_NAME")
def import_name(tx, inst):
    from torchweld.capture.objects import PythonModuleValue

    fromlist = tx.pop().as_constant()
    level = tx.pop().as_constant()
    name = inst.argval
    if level != 0 or name not in sys.modules:
        raise Unsupported(f"import of {name!r}, which is not imported yet, runs its module's code")
    module = sys.modules[name]
    if not fromlist:
        module = sys.modules[name.partition(".")[0]]
    tx.push(PythonModuleValue(module, tx.output.guards.source_of(module)))  # its attributes read (and guarded) anew


@handles("IMPORT_FROM")
def import_from(tx, inst):
    tx.push(tx.stack[-1].getattr(tx, inst.argval))


@handles("LOAD_SUPER_ATTR", since=(3, 12))
def load_super_attr(tx, inst):
    from torchweld.capture.builtins import _super

    owner = tx.pop()
    cls = tx.pop()
    tx.pop()  # the global `super`
    value = _super(tx, cls, owner).getattr(tx, inst.argval)
    push_maybe_callable(tx, value, with_null=bool(inst.arg & 1))  # the method form, as LOAD_ATTR's
