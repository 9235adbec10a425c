"""Compile a function with the weld compiler and compare it with eager."""
from __future__ import annotations

import torch

from torchweld.compiler import compile_graph


def weld_compile(fn, inputs, options=None):
    gm = fn if isinstance(fn, torch.fx.GraphModule) else torch.fx.symbolic_trace(fn)
    with torch.no_grad():
        return compile_graph(gm, list(inputs), options)


def check(fn, inputs, options=None, atol=None, rtol=None, compiled=None):
    compiled = compiled or weld_compile(fn, inputs, options)
    with torch.no_grad():
        expected = fn(*inputs)
        got = compiled(*inputs)
    kw = {} if atol is None else {"atol": atol, "rtol": rtol}
    torch.testing.assert_close(got, expected, equal_nan=True, **kw)
    return compiled


def tolerances(dtype):
    return {torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}.get(dtype, (None, None))
