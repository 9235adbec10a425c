"""Where weld's cold compile time goes, for one GPU case of bench/gpu_inference.py.

    python3 bench/profile_compile.py densenet121 [--mode MODE] [--top 30] [--cprofile]

Runs the first call (capture, lowering, scheduling, code generation, Triton
compiles, the first run) in this fresh process with empty torchweld and Triton
caches, and prints its wall time and `torchweld.compile_times()` (seconds per
phase). With --cprofile the call runs under cProfile, and the top functions by
cumulative and by own time follow. Triton compiles run in a thread pool:
cProfile sees only the main thread waiting for them (`Future.result`).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import tempfile
import time

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-cache-"))

import torch  # noqa: E402

import torchweld  # noqa: E402
from gpu_inference import cases  # noqa: E402
from torchweld import config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", help="first word of a gpu_inference.py row, e.g. densenet121")
    parser.add_argument("--mode", default=None)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
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
    for key in ("cumulative", "tottime") if profiler else ():
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(args.top)
        text = out.getvalue()
        print(f"\n-- by {key}\n" + text[text.index("ncalls"):])


if __name__ == "__main__":
    main()
