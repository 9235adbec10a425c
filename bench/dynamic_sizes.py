"""Dynamic shapes on the CPU: a small transformer block called with 12 sequence lengths in a
random order; number of compiles and total time (compiles + every call) for torchweld
(dynamic=None, True, False; eager and weld backends) beside torch.compile (dynamic=None, its
"inductor" and "eager" backends) in one run. Appends a record to bench/records/dynamic_sizes.jsonl.

    .venv/bin/python bench/dynamic_sizes.py [--lengths 12] [--repeats 3]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchweld  # noqa: E402
from bench import records  # noqa: E402
from tests.models import Block  # noqa: E402


def _graphs_counted(backend):
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs)

    return counting, graphs


def run(compiler: str, backend: str, dynamic, lengths: list[int], repeats: int) -> dict:
    torch.manual_seed(0)
    block = Block(d=64, heads=4, causal=True).eval()
    inputs = [torch.randn(4, t, 64) for t in lengths]
    if compiler == "torch.compile":
        torch._dynamo.reset()
        from torch._dynamo.backends.registry import lookup_backend

        counting, graphs = _graphs_counted(lookup_backend(backend))
        compiled = torch.compile(block, backend=counting, dynamic=dynamic)
    else:
        from torchweld.backends import lookup_backend

        counting, graphs = _graphs_counted(lookup_backend(backend))
        compiled = torchweld.compile(block, backend=counting, dynamic=dynamic)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(repeats):
            for x in inputs:
                compiled(x)
        total = time.perf_counter() - start
        torch.testing.assert_close(compiled(inputs[0]), block(inputs[0]), rtol=1e-4, atol=1e-4)
    return {"compiler": compiler, "backend": backend, "dynamic": dynamic, "graphs": len(graphs),
            "total_s": round(total, 3), "calls": repeats * len(inputs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    rng = random.Random(0)
    lengths = rng.sample(range(16, 129), options.lengths)
    torch.set_num_threads(2)
    rows = []
    for compiler, backend, dynamic in [("torchweld", "eager", None), ("torchweld", "eager", True),
                                       ("torchweld", "eager", False), ("torch.compile", "eager", None),
                                       ("torchweld", "weld", None), ("torch.compile", "inductor", None)]:
        with torchweld.config.patch(cache_size_limit=max(8, options.lengths)):
            row = run(compiler, backend, dynamic, lengths, options.repeats)
        rows.append(row)
        print(f"{compiler:14} {backend:8} dynamic={str(dynamic):5}: {row['graphs']:2} graphs, "
              f"{row['total_s']:7.2f} s for {row['calls']} calls", flush=True)
    path = records.append("dynamic_sizes", records.make_record("dynamic_sizes", {"lengths": lengths, "rows": rows},
                                                                 vars(options)))
    print(f"recorded in {path}")


if __name__ == "__main__":
    main()
