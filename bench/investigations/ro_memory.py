"""Where resnet50's inference under mode="reduce-overhead" spends its peak CUDA memory (issue 49).

    python3 bench/investigations/ro_memory.py torchweld [--trace] [--orig PATH] [--fresh]
    python3 bench/investigations/ro_memory.py torch [--trace]

One compiler per process (the harness runs each in a fresh one). The model and its input
are bench/models.py's resnet50 row (batch 32 unless --batch), built as bench/harness.py
builds it, with the peak statistics reset first, so the overall peak printed last is the
harness's peak_mib. Phase by phase (the peak statistics reset before each): the first three
calls and twenty more; for torchweld also each warm-up and recording inside the first call
(CudaGraphRecorder.warm_up / record wrapped), MiB allocated at the phase's peak and after it.
`--trace`: the caching allocator's history is recorded, and the blocks alive at the overall
peak are listed by where they were allocated. `--orig PATH`: torchweld.runtime.cudagraphs is
loaded from PATH instead (an earlier version, to compare in one device call). `--fresh`: then
calls with a new input tensor each time, dropped after (a data loader), and with held ones,
checking results against eager and counting recordings.
"""
from __future__ import annotations

import argparse
import collections
import gc
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

MiB = 2 ** 20
OVERALL = [0]


def mark(label: str) -> None:
    torch.cuda.synchronize()
    peak, now = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    OVERALL[0] = max(OVERALL[0], peak)
    print(f"  {label:34s} peak {peak / MiB:8.1f}  after {now / MiB:8.1f}  reserved "
          f"{torch.cuda.memory_reserved() / MiB:7.1f} MiB", flush=True)
    torch.cuda.reset_peak_memory_stats()


