"""Where weld's GPU time goes: eager vs weld (vs torch.compile) per model, one run.

    python3 bench/investigations/profile_weld_gpu.py [--only chain resnet50 densenet121 BERT GPT-2] [--inductor]
                                      [--iters 50] [--options JSON] [--mode MODE]

For each case it prints, for eager, for weld (torchweld.compile(backend="weld")) and,
with --inductor, for torch.compile, float32 inference under no_grad:
  - latency: median of CUDA-event timings of one call each (what bench/investigations/gpu_inference.py
    reports; includes any CPU launch overhead the GPU waits for), the contenders' calls
    taken in turn so that the host's slower spells fall on all of them;
  - throughput: CUDA-event time of `iters` back-to-back calls / iters (GPU-bound);
  - CPU time to enqueue one call (perf_counter over back-to-back calls);
  - CUDA kernels (and memcpy/memset) per call and the GPU time they take, from torch.profiler;
  - the top 14 kernels by GPU time; weld: what the generated wrappers contain
    (Triton kernels, extern calls, layout-fix copies, allocations) and the top Python
    functions by time for 20 calls (cProfile);
  - chain: TB/s against a plain copy, and a sweep of XBLOCK/num_warps for weld's kernel.
Runs in well under 2 minutes on an H100.
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import io
import json
import math
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
import torchweld  # noqa: E402
from bench.models import add_mul_chain  # noqa: E402, F401  (the add/mul chain, defined once)


# -- timing ---------------------------------------------------------------------------


def latency_ms(fn, x, iters: int) -> float:
    """Median CUDA-event time of `iters` single calls of `fn(x)`, each waited for."""
    return interleaved_latency_ms({"fn": fn}, x, iters)["fn"]


def interleaved_latency_ms(contenders: dict, x, iters: int) -> dict:
    """latency_ms of each of `contenders`, their single calls taken in turn (a, b, c, a, b, c, ...)
    so that a slower or busier spell of the host falls on all of them alike."""
    times = {label: [] for label in contenders}
    for _ in range(iters):
        for label, fn in contenders.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(x)
            end.record()
            end.synchronize()
            times[label].append(start.elapsed_time(end))
    return {label: statistics.median(t) for label, t in times.items()}


def throughput_ms(fn, x, iters: int) -> tuple[float, float]:
    """(GPU ms per call, CPU ms to enqueue one call), over `iters` back-to-back calls."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn(x)
    end.record()
    cpu = (time.perf_counter() - t0) / iters * 1e3
    end.synchronize()
    return start.elapsed_time(end) / iters, cpu


