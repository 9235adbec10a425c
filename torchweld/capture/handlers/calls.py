"""Calls, function creation and `with` blocks."""
from __future__ import annotations

from torchweld.capture.callables import NestedFunctionValue
from torchweld.capture.autocast import context_of_object
from torchweld.capture.handlers import handles
from torchweld.capture.values import ContextManagerValue, DictValue, NullValue
from torchweld.errors import Unsupported


def _callable_and_args(tx, args: list) -> tuple:
    """Pop the two slots below the arguments: [NULL, fn] or [fn, self]."""
    second = tx.pop()
    first = tx.pop()
    if isinstance(first, NullValue):
        return second, args
    return first, [second, *args]


@handles("CALL")
def call(tx, inst):
    args = tx.popn(inst.arg)
    fn, args = _callable_and_args(tx, args)
    kwargs = {}
    if tx.kw_names:
        names = tx.kw_names
        kwargs = dict(zip(names, args[len(args) - len(names):]))
        args = args[: len(args) - len(names)]
    tx.kw_names = None
    tx.push(fn.call(tx, args, kwargs))


@handles("CALL_FUNCTION_EX")
def call_function_ex(tx, inst):
    kwargs = tx.pop() if inst.arg & 1 else DictValue({})
    args = tx.pop()
    if not isinstance(kwargs, DictValue):
        raise Unsupported(f"**{kwargs} in a call")
    fn = tx.pop()
    below = tx.pop()
    positional = args.items(tx)
    if not isinstance(below, NullValue):  # [fn, self] form
        fn, positional = below, [fn, *positional]
    tx.push(fn.call(tx, positional, {str(k): v for k, v in kwargs.entries.items()}))


@handles("MAKE_FUNCTION")
def make_function(tx, inst):
    code = tx.pop().as_constant()
    flags = inst.arg
    closure = tuple(tx.pop().items(tx)) if flags & 0x08 else ()
    if flags & 0x04:
        tx.pop()  # annotations
    kwdefaults = tx.pop().entries if flags & 0x02 else {}
    defaults = tuple(tx.pop().items(tx)) if flags & 0x01 else ()
    tx.push(NestedFunctionValue(code, tx.f_globals, defaults, dict(kwdefaults), closure))


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
        raise Unsupported(f"`with` on {context}: only torch.no_grad/enable_grad/set_grad_enabled and "
                          "torch.autocast are captured")
    tx.push(context.exit_value())
    tx.push(context.enter(tx))

