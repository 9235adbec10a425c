"""A dropout in training mode plus an add: eager vs torch.compile vs torchweld, timed in turns.

    .venv/bin/python bench/investigations/random_ops.py [--numel N] [--device cpu|cuda]

weld draws the mask inside the fused kernel (Op.RAND, Philox); eager draws it with
aten's bernoulli_ (CPU) or its fused dropout kernel (CUDA). Results differ from eager's
(another generator), so the check is the fraction of elements kept.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
import torchweld  # noqa: E402
from compare import steady  # noqa: E402  (bench/investigations/compare.py: timing in turns)

P = 0.1


def dropout_add(x, y):
    return F.dropout(x, P, training=True) + y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    x = torch.randn(args.numel, device=args.device)
    y = torch.randn_like(x)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    fns = {"eager": dropout_add, "torch.compile": torch.compile(dropout_add), "torchweld": torchweld.compile(dropout_add)}
    for name, fn in fns.items():
        kept = (fn(x, y) != y).float().mean().item()
        assert abs(kept - (1 - P)) < 0.01, (name, kept)
    seconds = steady({name: (lambda _, fn=fn: (fn(x, y), sync())) for name, fn in fns.items()}, None, min_time=3.0)
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, "
          f"dropout(p={P}) + add on {args.numel} float32")
    for name, s in seconds.items():
        print(f"{name:14s} {s * 1e3:8.3f} ms  {seconds['eager'] / s:5.2f}x eager")


if __name__ == "__main__":
    main()