def device_events(fn, x, calls: int = 2):
    """The CUDA-side profiler events of `calls` calls (kernels, memcpy, memset)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in prof.events() if e.device_type == cuda]


def kernel_table(events, calls: int, top: int = 10) -> str:
    total = collections.defaultdict(float)
    count = collections.Counter()
    for e in events:
        total[e.name] += e.time_range.elapsed_us()
        count[e.name] += 1
    whole = sum(total.values()) or 1.0
    lines = [f"      {'us/call':>9} {'%':>5} {'n/call':>6}  kernel"]
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"      {us / calls:9.1f} {100 * us / whole:5.1f} {count[name] / calls:6.1f}  {name[:110]}")
    return "\n".join(lines)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_python(fn, x, calls: int = 20, top: int = 10) -> str:
    _sync()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn(x)
    pr.disable()
    _sync()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return "\n".join("      " + ln for ln in lines[start:start + top + 1])


# -- weld internals: the compiled graphs of a model --------------------------------------


class GraphSpy:
    """Collects the CompiledGraph of every graph weld compiles while it is active."""

    def __enter__(self):
        import torchweld.compiler as compiler

        self.graphs, self.compiler, self.original = [], compiler, compiler.compile_graph

        def spy(*args, **kwargs):
            graph = self.original(*args, **kwargs)
            self.graphs.append(graph)
            return graph

        compiler.compile_graph = spy
        return self

    def __exit__(self, *exc):
        self.compiler.compile_graph = self.original

    def summary(self) -> str:
        lines = []
        for i, g in enumerate(self.graphs):
            src = g.wrapper_source
            body = src[src.index("def call("):]
            lines.append(f"      graph {i}: {len(g.schedule.kernels())} generated kernels, "
                         f"{body.count('# extern')} extern calls, "
                         f"{body.count('= _restride(') - body.count('if arg')} layout checks after externs "
                         f"(each copies when the layout differs), "
                         f"{body.count('torch.empty_strided(')} allocations, {body.count('# reuse')} reuses")
            externs = collections.Counter(g.externs)
            lines.append("        externs: " + ", ".join(f"{n} x{c}" for n, c in externs.most_common()))
        return "\n".join(lines)


# -- cases -------------------------------------------------------------------------------


def report(name: str, contenders: dict, x, iters: int, spy: GraphSpy | None, bytes_moved: int | None) -> dict:
    """Times each of `contenders` ({label: fn}, eager first, weld among them) on `x`."""
    print(f"\n== {name}")
    results = {}
    for fn in contenders.values():
        for _ in range(3):
            fn(x)
    latencies = interleaved_latency_ms(contenders, x, iters)
    for label, fn in contenders.items():
        lat = latencies[label]
        thr, cpu = throughput_ms(fn, x, iters)
        calls = 2
        events = device_events(fn, x, calls)
        kernels = [e for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
        copies = len(events) - len(kernels)
        gpu_busy = sum(e.time_range.elapsed_us() for e in events) / calls / 1e3
        results[label] = (lat, thr, cpu)
        extra = ""
        if bytes_moved:
            extra = f", {bytes_moved / (thr * 1e-3) / 1e12:.2f} TB/s"
        print(f"  {label:8}: latency {lat:8.3f} ms, throughput {thr:8.3f} ms/call{extra}, "
              f"CPU enqueue {cpu:7.3f} ms/call, GPU busy {gpu_busy:7.3f} ms/call, "
              f"{len(kernels) / calls:.0f} kernels + {copies / calls:.0f} memcpy/memset per call")
        print(f"    top kernels ({label}):")
        print(kernel_table(events, calls, top=14))
    e = results["eager"]
    for label, r in results.items():
        if label != "eager":
            print(f"  {label} speedup over eager: latency {e[0] / r[0]:.2f}x, throughput {e[1] / r[1]:.2f}x")
    if spy is not None:
        print("    weld wrappers:")
        print(spy.summary())
    print("    weld Python time, 20 calls (cProfile, by tottime):")
    print(profile_python(contenders["weld"], x))
    return results


def chain_case(iters: int) -> None:
    x = torch.randn(1 << 26, device="cuda")
    with GraphSpy() as spy:
        weld = torchweld.compile(add_mul_chain, backend="weld")
        weld(x)
    nbytes = 2 * x.numel() * x.element_size()
    out = torch.empty_like(x)
    copy_ms, _ = throughput_ms(lambda t: out.copy_(t), x, iters)
    print(f"\n(copy of 64M floats: {copy_ms:.3f} ms, {nbytes / (copy_ms * 1e-3) / 1e12:.2f} TB/s: the bandwidth goal is 90% of it)")
    report("add/mul chain 64M floats ((t + 1) * 2 + 3) * 0.5", {"eager": add_mul_chain, "weld": weld}, x, iters, spy, nbytes)
    if spy.graphs:
        sweep_chain_kernel(spy.graphs[-1], x, nbytes, iters)


def sweep_chain_kernel(graph, x, nbytes: int, iters: int) -> None:
    """The chain's Triton kernel launched directly with other XBLOCK/num_warps."""
    g = graph.fn.__globals__
    names = [n for n in g if n.startswith("_k_")]
    if len(names) != 1:
        print(f"    (no sweep: {len(names)} kernels)")
        return
    kernel = g[names[0]]
    out = torch.empty_like(x)
    print("    launch sweep of weld's kernel (GPU ms, TB/s):")
    for xblock, warps in ((1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16)):
        grid = (math.ceil(x.numel() / xblock),)
        run = lambda t: kernel[grid](t, out, XBLOCK=xblock, RBLOCK=1, num_warps=warps)
        run(x)
        ms, _ = throughput_ms(run, x, iters)
        print(f"      XBLOCK={xblock:5} num_warps={warps:2}: {ms:7.3f} ms  {nbytes / (ms * 1e-3) / 1e12:5.2f} TB/s")


def model_case(case: str, iters: int, options: dict, inductor: bool, dump: str | None, mode: str | None) -> None:
    """A model row of bench/investigations/gpu_inference.py: eager, weld and (with `inductor`) torch.compile."""
    from gpu_inference import cases

    found = cases({case})
    if not found:
        print(f"\nno {case} row (torchvision / transformers missing?)")
        return
    [(row, make)] = found
    torch.manual_seed(0)
    model, x = make()
    contenders = {"eager": model}
    with GraphSpy() as spy:
        weld = torchweld.compile(model, backend="weld", options=options, mode=mode)
        t0 = time.perf_counter()
        weld(x)
        torch.cuda.synchronize()
        print(f"\nweld {row} cold compile: {time.perf_counter() - t0:.1f} s")
    contenders["weld"] = weld
    if inductor:
        compiled = torch.compile(model, mode=mode)
        t0 = time.perf_counter()
        compiled(x)
        torch.cuda.synchronize()
        print(f"torch.compile {row} cold compile: {time.perf_counter() - t0:.1f} s")
        contenders["inductor"] = compiled
    report(row, contenders, x, iters, spy, None)
    if dump:
        os.makedirs(dump, exist_ok=True)
        for i, graph in enumerate(spy.graphs):
            with open(os.path.join(dump, f"{case}_graph{i}.py"), "w") as f:
                f.write(graph.wrapper_source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=["chain", "resnet50"],
                        help="chain and/or first words of bench/investigations/gpu_inference.py's rows: resnet50 densenet121 BERT GPT-2")
    parser.add_argument("--inductor", action="store_true", help="time torch.compile (default mode) beside them")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--options", default="{}", help="torchweld options as JSON, for the model cases")
    parser.add_argument("--dump", metavar="DIR", help="write each weld wrapper's source there")
    parser.add_argument("--mode", default=None, help="the mode weld and torch.compile compile the model cases with")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"TF32 conv {torch.backends.cudnn.allow_tf32}, TF32 matmul {torch.backends.cuda.matmul.allow_tf32}")
    start = time.perf_counter()
    with torch.no_grad():
        for case in args.only:
            if case == "chain":
                chain_case(args.iters)
            else:
                model_case(case, args.iters, json.loads(args.options), args.inductor, args.dump, args.mode)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
