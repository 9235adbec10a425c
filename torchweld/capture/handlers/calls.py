"""Calls, function creation and `with` blocks."""
from __future__ import annotations

from torchweld.capture.callables import NestedFunctionValue
from torchweld.capture.autocast import context_of_object
from torchweld.capture.handlers import CALLABLE_BELOW_NULL, handles
from torchweld.capture.python_contexts import python_context_of
from torchweld.capture.values import ContextManagerValue, DictValue, NullValue
from torchweld.errors import Unsupported


def callable_and_args(below: list, args: list) -> tuple:
    """The callee and its positional arguments, from the two slots `below` the arguments:
    [NULL, fn] or [fn, self] on CPython 3.11-3.12, [fn, NULL] or [fn, self] on 3.13."""
    first, second = below
    if CALLABLE_BELOW_NULL:
        return (first, args) if isinstance(second, NullValue) else (first, [second, *args])
    return (second, args) if isinstance(first, NullValue) else (first, [second, *args])


def _call(tx, n_args: int, kw_names: tuple[str, ...]) -> None:
    args = tx.popn(n_args)
    fn, args = callable_and_args(tx.popn(2), args)
    kwargs = {}
    if kw_names:
        kwargs = dict(zip(kw_names, args[len(args) - len(kw_names):]))
        args = args[: len(args) - len(kw_names)]
    tx.push(fn.call(tx, args, kwargs))


@handles("CALL")
def call(tx, inst):
    kw_names, tx.kw_names = tx.kw_names or (), None  # KW_NAMES before it (3.11, 3.12)
    _call(tx, inst.arg, kw_names)


@handles("CALL_KW", since=(3, 13))
def call_kw(tx, inst):
    _call(tx, inst.arg, tx.pop().as_constant())  # the keywords' names, above the arguments


@handles("CALL_FUNCTION_EX")
def call_function_ex(tx, inst):
    kwargs = tx.pop() if inst.arg & 1 else DictValue({})
    args = tx.pop()
    if not isinstance(kwargs, DictValue):
        raise Unsupported(f"**{kwargs} in a call")
    fn, positional = callable_and_args(tx.popn(2), args.items(tx))
    tx.push(fn.call(tx, positional, {str(k): v for k, v in kwargs.entries.items()}))


@handles("MAKE_FUNCTION")
def make_function(tx, inst):
    code = tx.pop().as_constant()
    function = NestedFunctionValue(code, tx.f_globals, (), {}, ())
    flags = inst.arg or 0  # 3.13 makes a bare function and sets each part with SET_FUNCTION_ATTRIBUTE
    for flag in (0x08, 0x04, 0x02, 0x01):
        if flags & flag:
            function = _with_attribute(tx, function, flag, tx.pop())
    tx.push(function)


@handles("SET_FUNCTION_ATTRIBUTE", since=(3, 13))
def set_function_attribute(tx, inst):
    function = tx.pop()
    tx.push(_with_attribute(tx, function, inst.arg, tx.pop()))


def _with_attribute(tx, function: NestedFunctionValue, flag: int, value) -> NestedFunctionValue:
    """`function` with its closure (0x08), annotations (0x04), keyword defaults (0x02) or defaults (0x01)."""
    code, defaults, kwdefaults, closure = function.code, function.defaults, function.kwdefaults, function.closure
    if flag == 0x08:
        closure = tuple(value.items(tx))
    elif flag == 0x02:
        kwdefaults = dict(value.entries)
    elif flag == 0x01:
        defaults = tuple(value.items(tx))
    return NestedFunctionValue(code, tx.f_globals, defaults, kwdefaults, closure)


@handles("BEFORE_WITH")
def before_with(tx, inst):
    context = tx.pop()
    if not isinstance(context, ContextManagerValue):  # an autocast object made outside, guarded as that object
        obj = context.real_object()
        known = context_of_object(obj)
        if known is not None and context.source is not None:
            tx.output.guards.identity(context.source, obj)
            context = known
    if not isinstance(context, ContextManagerValue):
        context = python_context_of(tx, context) or context  # __enter__ and __exit__ in Python: inlined
    if not isinstance(context, ContextManagerValue):
        raise Unsupported(f"`with` on {context}: capture inlines context managers whose __enter__ and __exit__ "
                          "are Python functions, and knows torch.no_grad/enable_grad/set_grad_enabled and "
                          "torch.autocast; this one runs in Python")
    tx.push(context.exit_value())
    tx.push(context.enter(tx))

