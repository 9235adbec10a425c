"""Where weld's cold compile time goes, for one GPU case of bench/gpu_inference.py.

    python3 bench/profile_compile.py densenet121 [--mode MODE] [--top 30] [--cprofile] [--thread-cpu]

Runs the first call (capture, lowering, scheduling, code generation, Triton
compiles, the first run) in this fresh process with empty torchweld and Triton
caches, and prints its wall time and `torchweld.compile_times()` (seconds per
phase). With --cprofile the call runs under cProfile, and the top functions by
cumulative and by own time follow. Triton compiles run in a thread pool:
cProfile sees only the main thread waiting for them (`Future.result`). With --thread-cpu,
each phase the main thread ran is listed with its wall time and the main thread's CPU
time in it: wall well above CPU is time spent waiting (on the GIL, a lock, a worker),
CPU near wall is work done there.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import tempfile
import threading
import time

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-cache-"))

import torch  # noqa: E402

import torchweld  # noqa: E402
from gpu_inference import cases  # noqa: E402
from torchweld import config, timing  # noqa: E402


def main_thread_cpu() -> dict[str, list]:
    """Record, from now on, each main-thread phase's [calls, wall s, thread CPU s]."""
    rows: dict[str, list] = {}
    phase = timing.phase

    @contextlib.contextmanager
    def measured(name):
        if threading.current_thread() is not threading.main_thread():
            with phase(name):
                yield
            return
        wall, cpu = time.perf_counter(), time.thread_time()
        with phase(name):
            yield
        row = rows.setdefault(name, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += time.perf_counter() - wall
        row[2] += time.thread_time() - cpu

    timing.phase = measured  # the compiler looks timing.phase up at each use
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", help="first word of a gpu_inference.py row, e.g. densenet121")
    parser.add_argument("--mode", default=None)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--thread-cpu", action="store_true", help="main-thread CPU time next to wall time per phase")
    args = parser.parse_args()
    cpu_rows = main_thread_cpu() if args.thread_cpu else None
    from triton import knobs

    compiles = []  # whether each Triton compile in this process hit the cache (a worker's are not seen)
    knobs.compilation.listener = lambda **kw: compiles.append(kw["cache_hit"])
    [(name, make)] = cases({args.case})
    fn, x = make()
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp, config.patch(cache_dir=tmp):
        compiled = torchweld.compile(fn, backend="weld", mode=args.mode)
        torch.cuda.synchronize()
        profiler = cProfile.Profile() if args.cprofile else None
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        compiled(x)
        torch.cuda.synchronize()
        if profiler:
            profiler.disable()
        print(f"{name}: cold first call {time.perf_counter() - t0:.2f} s{' (under cProfile)' if profiler else ''}")
    print(torchweld.compile_times())
    hits = sum(compiles)
    print(f"Triton compiles in this process: {len(compiles)}, of which cache hits {hits}")
    if cpu_rows is not None:
        print(f"\n{'main-thread phase':40s} {'calls':>5s} {'wall s':>7s} {'CPU s':>7s}")
        for name, (calls, wall, cpu) in cpu_rows.items():
            print(f"{name:40s} {calls:5d} {wall:7.3f} {cpu:7.3f}")
    for key in ("cumulative", "tottime") if profiler else ():
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(args.top)
        text = out.getvalue()
        print(f"\n-- by {key}\n" + text[text.index("ncalls"):])


if __name__ == "__main__":
    main()
