"""Why a model recompiles across input lengths under dynamic=None: calls a transformers model
(bench/models.py's GPT-2 or BERT) with several sequence lengths under torchweld.compile and
prints the recompile and graph-break log lines and the graph count; with --backend weld, each
length's first call's seconds and the compile phases it spent (torchweld.compile_times), which
show what the compile over symbols after the second length costs.

    TORCHWELD_LOGS=recompiles,graph_breaks python bench/investigations/dynamic_recompiles.py --model gpt2 --device cuda
    python bench/investigations/dynamic_recompiles.py --model gpt2 --device cuda --backend weld --lengths 464,229,420
        [--profile 1] [--top 40] [--training]

--training: each call is a training step (dropout off; forward, a mean-square loss of the first
output, backward), so the compile over symbols is the joint graph's and its partition's.
--profile I runs the I-th length's first call (0-based; 1 is where dynamic=None compiles over
symbols) under cProfile and prints its --top functions by cumulative and by own time;
--callers REGEX then lists who called the functions it names.
"""
import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torchweld  # noqa: E402
from bench.models import BENCHMARKS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--lengths", default="464,229,420,487,247,52")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", type=int, default=None, help="profile this length's first call (0-based)")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--training", action="store_true")
    parser.add_argument("--callers", help="with --profile: who calls the functions this regex names")
    args = parser.parse_args()
    case = BENCHMARKS[args.model].make(args.device, args.quick)
    model = case.model.train(args.training)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torchweld.compile(model, backend=counting if args.backend == "eager" else args.backend)
    with contextlib.nullcontext() if args.training else torch.no_grad():
        for index, n in enumerate(int(s) for s in args.lengths.split(",")):
            ids = case.inputs[0][:, :1].repeat(1, n)
            before, phases = len(graphs), torchweld.compile_times()
            profiler = cProfile.Profile() if index == args.profile else None
            start = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            out = compiled(ids)
            if args.training:
                out = out[0] if isinstance(out, tuple) else getattr(out, "logits", getattr(out, "last_hidden_state", out))
                out.float().pow(2).mean().backward()
            if args.device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            if profiler is not None:
                profiler.disable()
                for order in ("cumulative", "tottime"):
                    pstats.Stats(profiler, stream=sys.stdout).sort_stats(order).print_stats(args.top)
                if args.callers:
                    pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_callers(args.callers)
            spent = {k: round(v - phases.get(k, 0.0), 3) for k, v in torchweld.compile_times().items()
                     if v - phases.get(k, 0.0) >= 0.01}
            print(f"length {n}: {len(graphs) - before} new graphs, first call {seconds:.2f} s; {spent}", flush=True)
    print(f"{len(graphs)} graphs")


if __name__ == "__main__":
    main()
