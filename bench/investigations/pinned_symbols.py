"""Where a compile over symbols makes a symbol a number: the Python stack (torchweld's and
torch's frames) at each replacement of a symbol by a number in weld's compile (not capture's), for tests/models.Block's training
step under dynamic=True on this device, with the torch-level function (a C++ composite) that the trace was inside.

    python bench/investigations/pinned_symbols.py [--device cuda]
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch
from torch.fx.experimental import symbolic_shapes

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torchweld  # noqa: E402
from tests.models import Block  # noqa: E402
from torchweld.compiler import aten_trace  # noqa: E402

_torch_function = aten_trace._CompositesOverSymbols.__torch_function__

_set = symbolic_shapes.ShapeEnv._set_replacement


def _printing_set(self, a, tgt, msg):
    stack = traceback.extract_stack()
    if getattr(tgt, "is_number", False) and any("torchweld/backends/weld" in f.filename for f in stack):
        print(f"PINNED {a} := {tgt} ({msg}) within the torch function {_calling[-1] if _calling else None}")
        for frame in stack[-30:-1]:
            if "torchweld" in frame.filename or "torch/" in frame.filename:
                print(f"    {frame.filename.split('site-packages/')[-1]}:{frame.lineno} {frame.name}: {frame.line}")
    return _set(self, a, tgt, msg)


_calling: list = []  # the torch-level functions the trace is inside (aten_trace's TorchFunctionMode)


def _tracking_torch_function(self, func, types, args=(), kwargs=None):
    _calling.append(getattr(func, "__qualname__", None) or repr(func))
    try:
        return _torch_function(self, func, types, args, kwargs)
    finally:
        _calling.pop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    symbolic_shapes.ShapeEnv._set_replacement = _printing_set
    aten_trace._CompositesOverSymbols.__torch_function__ = _tracking_torch_function
    torch.manual_seed(0)
    block = Block(d=16, heads=2, causal=True).to(args.device)
    fn = torchweld.compile(block, backend="weld", dynamic=True)
    for t in (7, 10):
        fn(torch.randn(2, t, 16, device=args.device, requires_grad=True)).square().sum().backward()


if __name__ == "__main__":
    main()