def load_orig(path: str) -> None:
    import torchweld.runtime

    spec = importlib.util.spec_from_file_location("torchweld.runtime.cudagraphs", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["torchweld.runtime.cudagraphs"] = module
    spec.loader.exec_module(module)
    torchweld.runtime.cudagraphs = module
    print(f"torchweld.runtime.cudagraphs from {path}")


def instrument_torchweld() -> None:
    from torchweld.runtime import cudagraphs

    rec = cudagraphs.CudaGraphRecorder
    warm_up, record = rec.warm_up, rec.record

    def warm_up_(self, fn, device):
        mark("  (before warm-up)")
        out = warm_up(self, fn, device)
        mark("  warm-up")
        return out

    def record_(self, fn, pool, device):
        mark("  (before recording)")
        out = record(self, fn, pool, device)
        mark("  recording")
        return out

    rec.warm_up, rec.record = warm_up_, record_


def pools() -> str:
    by_pool = collections.defaultdict(lambda: [0, 0])
    for segment in torch.cuda.memory_snapshot():
        sizes = by_pool[str(segment.get("segment_pool_id"))]
        sizes[0] += segment["total_size"]
        sizes[1] += segment["allocated_size"]
    return "  ".join(f"pool {pool} {reserved / MiB:.1f}/{allocated / MiB:.1f}"
                     for pool, (reserved, allocated) in sorted(by_pool.items(), key=lambda kv: -kv[1][0]))


KEEP = ("torchweld/", "bench/", "torchvision/", "_inductor/", "torch/cuda/", "<")


def origin(frames: list) -> str:
    """The innermost two frames in code of interest (torchweld, the bench, torchvision,
    Inductor, torch.cuda, generated code), as file:line function."""
    picked = []
    for fr in frames:
        name = fr.get("filename", "")
        if any(k in name for k in KEEP):
            short = "/".join(name.split("/")[-2:])
            picked.append(f"{short}:{fr.get('line')} {fr.get('name')}")
            if len(picked) == 2:
                break
    phase = next((fr["name"] for fr in frames if fr.get("name") in
                  ("warm_up", "record", "_record", "_replay", "_first_call", "run_eager", "record_function",
                   "_run_eager", "warmup", "_record", "run_first_inputs", "execute_node", "_side_stream",
                   "_compile", "compile_graph", "_allocate_and_copy_recording_inputs")), "-")
    return f"[{phase}] " + " <- ".join(picked) if picked else f"[{phase}] ?"


def peak_breakdown(snapshot: dict) -> None:
    device = torch.cuda.current_device()
    trace = snapshot["device_traces"][device]
    cur = peak = 0
    peak_at = -1
    sizes: dict[int, int] = {}
    for n, e in enumerate(trace):
        if e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            cur += e["size"]
            if cur > peak:
                peak, peak_at = cur, n
        elif e["action"] == "free_requested":
            cur -= sizes.pop(e["addr"], 0)
    print(f"trace: {len(trace)} events; peak of the traced blocks {peak / MiB:.1f} MiB at event {peak_at}")
    live: dict[int, dict] = {}
    for e in trace[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    groups = collections.defaultdict(lambda: [0, 0])
    for e in live.values():
        g = groups[origin(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    print("blocks alive at the peak, by where they were allocated (MiB, count):")
    for key, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"  {size / MiB:8.1f} {count:4d}  {key}")
    last = trace[peak_at]
    print(f"the allocation that set the peak: {last['size'] / MiB:.1f} MiB at {origin(last.get('frames', []))}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("compiler", choices=("torchweld", "torch", "eager"))
    parser.add_argument("--mode", default="reduce-overhead")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--orig", default=None)
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--model", default="resnet50")
    args = parser.parse_args()
    mode = None if args.mode == "default" else args.mode

    if args.orig:
        load_orig(args.orig)
    if args.trace:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    from bench import runner
    from bench.models import BENCHMARKS

    if args.compiler == "torchweld":
        instrument_torchweld()
    print(f"{args.compiler} mode={args.mode} {torch.cuda.get_device_name()} torch {torch.__version__}")
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    case = BENCHMARKS[args.model].make("cuda", False, torch.float32)
    case.model.eval()
    (x,) = case.inputs
    mark(f"model + input ({x.numel() * 4 / MiB:.1f} MiB)")
    weld = {"backend": "weld"} if args.compiler == "torchweld" else {}
    fn = runner.compile_with(args.compiler, case.model, mode=mode, **weld)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = fn(x)
        mark(f"call 1 ({time.perf_counter() - t0:.1f} s)")
        first = out.float().clone()
        del out
        for k in (2, 3):
            fn(x)
            mark(f"call {k}")
        for _ in range(20):
            fn(x)
        mark("20 more calls")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            fn(x)
        torch.cuda.synchronize()
        print(f"  {(time.perf_counter() - t0) * 10:.3f} ms a call (100 calls, same input)")
        mark("100 timed calls")
        print(f"  pools (reserved/allocated MiB): {pools()}")
        print(f"OVERALL PEAK {args.compiler} {args.mode}: {OVERALL[0] / MiB:.1f} MiB")
        if args.trace:
            peak_breakdown(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
        ref = case.model(x).float()  # eager, after the measurements: its own peak is no compiler's
        print(f"  max |compiled - eager| {(first - ref).abs().max().item():.2e} "
              f"(max |eager| {ref.abs().max().item():.2e})")
        if args.fresh:
            recorded = lambda: sum(p.graphs_recorded for p in gc.get_objects()  # noqa: E731
                                   if type(p).__name__ == "CudaGraphPool")
            before = recorded()
            worst = 0.0
            for _ in range(4):
                xn = torch.randn_like(x)
                worst = max(worst, (fn(xn).float() - case.model(xn).float()).abs().max().item())
                del xn
            print(f"  fresh inputs, dropped: recordings +{recorded() - before}, max diff {worst:.2e}")
            held = [torch.randn_like(x) for _ in range(3)]
            outs = [fn(h).float().clone() for h in held]
            worst = max((o - case.model(h).float()).abs().max().item() for o, h in zip(outs, held))
            print(f"  held inputs: recordings +{recorded() - before} in all, max diff {worst:.2e}")
            mark("fresh and held calls")
            print(f"  pools (reserved/allocated MiB): {pools()}")


if __name__ == "__main__":
    main()
