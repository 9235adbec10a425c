"""Per-call overhead of a compiled tiny function (and of one with a graph break, and with
symbolic sizes, whose guards check relations between sizes):
eager vs torch.compile(backend="eager")
vs torchweld.compile(backend="eager"), in one run, as microseconds and ratios.

    .venv/bin/python bench/overhead.py [--calls N]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import torchweld


def add_one(x):
    return x + 1


def five_args(a, b, c, d, e):
    return a * b + c - d / e


def one_break(x):
    y = x + 1
    if y.sum() > 0:  # data-dependent: a graph break
        return y * 2
    return y - 2


def per_call_us(fn, args, calls: int, repeats: int = 7) -> float:
    for _ in range(100):
        fn(*args)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = {  # name: (function, inputs, dynamic)
        "x + 1 (1 element)": (add_one, (torch.ones(1),), False),
        "5-argument function": (five_args, tuple(torch.ones(1) for _ in range(5)), False),
        "one graph break": (one_break, (torch.ones(1),), False),
        "x + 1, dynamic=True": (add_one, (torch.ones(4),), True),
        "5 args, dynamic=True": (five_args, tuple(torch.ones(4) for _ in range(5)), True),
    }
    print(f"torch {torch.__version__}; per-call time in microseconds (median of 7 x {args.calls} calls)")
    print(f"{'function':<22}{'eager':>9}{'torch.compile':>15}{'torchweld':>11}{'torchweld/torch.compile':>25}")
    for name, (fn, inputs, dynamic) in cases.items():
        eager = per_call_us(fn, inputs, args.calls)
        torch._dynamo.reset()
        anchor = per_call_us(torch.compile(fn, backend="eager", dynamic=dynamic), inputs, args.calls)
        ours = per_call_us(torchweld.compile(fn, backend="eager", dynamic=dynamic), inputs, args.calls)
        print(f"{name:<22}{eager:>9.2f}{anchor:>15.2f}{ours:>11.2f}{ours / anchor:>25.2f}")


if __name__ == "__main__":
    main()
