"""Where BERT's steady state over symbols (weld's compile over symbols) loses time against a
compile for the length itself: per-kernel CUDA time and the call's wall time at each length,
and the host time a call takes to launch its work (no synchronization: where it exceeds the GPU's
time, the call is bound by it).

    python bench/investigations/bert_symbolic_profile.py [--lengths 229,52] [--rows 14]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torchweld  # noqa: E402


def measure(label: str, fn, ids, rows: int) -> None:
    with torch.no_grad():
        for _ in range(5):
            fn(input_ids=ids)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            fn(input_ids=ids)
        torch.cuda.synchronize()
        per_call = (time.perf_counter() - start) / 20 * 1e3
        host = []
        for _ in range(10):  # one call's launches, the GPU idle before it
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn(input_ids=ids)
            host.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        print(f"{label}: {per_call:.3f} ms a call, host {sorted(host)[len(host) // 2]:.3f} ms to launch one")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                fn(input_ids=ids)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="229")
    parser.add_argument("--rows", type=int, default=14)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig()).eval().cuda()
    dynamic = torchweld.compile(model, backend="weld")
    with torch.no_grad():
        dynamic(input_ids=torch.randint(0, 1000, (8, 464), device="cuda"))
    for length in map(int, args.lengths.split(",")):
        print(f"==== length {length}")
        ids = torch.randint(0, 1000, (8, length), device="cuda")
        measure("eager", model, ids, args.rows)
        measure("weld over symbols", dynamic, ids, args.rows)
        static = torchweld.compile(model, backend="weld", dynamic=False)
        measure("weld for the length", static, ids, args.rows)


if __name__ == "__main__":
    main()
