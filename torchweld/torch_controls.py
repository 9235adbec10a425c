"""torchweld's own compile controls, the counterparts of torch.compiler's: the stance
(`torchweld.set_stance`), `torchweld.allow_in_graph`, `torchweld.graph_break()`; and what a
user's function or module carries that capture must respect: the mark
`torch.compiler.assume_constant_result` leaves on the function, and a module or function
`torch.compile` returned (recognised by its shape, not by importing torch's compiler).

torch.compiler's own stance and registries live in torch's compiler modules, which torchweld
never reads (DESIGN.md): `torch.compiler.set_stance` and `allow_in_graph` steer torch.compile
only; use torchweld's.
"""
from __future__ import annotations

import contextlib
import types

# the stances, as torch.compiler names them; "*_then_compile" both run the first call eagerly
STANCES = ("default", "force_eager", "eager_on_recompile", "fail_on_recompile", "eager_then_compile",
           "aot_eager_then_compile")
_stance = ["default"]
ALLOWED_MARK = "_torchweld_allow_in_graph"


def stance() -> str:
    """The stance `torchweld.set_stance` set last ("default" where it was never called)."""
    return _stance[0]


class set_stance(contextlib.ContextDecorator):  # noqa: N801 - a function to its users, as torch's
    """`torchweld.set_stance("force_eager")`: from now on; inside `with` (restored after); or as
    a decorator, inside each call of the function only.
    "force_eager" runs compiled functions as they are; "eager_on_recompile" runs a call no
    compiled version takes eagerly; "fail_on_recompile" raises there; "eager_then_compile"
    runs the first call eagerly."""

    def __init__(self, stance: str = "default"):
        if stance not in STANCES:
            raise ValueError(f"torchweld.set_stance: unknown stance {stance!r}; the stances are {', '.join(STANCES)}")
        self.stance = stance
        self._previous = [_stance[0]]  # the call form sets it now; `with` restores this on leaving
        self._set_by_call = True
        _stance[0] = stance

    def __call__(self, fn):  # a decorator: not from now on, only inside fn
        if self._set_by_call:
            self._set_by_call = False
            _stance[0] = self._previous.pop()
        return super().__call__(fn)

    def __enter__(self):
        if self._set_by_call:  # `with set_stance(...)`: set already
            self._set_by_call = False
        else:  # entered again (a decorated function's call, a reused object)
            self._previous.append(_stance[0])
            _stance[0] = self.stance
        return self

    def __exit__(self, *exc) -> None:
        _stance[0] = self._previous.pop()


def graph_break() -> None:
    """Called in a compiled function, breaks the graph there; elsewhere does nothing."""


def is_graph_break(obj: object) -> bool:
    return obj is graph_break


def allow_in_graph(fn):
    """Mark `fn` to be one graph node, as a torch function is: capture does not look inside it
    (weld traces through it). Returns `fn`."""
    setattr(fn, ALLOWED_MARK, True)
    return fn


def allowed_in_graph(obj: object) -> bool:
    return isinstance(obj, types.FunctionType) and getattr(obj, ALLOWED_MARK, False) is True


def assumed_constant(obj: object) -> bool:
    """Whether `torch.compiler.assume_constant_result(obj)` marked the function (an attribute it sets on it)."""
    return isinstance(obj, types.FunctionType) and getattr(obj, "_dynamo_marked_constant", False) is True


def is_torch_compiled(obj: object) -> bool:
    """Whether `obj` is what `torch.compile` returned: a function wrapper it marks, or a module
    wrapper holding the original as `_orig_mod` (torch's OptimizedModule)."""
    if isinstance(obj, types.FunctionType):
        return getattr(obj, "_is_torch_compile", False) is True
    return type(obj).__name__ == "OptimizedModule" and "_orig_mod" in getattr(obj, "_modules", {})
