"""Where the CPU time before and around a compiled call goes, for one model on CUDA.

    python3 bench/investigations/entry_overhead.py [--model GPT-2|BERT] [--device cuda|cpu] [--guards c|python]

Prints per call: the guard check alone (the entry's `check`), the whole entry with the
GPU idle (CPU time to enqueue everything), the CUDA-event latency, and the GPU busy time,
so that latency - GPU busy splits into guards, the wrapper's prologue and the rest.
`--device cpu` (batch 1, 16 tokens, the "eager" backend) times the guard check alone,
which does not depend on the device: the guards of the same model on a machine without a GPU.
`--guards python` runs the guards as one Python expression instead of the C guard evaluator
(torchweld.config.guard_evaluator), for an A/B comparison.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import transformers

import torchweld
from torchweld.capture import cache


def per_call_us(fn, iters=200) -> float:
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="GPT-2")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--guards", default=torchweld.config.guard_evaluator, choices=["c", "python"])
    args = parser.parse_args()
    torchweld.config.guard_evaluator = args.guards
    cuda = args.device == "cuda"
    if args.model == "BERT":
        model, seq = transformers.BertModel(transformers.BertConfig()), 128
    else:
        model, seq = transformers.GPT2Model(transformers.GPT2Config()), 256
    model = model.to(args.device).eval()
    ids = torch.randint(0, 1000, (8, seq) if cuda else (1, 16), device=args.device)
    compiled = torchweld.compile(lambda t: model(t).last_hidden_state, backend="weld" if cuda else "eager")
    with torch.no_grad():
        for _ in range(5):
            compiled(ids)
        entry = max((o for o in gc.get_objects() if isinstance(o, cache.CacheEntry)), key=lambda o: len(o.guards.guards))
        print(f"{args.model}: {len(entry.guards.guards)} guards, evaluated by {args.guards}")
        print(f"  guard check alone      {per_call_us(lambda: entry.check(ids), 2000 if not cuda else 200):8.1f} us")
        if not cuda:
            return
        print(f"  compiled call, CPU     {per_call_us(lambda: compiled(ids)):8.1f} us (returns before the GPU is done)")
        lat = []
        for _ in range(100):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            compiled(ids)
            end.record()
            end.synchronize()
            lat.append(start.elapsed_time(end))
        print(f"  latency (CUDA events)  {statistics.median(lat) * 1e3:8.1f} us")
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                compiled(ids)
            torch.cuda.synchronize()
        busy = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total) / 10
        print(f"  GPU busy               {busy:8.1f} us")


if __name__ == "__main__":
    main()
