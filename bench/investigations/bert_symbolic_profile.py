"""Where BERT's steady state over symbols (weld's compile over symbols) loses time against a
compile for the length itself: per-kernel CUDA time and the call's wall time at one length.

    python bench/investigations/bert_symbolic_profile.py [--length 229]
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


def measure(label: str, fn, ids) -> None:
    with torch.no_grad():
        for _ in range(5):
            fn(input_ids=ids)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            fn(input_ids=ids)
        torch.cuda.synchronize()
        print(f"{label}: {(time.perf_counter() - start) / 20 * 1e3:.3f} ms a call")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                fn(input_ids=ids)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=229)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig()).eval().cuda()
    ids = torch.randint(0, 1000, (8, args.length), device="cuda")
    measure("eager", model, ids)
    dynamic = torchweld.compile(model, backend="weld")
    with torch.no_grad():
        dynamic(input_ids=torch.randint(0, 1000, (8, 464), device="cuda"))
    measure("weld over symbols", dynamic, ids)
    static = torchweld.compile(model, backend="weld", dynamic=False)
    measure("weld for the length", static, ids)


if __name__ == "__main__":
    main()
