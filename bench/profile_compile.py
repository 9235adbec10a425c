"""Where weld's cold compile time goes, for one GPU case of bench/gpu_inference.py.

    python3 bench/profile_compile.py densenet121 [--mode MODE] [--top 30]

Runs the first call (capture, lowering, scheduling, code generation, Triton
compiles, the first run) in this fresh process with empty torchweld and Triton
caches under cProfile, and prints the wall time and the top functions by
cumulative and by own time. Triton compiles run in a thread pool: cProfile sees
only the main thread waiting for them (`Future.result`).
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
    args = parser.parse_args()
    [(name, make)] = cases({args.case})
    fn, x = make()
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp, config.patch(cache_dir=tmp):
        compiled = torchweld.compile(fn, backend="weld", mode=args.mode)
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        profiler.enable()
        compiled(x)
        torch.cuda.synchronize()
        profiler.disable()
        print(f"{name}: cold first call {time.perf_counter() - t0:.1f} s (under cProfile)")
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(args.top)
        text = out.getvalue()
        print(f"\n-- by {key}\n" + text[text.index("ncalls"):])


if __name__ == "__main__":
    main()
