"""Where a training step's time goes: eager vs weld, the torch.compile tutorial's step.

    python3 bench/investigations/profile_train_gpu.py [--model densenet121|resnet50|BERT|GPT-2] [--batch 16] [--size 128]
                                       [--mode MODE] [--options JSON] [--steps 20] [--compile-profile]
                                       [--compile-optimizer] [--inductor]

One step = opt.zero_grad(True); loss = loss_fn(model(x), y); loss.backward(); opt.step() with
Adam, float32, on CUDA. torchvision models take 3x<size>x<size> images and CrossEntropyLoss;
BERT and GPT-2 (transformers' default configs, as in bench/investigations/compare.py) take <size> tokens and
the mean squared error of their last hidden state against a random target. For eager and for weld (the model compiled with
torchweld.compile(backend="weld", mode=MODE); the optimizer runs natively, or with
--compile-optimizer as weld compiles it) it prints:
  - ms per step: median of CUDA-event timings of single steps (what bench/investigations/compare.py reports);
  - per phase (forward+loss, backward, optimizer): CPU ms to enqueue it, and the wall ms
    between CUDA events around it (the larger of CPU and GPU time when the GPU waits);
  - GPU busy time per step: the sum of kernel, memcpy and memset durations (torch.profiler),
    with counts, and the top kernels, so "CPU-bound" and "GPU-bound" read off at once;
  - weld: what its forward and backward wrappers contain, and the top Python functions
    of 5 steps by own time (cProfile).
--inductor profiles torch.compile's step (the model compiled with the same --mode, Adam native) the
same way.
--compile-profile runs weld's first step (capture, joint trace, partition, code
generation, Triton compiles) under cProfile and prints where the cold compile goes.
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import gc
import glob
import io
import json
import os
import pstats
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-cache-"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import torchweld  # noqa: E402
from profile_weld_gpu import GraphSpy, kernel_table  # noqa: E402
from torchweld import config  # noqa: E402


TRANSFORMERS = {"BERT": ("BertModel", "BertConfig", 30000), "GPT-2": ("GPT2Model", "GPT2Config", 50000)}


def make_model(name: str) -> nn.Module:
    if name in TRANSFORMERS:
        import transformers
        from compare import LastHidden

        model_class, config_class, _ = TRANSFORMERS[name]
        return LastHidden(getattr(transformers, model_class)(getattr(transformers, config_class)())).cuda().train()
    import torchvision

    return getattr(torchvision.models, name)().cuda().train()


def make_batch(name: str, batch: int, size: int):
    """(x, y, loss_fn) for model `name`."""
    if name in TRANSFORMERS:
        x = torch.randint(0, TRANSFORMERS[name][2], (batch, size), device="cuda")
        return x, torch.randn(batch, size, 768, device="cuda"), lambda out, target: (out - target).square().mean()
    x = torch.randn(batch, 3, size, size, device="cuda")
    return x, torch.randint(0, 1000, (batch,), device="cuda"), nn.CrossEntropyLoss()


def optimizer_step(opt):
    opt.step()


class Step:
    """The tutorial's train step, timed per phase with CUDA events and perf_counter.
    `compile_optimizer`: Adam's step runs as weld compiled it (captured into a graph)."""

    def __init__(self, model: nn.Module, compiled, x: torch.Tensor, y: torch.Tensor, loss_fn,
                 compile_optimizer: bool = False):
        self.opt = torch.optim.Adam(model.parameters())
        self.compiled, self.x, self.y = compiled, x, y
        self.loss_fn = loss_fn
        self.optimizer_step = torchweld.compile(optimizer_step, backend="weld") if compile_optimizer else optimizer_step

    def __call__(self, timed: bool = False):
        marks = []

        def mark():
            if timed:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                marks.append((time.perf_counter(), event))

        mark()
        self.opt.zero_grad(True)
        loss = self.loss_fn(self.compiled(self.x), self.y)
        mark()
        loss.backward()
        mark()
        self.optimizer_step(self.opt)
        mark()
        return loss.detach(), marks


PHASES = ("forward+loss", "backward", "optimizer")


def phase_times(step: Step, steps: int) -> tuple[float, list[tuple[float, float]]]:
    """(median ms per step, per phase (median CPU ms, median event ms))."""
    totals, cpu, wall = [], [[] for _ in PHASES], [[] for _ in PHASES]
    for _ in range(steps):
        torch.cuda.synchronize()
        _, marks = step(timed=True)
        torch.cuda.synchronize()
        totals.append(marks[0][1].elapsed_time(marks[-1][1]))
        for i in range(len(PHASES)):
            cpu[i].append((marks[i + 1][0] - marks[i][0]) * 1e3)
            wall[i].append(marks[i][1].elapsed_time(marks[i + 1][1]))
    return statistics.median(totals), [(statistics.median(c), statistics.median(w)) for c, w in zip(cpu, wall)]


