"""Where the GPU time of a mixed-precision training step goes: torchweld against torch.compile, kernel by kernel.

    python bench/investigations/profile_amp_train.py --model gpt2_s1024 [--model llama_1b,resnet50_b64]
        [--device cuda] [--steps 20] [--profile-steps 5] [--warmup 3] [--compilers torchweld,torch]
        [--quick] [--out FILE] [--trace-dir DIR]

The harness's amp_bfloat16 training rows (bench/harness.py --phase training --dtype amp_bfloat16,
the model compiled, default mode): each --model is built by its bench/models.py builder
(Benchmark.make seeds torch.manual_seed(0), so every compiler starts from the same weights and
inputs) and its step comes from harness.make_callable: zero_grad, forward and loss under
torch.autocast(bfloat16), backward, Adam. In this one process, torchweld first, then torch.compile,
each compiler: --warmup steps (the first compiles; its wall time is `first_s`), --steps steps timed
with CUDA events recorded back to back (median ms; `wall_ms`: host time per step over the run),
then --profile-steps steps under torch.profiler. From the profile, per step: GPU busy time (kernels,
memcpy and memset), the number of kernels, GPU time by category of kernel name (matmul, attention,
generated: torchweld's k_<hex> and Inductor's triton_*, optimizer, copy/convert, norm, conv, other),
and the top 25 kernels; and peak memory (max_memory_allocated, reset per compiler).

It prints, per model, a side-by-side table (category | weld ms/step (count) | torch ms/step (count) |
weld - torch), each compiler's top kernels, and torchweld.tools.trace_diff's comparison of the two
Chrome traces (control torch.compile, test torchweld: a positive diff is time torchweld spends more),
the 15 kernels that differ most, per step (needs pandas; skipped without it). --trace-dir keeps the
traces as DIR/<model>/weld.json and torch.json (else they go to a temporary folder), for
`python -m torchweld.tools.trace_diff DIR/<model>/torch.json DIR/<model>/weld.json`. --out writes
everything as one JSON object, keyed by model, rewritten after each model. A compiler or model
that fails is printed and recorded as {"error": ...}; the run goes on.

Under the profiler torchweld runs its profiled wrappers (a record_function range per kernel, no fast
launches), so the profiled steps' kernel durations compare, their gaps do not: the step times are
measured before, unprofiled. On the CPU (a smoke test) autocast is CPU bfloat16, timings are
perf_counter, and the "kernels" are the profiler's CPU ops with their own (self) CPU time; there
"generated" is torchweld's "torchweld kernel..." ranges and Inductor's "## Call CompiledFxGraph" ranges.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
from bench.harness import make_callable, make_optimizer, model_dtype  # noqa: E402  (sets OMP_WAIT_POLICY first)

import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401  (imported before anything is timed)

import torchweld  # noqa: E402
from bench.models import BENCHMARKS, available  # noqa: E402

SHORT = {"torchweld": "weld", "torch": "torch"}
CATEGORIES = (  # (category, pattern over the lowercased name), the first match wins
    ("generated", r"^(k_[0-9a-f]|triton_|torchweld kernel|## call compiledfxgraph)"),  # the last two: CPU
    ("optimizer", r"multi_tensor_apply|foreach|adam"),
    ("attention", r"flash|fmha|attention|efficient"),
    ("norm", r"layer_?norm|batch_?norm|rms_?norm|bn_fw|bn_bw"),
    ("conv", r"conv(?!ert)|implicit_gemm|cudnn|xmma_fprop|xmma_dgrad|xmma_wgrad|fprop|dgrad|wgrad"),
    ("matmul", r"gemm|cutlass|nvjet|sm90_xmma|cublas|splitk|s16816|wgmma|::mm$|addmm|bmm"),
    ("copy/convert", r"copy|catarray|memcpy|memset|convert|fill|transpose"),
)


def category(name: str) -> str:
    lowered = name.lower()
    return next((c for c, pattern in CATEGORIES if re.search(pattern, lowered)), "other")


def make_job(model: str, device: str, quick: bool) -> dict:
    """The job dict bench/harness.py's main builds for an amp_bfloat16 training row."""
    return {"model": model, "device": device, "phase": "training", "mode": "default", "dtype": "amp_bfloat16",
            "quick": quick, "whole_step": False, "options": {}}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def warm_up(step, calls: int, device: str) -> float:
    """Run `calls` steps (the first compiles); the first one's wall seconds."""
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    first_s = time.perf_counter() - t0
    for _ in range(calls - 1):
        step()
    sync(device)
    return first_s


def time_steps(step, steps: int, device: str) -> tuple[float, float]:
    """(median ms per step, host wall ms per step): CUDA events around each step, back to back, on CUDA."""
    if device != "cuda":
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), sum(times) / steps
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    sync(device)
    t0 = time.perf_counter()
    for begin, end in events:
        begin.record()
        step()
        end.record()
    sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    return statistics.median(b.elapsed_time(e) for b, e in events), wall_ms


