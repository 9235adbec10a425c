"""How far large reductions land from the float64 answer: eager vs torch.compile vs torchweld,
with their times, one row per reduction.

    .venv/bin/python bench/reduction_accuracy.py [--numel 100000000] [--device cpu|cuda] [--record]

The error is |result - float64 result| / |float64 result| (the largest over a result's
elements). torchweld's C++ sums add float partials of 1024 elements into double totals
(compiler/codegen/cpp_reduction.py); its Triton sums do so per chunk of 32 RBLOCK-wide steps
(codegen/triton.py, tuning.chunk_steps). With --record the figures are appended to
bench/records/reduction_accuracy.jsonl.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout
sys.path.insert(0, str(ROOT / "bench" / "investigations"))
import torchweld  # noqa: E402
from bench import records  # noqa: E402
from compare import steady  # noqa: E402  (bench/investigations/compare.py: timing in turns)


def cases(n: int, device: str) -> list[tuple[str, object, list]]:
    """(name, fn, inputs) for inputs of about n elements each."""
    g = torch.Generator(device=device).manual_seed(0)
    normal = lambda *shape: torch.randn(*shape, generator=g, device=device)  # noqa: E731
    uniform = lambda *shape: torch.rand(*shape, generator=g, device=device) + 0.5  # noqa: E731
    a, b = normal(n), normal(n)
    return [
        ("(x * 1.0).mean(), x = 0.1", lambda x: (x * 1.0).mean(), [torch.full((n,), 0.1, device=device)]),
        ("x.sum(), x in [0.5, 1.5)", lambda x: x.sum(), [uniform(n)]),
        ("(a * b).sum()", lambda a, b: (a * b).sum(), [a, b]),
        ("((a - b) ** 2).mean()", lambda a, b: ((a - b) ** 2).mean(), [a, b]),
        ("mse_loss(a, b)", lambda a, b: F.mse_loss(a, b), [a, b]),
        ("x.var(), x = 1000 + 0.1 N(0, 1)", lambda x: x.var(), [1000 + 0.1 * a]),
        ("x.std()", lambda x: x.std(), [a]),
        ("vector_norm(x)", lambda x: torch.linalg.vector_norm(x), [b]),
        ("x.sum(1), x: 4 rows", lambda x: (x * 1.0).sum(1), [uniform(4, n // 4)]),
        ("x.sum(0), x: 16 columns", lambda x: (x * 1.0).sum(0), [uniform(n // 16, 16)]),
    ]


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    return ((got.double() - exact).abs().max() / exact.abs().max().clamp(min=1e-300)).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=10**8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds of calls per function and row")
    parser.add_argument("--record", action="store_true", help="append the figures to bench/records")
    args = parser.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, {args.numel} float32 elements")
    print(f"{'reduction':34} {'eager':>9} {'compile':>9} {'weld':>9}   {'eager ms':>9} {'compile ms':>10} {'weld ms':>9}")
    rows = []
    for name, fn, inputs in cases(args.numel, args.device):
        exact = fn(*(x.double() for x in inputs))
        fns = {"eager": fn, "torch.compile": torch.compile(fn), "torchweld": torchweld.compile(fn)}
        errors = {k: relative_error(f(*inputs), exact) for k, f in fns.items()}
        seconds = steady({k: (lambda _, f=f: (f(*inputs), sync())) for k, f in fns.items()}, None,
                         min_time=args.min_time)
        rows.append({"reduction": name, "error": errors, "ms": {k: s * 1e3 for k, s in seconds.items()}})
        print(f"{name:34} {errors['eager']:9.2e} {errors['torch.compile']:9.2e} {errors['torchweld']:9.2e}   "
              f"{seconds['eager'] * 1e3:9.3f} {seconds['torch.compile'] * 1e3:10.3f} {seconds['torchweld'] * 1e3:9.3f}")
        del exact
    if args.record:
        append_record(rows, args)


def append_record(rows: list[dict], options: argparse.Namespace) -> None:
    device = torch.cuda.get_device_name() if options.device == "cuda" else "cpu"
    records.append("reduction_accuracy", records.make_record(
        "reduction_accuracy", rows, options=vars(options), threads=torch.get_num_threads(), device=device))


if __name__ == "__main__":
    main()