def profiled(step: Step, calls: int = 2):
    """(the CUDA-side events of `calls` steps, a table of the CPU ops and CUDA API calls by own time)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=24, max_name_column_width=60)
    return [e for e in prof.events() if e.device_type == cuda and not e.name.startswith("Optimizer.")], table


class GcTimer:
    """Python's garbage collections while active: how many, by generation, and their total ms."""

    def __enter__(self):
        self.count, self.ms, self._start = collections.Counter(), 0.0, 0.0
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.ms += (time.perf_counter() - self._start) * 1e3


GENERATED_PREFIXES = ("k_", "triton_")  # weld's kernels are k_<hash>, torch.compile's triton_*
KERNEL_KINDS = (  # (kind, parts of a library kernel's name), first match wins
    ("matmul", ("gemm", "xmma", "sgemm", "cutlass::Kernel")),
    ("attention", ("fmha", "attention", "flash")),
    ("optimizer (aten foreach)", ("multi_tensor_apply",)),
    ("memcpy/memset", ("memcpy", "memset", "Memcpy", "Memset")),
)


def kernel_kinds(events, calls: int) -> str:
    """GPU time per step by kind of kernel: the generated kernels apart from the library's."""
    total = collections.Counter()
    for e in events:
        kind = "generated" if e.name.startswith(GENERATED_PREFIXES) else \
            next((k for k, parts in KERNEL_KINDS if any(p in e.name for p in parts)), "other aten")
        total[kind] += e.time_range.elapsed_us() / calls
    return "    GPU us/step by kind: " + ", ".join(f"{k} {us:.0f}" for k, us in total.most_common())


def idle_gaps(events, calls: int, top: int = 10) -> str:
    """Where the GPU waits: its idle time per step between kernels, and the longest gaps
    with the kernels on either side (a gap before a kernel is the CPU launching it late)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    gaps, busy_until, before = [], None, ""
    for start, end, name in spans:
        if busy_until is not None and start > busy_until:
            gaps.append((start - busy_until, before, name))
        if busy_until is None or end > busy_until:
            busy_until, before = end, name
    total = sum(g for g, _, _ in gaps) / calls
    lines = [f"    GPU idle between kernels: {total:.0f} us/step in {len(gaps) / calls:.0f} gaps; the longest:"]
    lines += [f"      {gap:7.1f} us  after {a[:60]}  before {b[:60]}" for gap, a, b in sorted(gaps, reverse=True)[:top]]
    return "\n".join(lines)


def report(label: str, step: Step, steps: int, top_kernels: int = 16) -> float:
    for _ in range(3):
        step()
    with GcTimer() as gc_time:
        ms, phases = phase_times(step, steps)
    print(f"  {label}: {ms:8.3f} ms/step")
    print(f"    Python GC over {steps} steps: {dict(gc_time.count)} collections by generation, {gc_time.ms:.2f} ms")
    for name, (cpu, wall) in zip(PHASES, phases):
        print(f"    {name:13s} CPU {cpu:8.3f} ms   events {wall:8.3f} ms")
    calls = 2
    events, cpu_table = profiled(step, calls)
    busy = sum(e.time_range.elapsed_us() for e in events) / calls / 1e3
    copies = sum(1 for e in events if "memcpy" in e.name.lower() or "memset" in e.name.lower())
    print(f"    GPU busy {busy:8.3f} ms/step in {(len(events) - copies) / calls:.0f} kernels "
          f"+ {copies / calls:.0f} memcpy/memset")
    print(kernel_kinds(events, calls))
    print(idle_gaps(events, calls))
    print(kernel_table(events, calls, top=top_kernels))
    print(f"    CPU ops and CUDA API calls of {calls} steps, by own CPU time (torch.profiler):")
    print("\n".join("      " + line for line in cpu_table.splitlines()))
    return ms


def count_jit_fallbacks(graphs) -> tuple[collections.Counter, collections.Counter]:
    """Count, per compiled graph from now on, its calls and those that fell back to `call_jit`."""
    calls, jit_calls = collections.Counter(), collections.Counter()
    for i, graph in enumerate(graphs):
        namespace = graph.fn.__globals__
        if "call_jit" not in namespace:
            continue

        def counted(*args, _fn=graph.fn, _i=i):
            calls[_i] += 1
            return _fn(*args)

        def counted_jit(*args, _fn=namespace["call_jit"], _i=i):
            jit_calls[_i] += 1
            return _fn(*args)

        graph.fn, namespace["call_jit"] = counted, counted_jit
    return calls, jit_calls


def dump_kernels(step: Step, graphs, top: int) -> None:
    """The Triton source of weld's `top` kernels by GPU time per step."""
    events, _ = profiled(step, 1)
    total = collections.Counter()
    for e in events:
        if e.name.startswith("k_"):
            total[e.name] += e.time_range.elapsed_us()
    sources = "\n".join(g.kernel_sources.get("triton", "") for g in graphs)
    for name, us in total.most_common(top):
        start = sources.find(f"def {name}(")
        if start < 0:
            continue
        start = sources.rfind("@triton.jit", 0, start)
        end = sources.find("@triton.jit", start + 1)
        print(f"\n  -- {name}: {us:.1f} us per step\n{sources[start:end if end > 0 else None].rstrip()}")