def profile_steps(step, steps: int, device: str, trace_path: str | None):
    """torch.profiler over `steps` steps; the Chrome trace goes to `trace_path`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return prof


def device_events(prof, device: str) -> list[tuple[str, float]]:
    """(name, us) of each kernel, memcpy and memset on CUDA (no user annotations); on the CPU each
    CPU op with its self time."""
    if device == "cuda":
        cuda = torch.autograd.DeviceType.CUDA
        return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                if e.device_type == cuda and not getattr(e, "is_user_annotation", False)]
    return [(e.name, e.self_cpu_time_total) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]


def summarize(events: list[tuple[str, float]], steps: int) -> dict:
    """Per step: busy ms, kernel and memcpy/memset counts, ms and count by category, every kernel by time."""
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, us in events:
        by_name[name][0] += 1
        by_name[name][1] += us
    copies = sum(n for name, (n, _) in by_name.items() if name.startswith(("Memcpy", "Memset")))
    cats = collections.defaultdict(lambda: {"ms": 0.0, "count": 0.0})
    for name, (n, us) in by_name.items():
        cats[category(name)]["ms"] += us / 1e3 / steps
        cats[category(name)]["count"] += n / steps
    kernels = [{"name": name, "count": n / steps, "ms": us / 1e3 / steps, "mean_us": us / n}
               for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])]
    return {"busy_ms": sum(us for _, us in events) / 1e3 / steps, "kernels": (len(events) - copies) / steps,
            "memcpy_memset": copies / steps, "categories": dict(cats), "by_kernel": kernels}


def profile_compiler(job: dict, compiler: str, args, trace_path: str | None) -> dict:
    """One compiler on one row: warm-up, timing, profile; the figures."""
    device = job["device"]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    case = BENCHMARKS[job["model"]].make(device, job["quick"], model_dtype(job))  # seeds 0: same weights
    opt = make_optimizer(job, case)
    step = make_callable(job, compiler, case, opt)
    result = {"label": case.label, "first_s": warm_up(step, args.warmup, device)}
    result["ms"], result["wall_ms"] = time_steps(step, args.steps, device)
    prof = profile_steps(step, args.profile_steps, device, trace_path)
    result.update(summarize(device_events(prof, device), args.profile_steps))
    if device == "cuda":
        result["peak_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
    return result


def free_memory(device: str) -> None:
    torch._dynamo.reset()
    torchweld.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def cell(result: dict, key: str) -> str:
    return "error" if "error" in result else "-" if key not in result else f"{result[key]:18.3f}"


def print_categories(results: dict, device: str) -> None:
    """category | weld ms/step (count) | torch ms/step (count) | weld - torch, and the totals."""
    weld, tc = results.get("torchweld", {}), results.get("torch", {})
    busy, kernels = ("GPU busy ms/step", "kernels/step") if device == "cuda" else ("CPU ops' self ms/step", "ops/step")
    print(f"  {'':22s} {'weld':>18s} {'torch':>18s} {'weld - torch':>13s}")
    for key, label in (("ms", "step ms (median)"), ("wall_ms", "step ms (host wall)"), ("busy_ms", busy),
                       ("kernels", kernels), ("memcpy_memset", "memcpy+memset/step"), ("first_s", "first step s"),
                       ("peak_mib", "peak MiB")):
        diff = (weld[key] - tc[key]) if key in weld and key in tc else float("nan")
        print(f"  {label:22s} {cell(weld, key):>18s} {cell(tc, key):>18s} {diff:13.3f}")
    cats = [c for c, _ in CATEGORIES] + ["other"]
    print(f"  {'category':22s} {'weld ms (count)':>18s} {'torch ms (count)':>18s} {'diff ms':>13s}")
    for cat in cats:
        w, t = (r.get("categories", {}).get(cat, {"ms": 0.0, "count": 0.0}) for r in (weld, tc))
        print(f"  {cat:22s} {w['ms']:9.3f} ({w['count']:6.0f}) {t['ms']:9.3f} ({t['count']:6.0f}) "
              f"{w['ms'] - t['ms']:13.3f}")


def print_top(compiler: str, result: dict, top: int) -> None:
    if "error" in result:
        return
    print(f"  {SHORT[compiler]}: top {top} kernels by time per step")
    print(f"    {'kernel':90s} {'n/step':>7s} {'ms/step':>8s} {'mean us':>9s}")
    for k in result["by_kernel"][:top]:
        print(f"    {k['name'][:90]:90s} {k['count']:7.1f} {k['ms']:8.3f} {k['mean_us']:9.1f}")


def trace_diff_rows(torch_trace: str, weld_trace: str, steps: int, device: str, top: int = 15) -> list[dict]:
    """torchweld.tools.trace_diff over the two traces (control torch.compile, test torchweld): the `top`
    kernels (CPU ops on the CPU) whose time differs most, per step. [] without pandas."""
    try:
        import pandas  # noqa: F401
    except ModuleNotFoundError:
        print("  trace diff: pandas is not installed; skipped")
        return []
    from torchweld.tools.trace_diff import classify_ops, compare_traces, top_differences

    df = compare_traces(torch_trace, weld_trace)
    df = df[df["category"] == ("kernel" if device == "cuda" else "cpu_op")]
    changes = classify_ops(df)
    print(f"  trace diff (torch.compile -> torchweld), {len(changes.added)} kernels only in weld, "
          f"{len(changes.deleted)} only in torch, {len(changes.increased)} more often in weld, "
          f"{len(changes.decreased)} less often")
    rows = []
    print(f"    {'kernel':90s} {'torch n':>8s} {'weld n':>7s} {'torch ms':>9s} {'weld ms':>8s} {'diff ms':>8s}")
    for name, r in top_differences(df, top).iterrows():
        row = {"name": name, "torch_count": r.control_counts / steps, "weld_count": r.test_counts / steps,
               "torch_ms": r.control_duration / 1e3 / steps, "weld_ms": r.test_duration / 1e3 / steps,
               "diff_ms": r.diff_duration / 1e3 / steps}
        rows.append(row)
        print(f"    {name[:90]:90s} {row['torch_count']:8.1f} {row['weld_count']:7.1f} {row['torch_ms']:9.3f} "
              f"{row['weld_ms']:8.3f} {row['diff_ms']:8.3f}")
    return rows


def run_model(model: str, args, trace_dir: str) -> dict:
    """Every compiler on one model, printed; its figures (with the top kernels) and the trace diff."""
    if model not in BENCHMARKS:
        return {"error": f"unknown model {model!r}; known: {', '.join(BENCHMARKS)}"}
    if not available(BENCHMARKS[model]):
        return {"error": f"{BENCHMARKS[model].needs} is not installed"}
    job = make_job(model, args.device, args.quick)
    os.makedirs(os.path.join(trace_dir, model), exist_ok=True)
    traces, results = {}, {}
    for compiler in args.compilers:
        traces[compiler] = os.path.join(trace_dir, model, f"{SHORT[compiler]}.json")
        try:
            results[compiler] = profile_compiler(job, compiler, args, traces[compiler])
            print(f"  {SHORT[compiler]:6s} {results[compiler]['ms']:.3f} ms/step, first step "
                  f"{results[compiler]['first_s']:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - one compiler failing should not end the run
            traceback.print_exc(limit=3)
            results[compiler] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        free_memory(args.device)
    label = next((r["label"] for r in results.values() if "label" in r), model)
    print(f"{label} ({args.device}, amp_bfloat16 training, {args.profile_steps} profiled steps):")
    print_categories(results, args.device)
    for compiler, result in results.items():
        print_top(compiler, result, args.top)
    out = {"label": label, "compilers": results}
    if all(c in results and "error" not in results[c] for c in ("torchweld", "torch")):
        try:
            out["trace_diff"] = trace_diff_rows(traces["torch"], traces["torchweld"], args.profile_steps, args.device)
        except Exception as e:  # noqa: BLE001
            print(f"  trace diff failed: {type(e).__name__}: {e}")
            out["trace_diff"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def write_json(path: str | None, report: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True,
                        help="bench/models.py names; repeat or comma-separate")
    parser.add_argument("--device", default=None, help="cuda where available, else cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing; the first compiles")
    parser.add_argument("--compilers", default="torchweld,torch")
    parser.add_argument("--top", type=int, default=25, help="rows of each compiler's kernel table")
    parser.add_argument("--quick", action="store_true", help="the benchmarks' small sizes")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--trace-dir", default=None, help="keep the Chrome traces as DIR/<model>/{weld,torch}.json")
    args = parser.parse_args(argv)
    args.models = [m for arg in args.model for m in arg.split(",") if m]
    args.compilers = [c for c in args.compilers.split(",") if c]
    if unknown := set(args.compilers) - set(SHORT):
        parser.error(f"unknown compiler(s) {sorted(unknown)}; known: torchweld, torch")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.warmup = max(args.warmup, 1)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}; warm-up {args.warmup}, {args.steps} timed steps, "
          f"{args.profile_steps} profiled steps", flush=True)
    report = {"torch": torch.__version__, "device": where, "args": vars(args), "models": {}}
    with tempfile.TemporaryDirectory(prefix="profile-amp-") as tmp:
        for model in args.models:
            print(f"{model}:", flush=True)
            report["models"][model] = run_model(model, args, args.trace_dir or tmp)
            if "error" in report["models"][model]:
                print(f"  {report['models'][model]['error']}")
            write_json(args.out, report)
    if args.out:
        print(f"wrote {args.out}")
    failed = [m for m, r in report["models"].items()
              if "error" in r or any("error" in c for c in r.get("compilers", {}).values())]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
