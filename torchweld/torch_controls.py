"""What torch.compiler's controls ask of torchweld, read at call time without importing
torch._dynamo: the stance (`torch.compiler.set_stance`), functions marked with
`torch.compiler.allow_in_graph` or `torch.compiler.assume_constant_result`,
`torch._dynamo.graph_break()`, and modules and functions `torch.compile` returned.

torch keeps these in torch._dynamo's modules, which torchweld never imports (STYLE.md).
Every control imports them when it is used, so where they are not loaded no control was
used, and each answer here is the default. torch 2.13 has no public reader of the stance;
it is read from the module `set_stance` writes it to (`torch._dynamo.eval_frame._stance`).
"""
from __future__ import annotations

import sys
import types

# torch.compiler.set_stance's stances; torchweld treats both `*_then_compile` as
# "eager_then_compile" (the first call runs eagerly, later ones compile)
STANCES = ("default", "force_eager", "eager_on_recompile", "fail_on_recompile", "eager_then_compile",
           "aot_eager_then_compile")


def stance() -> str:
    """The stance `torch.compiler.set_stance` set last ("default" where it was never called)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return "default"
    return getattr(getattr(eval_frame, "_stance", None), "stance", "default")


def is_graph_break(obj: object) -> bool:
    """Whether `obj` is `torch._dynamo.graph_break`: a graph break where user code calls it."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and obj is getattr(dynamo, "graph_break", None)


def allowed_in_graph(obj: object) -> bool:
    """Whether `torch.compiler.allow_in_graph(obj)` was called: torch records the function's id."""
    trace_rules = sys.modules.get("torch._dynamo.trace_rules")
    allowed = getattr(trace_rules, "_allowed_callable_ids", None)
    if allowed is None:
        return False
    try:
        return id(obj) in allowed
    except Exception:  # torch changed how it keeps them: the marker is unread, the function inlined
        return False


def assumed_constant(obj: object) -> bool:
    """Whether `torch.compiler.assume_constant_result(obj)` marked the function."""
    return isinstance(obj, types.FunctionType) and getattr(obj, "_dynamo_marked_constant", False) is True


def is_torch_compiled(obj: object) -> bool:
    """Whether `obj` is what `torch.compile` returned: an OptimizedModule, or a function wrapper."""
    if isinstance(obj, types.FunctionType):
        return getattr(obj, "_is_torch_compile", False) is True
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and isinstance(obj, optimized)