def python_profile(step: Step, calls: int = 5, top: int = 22) -> str:
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    text = out.getvalue()
    return text[text.index("ncalls"):]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="densenet121")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--mode", default=None)
    parser.add_argument("--options", default="{}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile-profile", action="store_true")
    parser.add_argument("--skip-eager", action="store_true")
    parser.add_argument("--inductor", action="store_true", help="profile torch.compile's step too (the model compiled)")
    parser.add_argument("--compile-optimizer", action="store_true",
                        help="weld's step runs Adam as weld captured and compiled it, not natively")
    parser.add_argument("--save-wrappers", default=None, help="copy weld's generated wrappers into this folder")
    parser.add_argument("--top-kernels", type=int, default=16, help="rows of the GPU kernel table")
    parser.add_argument("--dump-kernels", type=int, default=0, help="print the source of weld's N slowest kernels")
    args = parser.parse_args()
    shape = f"s{args.size}" if args.model in TRANSFORMERS else f"3x{args.size}x{args.size}"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.model} b{args.batch} "
          f"{shape}, mode={args.mode}, options={args.options}")
    torch.manual_seed(0)
    x, y, loss_fn = make_batch(args.model, args.batch, args.size)
    eager_ms = None
    if not args.skip_eager:
        model = make_model(args.model)
        eager_ms = report("eager", Step(model, model, x, y, loss_fn), args.steps, args.top_kernels)
        del model
    if args.inductor:
        model = make_model(args.model)
        step = Step(model, torch.compile(model, mode=args.mode), x, y, loss_fn)
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        print(f"  torch.compile cold first step: {time.perf_counter() - t0:.1f} s")
        inductor_ms = report("torch.compile", step, args.steps, args.top_kernels)
        if eager_ms:
            print(f"  torch.compile speedup over eager: {eager_ms / inductor_ms:.2f}x")
        del model, step
    model = make_model(args.model)
    with tempfile.TemporaryDirectory() as tmp, config.patch(cache_dir=tmp), GraphSpy() as spy:
        compiled = torchweld.compile(model, backend="weld", mode=args.mode, options=json.loads(args.options))
        step = Step(model, compiled, x, y, loss_fn, compile_optimizer=args.compile_optimizer)
        torch.cuda.synchronize()
        profiler = cProfile.Profile() if args.compile_profile else None
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        step()
        torch.cuda.synchronize()
        if profiler:
            profiler.disable()
        print(f"  weld cold first step: {time.perf_counter() - t0:.1f} s")
        print("\n".join("    " + line for line in torchweld.compile_times("str").splitlines()))
        if profiler:
            for key in ("cumulative", "tottime"):
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(28)
                text = out.getvalue()
                print(f"\n-- cold step by {key}\n" + text[text.index("ncalls"):])
        calls, jit_calls = count_jit_fallbacks(spy.graphs)
        weld_ms = report("weld", step, args.steps, args.top_kernels)
        if args.dump_kernels:
            dump_kernels(step, spy.graphs, args.dump_kernels)
        if args.save_wrappers:
            os.makedirs(args.save_wrappers, exist_ok=True)
            for path in glob.glob(os.path.join(tmp, "wrappers", "*.py")):
                shutil.copy(path, args.save_wrappers)
    if eager_ms:
        print(f"  weld speedup over eager: {eager_ms / weld_ms:.2f}x")
    print("  weld wrappers (forward, backward):")
    print(spy.summary())
    for i in calls:
        print(f"      graph {i}: {jit_calls[i]} of {calls[i]} calls took the JIT launches (an input not 16-byte aligned)")
    print("  weld Python time, 5 steps (cProfile, by own time):")
    print(python_profile(step))
    counts = collections.Counter(type(m).__name__ for m in model.modules())
    print(f"  modules: {dict(counts.most_common(6))}")


if __name__ == "__main__":
    main()
