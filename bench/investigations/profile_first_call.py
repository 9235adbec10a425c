"""Where a compiled model's first call goes, under cProfile: capture, the backend, the guards.
Run twice with one cache directory to see a warm start (the second process finds the caches
the first filled; `--callers compile` adds who called the functions whose name matches):

    python bench/investigations/profile_first_call.py --model bert --device cuda --backend eager
    python bench/investigations/profile_first_call.py --model gpt2 --device cuda --runs 2 --top 40
    python bench/investigations/profile_first_call.py --model gpt2 --phase training --runs 2 --cache-log

Each run is a fresh process; it prints torchweld.compile_times() and the functions with the
most time of their own and the most cumulative time. `--phase training` profiles a first
training step (forward, loss, backward). `--cache-log`: the graph cache's debug log, which says
for each graph whether it was stored or loaded, or why not, and its key's parts: the part that
differs between two runs is why the second compiled a graph again.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def one_run(args) -> None:
    import cProfile
    import pstats
    import time

    sys.path.insert(0, str(ROOT))
    import torch

    import torchweld
    from bench.models import BENCHMARKS
    from bench.runner import sync

    case = BENCHMARKS[args.model].make(args.device, args.quick)
    training = args.phase == "training"
    compiled = torchweld.compile(case.model.train(training), backend=args.backend)
    sync(args.device)
    profile = cProfile.Profile()
    start = time.perf_counter()
    with torch.set_grad_enabled(training):
        profile.enable()
        out = compiled(*case.inputs)
        if training:
            case.loss(out, case.target).backward()
        sync(args.device)
        profile.disable()
    print(f"first call: {time.perf_counter() - start:.3f} s")
    print(torchweld.compile_times(repr="str"))
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    if args.callers:
        stats.print_callers(args.callers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="weld")
    parser.add_argument("--phase", choices=("inference", "training"), default="inference")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cache-log", action="store_true", help="the graph cache's debug log (TORCHWELD_LOGS=+cache)")
    parser.add_argument("--runs", type=int, default=1, help="fresh processes in a row, sharing one cache directory")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--callers", default=None, help="print the callers of the functions matching this")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process:
        one_run(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="torchweld-first-call-") as tmp:
        env = dict(os.environ, TORCHWELD_CACHE_DIR=os.path.join(tmp, "torchweld"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        if args.cache_log:
            env["TORCHWELD_LOGS"] = "+cache"
        for run in range(args.runs):
            print(f"=== run {run + 1} of {args.runs} ({'cold' if run == 0 else 'warm'})", flush=True)
            command = [sys.executable, __file__, "--in-process", "--model", args.model, "--device", args.device,
                       "--backend", args.backend, "--phase", args.phase, "--top", str(args.top)]
            command += ["--callers", args.callers] if args.callers else []
            command += ["--quick"] if args.quick else []
            if subprocess.run(command, env=env).returncode:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
