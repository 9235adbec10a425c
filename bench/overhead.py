"""Per-call overhead of a compiled tiny function (and of one with a graph break, and with
symbolic sizes, whose guards check relations between sizes):
eager vs torch.compile(backend="eager")
vs torchweld.compile(backend="eager"), in one run, as microseconds and ratios.
Appends a record to bench/records/overhead.jsonl (bench/records.py) unless --no-record.

    .venv/bin/python bench/overhead.py [--calls N] [--no-record]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import torchweld  # noqa: E402
from bench import records, runner  # noqa: E402

SUITE = "overhead"


def add_one(x):
    return x + 1


def five_args(a, b, c, d, e):
    return a * b + c - d / e


def views(x):  # symbolic sizes: equal dims (duck sizing), strides that are products of sizes
    return x.view(x.shape[0], -1) + x.reshape(-1, x.size(-1)).mean()


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20000)
    runner.add_record_and_worker_options(parser)
    args = parser.parse_args(argv)
    runner.use_records_dir(args.records_dir)
    torch.set_num_threads(1)
    cases = {  # name: (function, inputs, dynamic)
        "x + 1 (1 element)": (add_one, (torch.ones(1),), False),
        "5-argument function": (five_args, tuple(torch.ones(1) for _ in range(5)), False),
        "one graph break": (one_break, (torch.ones(1),), False),
        "x + 1, dynamic=True": (add_one, (torch.ones(4),), True),
        "5 args, dynamic=True": (five_args, tuple(torch.ones(4) for _ in range(5)), True),
        "views, dynamic=True": (views, (torch.ones(4, 3, 4),), True),
    }
    figures = []
    print(f"torch {torch.__version__}; per-call time in microseconds (median of 7 x {args.calls} calls)")
    print(f"{'function':<22}{'eager':>9}{'torch.compile':>15}{'torchweld':>11}{'torchweld/torch.compile':>25}")
    for name, (fn, inputs, dynamic) in cases.items():
        eager = per_call_us(fn, inputs, args.calls)
        torch._dynamo.reset()
        anchor = per_call_us(torch.compile(fn, backend="eager", dynamic=dynamic), inputs, args.calls)
        ours = per_call_us(torchweld.compile(fn, backend="eager", dynamic=dynamic), inputs, args.calls)
        print(f"{name:<22}{eager:>9.2f}{anchor:>15.2f}{ours:>11.2f}{ours / anchor:>25.2f}")
        figures.append({"case": name, "eager_us": eager, "torch_compile_us": anchor, "torchweld_us": ours,
                        "ratio": ours / anchor})
    if not args.no_record:
        record = records.make_record(SUITE, {"calls": args.calls, "cases": figures}, runner.record_options(args))
        print(f"recorded in {records.append(SUITE, record)}")


if __name__ == "__main__":
    main()
