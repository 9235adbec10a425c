"""Where a CPU train step goes: eager, torch.compile and weld timed in turns, with the
minor page faults each takes per step, then weld's generated C++ kernels timed one by one.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/investigations/profile_train_cpu.py [--model block|mlp|cnn]
        [--steps 20] [--rounds 3] [--top 10] [--skip-inductor]

A step is forward, MSE loss against a fixed target and backward (no optimizer). The
kernel table wraps each ctypes kernel weld loads (runtime/cpp_loader.load_kernels) with a
timer; its rows are `<library>:<kernel>` with milliseconds per step.
"""
from __future__ import annotations

import argparse
import collections
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torchweld  # noqa: E402
import torchweld.runtime.cpp_loader as cpp_loader  # noqa: E402
from bench.models import CNN, mlp  # noqa: E402
from tests.models import Block  # noqa: E402

MODELS = {
    "block": (lambda: Block(d=256, heads=8), (8, 128, 256), (8, 128, 256)),
    "mlp": (lambda: mlp(1024), (64, 1024), (64, 1024)),
    "cnn": (CNN, (8, 3, 64, 64), (8, 10)),
}

kernel_seconds: collections.Counter = collections.Counter()
kernel_calls: collections.Counter = collections.Counter()
_load_kernels = cpp_loader.load_kernels


def _timed_load_kernels(source, names, n_args):
    """load_kernels, each kernel wrapped with a timer (for the table)."""
    fns, path = _load_kernels(source, names, n_args)
    library = os.path.basename(path)[:10]
    timed = {}
    for name, fn in fns.items():
        def run(*args, fn=fn, key=f"{library}:{name}"):
            start = time.perf_counter()
            fn(*args)
            kernel_seconds[key] += time.perf_counter() - start
            kernel_calls[key] += 1
        timed[name] = run
    return timed, path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="block")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--skip-inductor", action="store_true")
    args = parser.parse_args()
    cpp_loader.load_kernels = _timed_load_kernels  # before weld compiles anything
    make, x_shape, y_shape = MODELS[args.model]
    torch.manual_seed(0)
    x, y = torch.randn(x_shape), torch.randn(y_shape)
    compilers = {"eager": lambda m: m, "torch.compile": torch.compile, "weld": torchweld.compile}
    if args.skip_inductor:
        del compilers["torch.compile"]
    steps = {}
    for name, compile_fn in compilers.items():
        compiled = compile_fn(make())

        def step(compiled=compiled):
            (compiled(x) - y).square().mean().backward()

        step()
        step()
        steps[name] = step
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}")
    for r in range(args.rounds):
        cells = []
        for name, step in steps.items():
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            ms = (time.perf_counter() - start) / args.steps * 1e3
            faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) // args.steps
            cells.append(f"{name} {ms:.2f} ms, {faults} faults")
        print(f"round {r}: " + " | ".join(cells))
    kernel_seconds.clear()
    kernel_calls.clear()
    for _ in range(args.steps):
        steps["weld"]()
    total = sum(kernel_seconds.values()) / args.steps * 1e3
    print(f"weld's C++ kernels: {total:.3f} ms per step; the slowest:")
    for key, seconds in kernel_seconds.most_common(args.top):
        print(f"  {key:28s} {seconds / args.steps * 1e3:8.3f} ms/step  {kernel_calls[key] // args.steps} call(s)")


if __name__ == "__main__":
    main()
