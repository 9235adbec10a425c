"""Eager, torch.compile and torchweld on the benchmark models (bench/models.py), side by side
in one run; each row is appended as a record to bench/records/<suite>.jsonl (bench/records.py)
and bench/render.py makes bench/RESULTS.md and the README's table from the records.
The shape of PyTorch's benchmarks/dynamo harness:

    python bench/harness.py --device cuda --phase inference --only resnet50,densenet121 --cold
    python bench/harness.py --device cuda --phase training --compilers eager,torch,torchweld --cold
    python bench/harness.py --device cpu --phase inference --only chain,mlp --cold --warm

The README's table (bench/render.py README_ROWS) comes from five runs on one GPU host, then
`python bench/render.py && python bench/render.py --readme`:

    python bench/harness.py --device cuda --cold --only chain,resnet50,densenet121,bert,gpt2,llama
    python bench/harness.py --device cuda --cold --mode reduce-overhead --only resnet50,densenet121,bert,gpt2
    python bench/harness.py --device cuda --cold --phase training --only resnet50,bert,gpt2
    python bench/harness.py --device cuda --cold --phase training --whole-step --only densenet121
    python bench/harness.py --device cuda --cold --phase training --whole-step --mode reduce-overhead --only densenet121

What is measured, per row and compiler:
- `cold_s` (with --cold): the compile() call and the first call (the first three under
  reduce-overhead, where torch.compile records its CUDA graph on the third; a training step
  is forward, loss, backward and Adam), in a fresh process of that compiler's own whose
  torchweld, Triton and Inductor caches start empty. Without --cold the caches are the
  user's, as found, and the figure is `first_s`. `warm_s` (with --warm): the same in a
  second fresh process, with the caches the first filled. `phases` / `warm_phases`
  (torchweld): `torchweld.compile_times()` after those first calls, seconds per phase;
  `warm_max_diff`: the warm process's first output against eager's.
- `ms`: steady state, the median over --repeat rounds of a round's time per call (each round
  a run of back-to-back calls, synchronized at both ends). On CUDA each compiler is timed in
  its fresh process (nothing another compiler left behind weighs on it); on the CPU, where
  a shared machine's load swings, all compilers are timed in one process, in turns, round by
  round, so that the swings hit all of them alike (--timing chooses).
- `speedup`: eager's ms over this compiler's; `cold_vs_torch`: its cold_s over torch.compile's.
- `peak_mib` / `reserved_mib` (CUDA): torch.cuda.max_memory_allocated / _reserved from before
  the model was built, over the cold calls and the timed ones, in the fresh process.
- `max_diff`: the largest absolute difference of the first output (training: the first loss)
  from eager's, and `rel_diff` that over eager's largest absolute value.
OMP_WAIT_POLICY is PASSIVE unless the environment sets it (records keep the environment's
OMP_*, MALLOC_*, TORCHWELD_* and TRITON_* variables).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout: bench.models, tests.models
from bench import runner  # noqa: E402
from bench.runner import COMPILERS, fmt, sync  # noqa: E402

runner.set_omp_wait_passive()  # before torch is imported, here and in the workers

MODES = ("default", "reduce-overhead", "max-autotune")
DTYPES = ("float32", "float16", "bfloat16", "amp_bfloat16", "amp_float16")  # amp_*: float32 model, torch.autocast
SUITE = "models"


# =============================================================================
# Timing
# =============================================================================


def calls_per_round(fn, device: str, seconds: float) -> int:
    """How many back-to-back calls of `fn` fill about `seconds` (at least 1), from three timed ones."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    sync(device)
    per_call = (time.perf_counter() - t0) / 3
    return max(1, math.ceil(seconds / max(per_call, 1e-7)))


def steady(fns: dict, device: str = "cpu", repeat: int = 5, min_time: float = 1.0, warmup: int = 3) -> dict:
    """Milliseconds per call of each of `fns` (argument-less callables): `repeat` rounds, each
    giving every function a run of back-to-back calls of about min_time/repeat seconds in
    turn (a, b, c, a, b, c, ...), so that a shared machine's load swings hit all of them
    alike. {name: (median ms per call, [ms per call of each round])}."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    gc.collect()  # the compiles' garbage collected now, not in a timed round
    counts = {name: calls_per_round(fn, device, min_time / repeat) for name, fn in fns.items()}
    rounds = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(counts[name]):
                fn()
            sync(device)
            rounds[name].append((time.perf_counter() - t0) / counts[name] * 1e3)
    return {name: (statistics.median(r), r) for name, r in rounds.items()}


# =============================================================================
# One compiler on one row: what a fresh process runs
# =============================================================================


def compile_for_row(job: dict, compiler: str, fn):
    """`fn` (a module or the step function) as `compiler` compiles it in the row's mode;
    torchweld with backend weld and the row's options."""
    mode = None if job["mode"] == "default" else job["mode"]
    weld = {"backend": "weld", "options": job["options"] or None} if compiler == "torchweld" else {}
    return runner.compile_with(compiler, fn, mode=mode, **weld)


def make_optimizer(job: dict, case):
    """Adam over the case's parameters for a training row (None for inference). Made before a
    cold timer starts: its constructor imports torch._dynamo, which no compiler should be charged
    (bench/DECISIONS.md#cold-includes-compile)."""
    import torch

    return torch.optim.Adam(case.model.parameters(), lr=1e-3) if job["phase"] == "training" else None


def model_dtype(job: dict):
    """The dtype of the row's parameters and inputs: float32 under autocast (the amp_* dtypes)."""
    import torch

    return torch.float32 if job["dtype"].startswith("amp_") else getattr(torch, job["dtype"])


def autocast_of(job: dict):
    """A context-manager factory: torch.autocast to the amp_* dtype on the row's device, else nothing."""
    import contextlib
    import functools

    import torch

    if not job["dtype"].startswith("amp_"):
        return contextlib.nullcontext
    return functools.partial(torch.autocast, job["device"], dtype=getattr(torch, job["dtype"][len("amp_"):]))


def make_callable(job: dict, compiler: str, case, opt=None):
    """The argument-less call the row times, returning what the compiled code returned. Inference
    calls the compiled model under no_grad; training runs one step with `opt`: zero_grad, forward,
    loss, backward, Adam, with the model compiled or (whole_step) the step function compiled. The
    amp_* dtypes run the forward (and the loss) under torch.autocast, outside the compiled model."""
    import torch

    amp = autocast_of(job)
    if job["phase"] == "inference":
        case.model.eval()
        compiled = compile_for_row(job, compiler, case.model)

        def infer():
            with torch.no_grad(), amp():
                return compiled(*case.inputs)
        return infer

    case.model.train()
    model = case.model if job["whole_step"] else compile_for_row(job, compiler, case.model)

    def step():
        opt.zero_grad(True)
        with amp():
            loss = case.loss(model(*case.inputs), case.target)
        loss.backward()
        opt.step()
        return loss.detach()
    if job["whole_step"]:
        step = compile_for_row(job, compiler, step)
    return step


def first_calls(job: dict) -> int:
    return 3 if job["mode"] == "reduce-overhead" else 1


def run_worker(job: dict) -> dict:
    """One compiler on one row, in this fresh process: cold (or first) calls, then, with
    job["time"], the steady state. Saves the first output to job["out"]."""
    import torch

    from bench.models import BENCHMARKS

    device, compiler = job["device"], job["compiler"]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    case = BENCHMARKS[job["model"]].make(device, job["quick"], model_dtype(job))
    opt = make_optimizer(job, case)
    sync(device)
    t0 = time.perf_counter()
    fn = make_callable(job, compiler, case, opt)
    out = fn()
    # a copy, before later calls: under CUDA graphs a replay overwrites what the last one returned
    out = out.detach().float().cpu().clone()
    for _ in range(first_calls(job) - 1):
        fn()
    sync(device)
    first_s = time.perf_counter() - t0
    result = {"label": case.label, "first_s": first_s}
    if compiler == "torchweld":  # where the first calls' compile went, phase by phase
        import torchweld

        result["phases"] = {name: round(s, 4) for name, s in torchweld.compile_times().items()}
    torch.save(out, job["out"])
    if job["time"]:
        ms, rounds = steady({compiler: fn}, device, job["repeat"], job["min_time"])[compiler]
        result.update(ms=ms, rounds_ms=rounds)
    if device == "cuda":
        result["peak_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
        result["reserved_mib"] = torch.cuda.max_memory_reserved() / 2 ** 20
    result["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


# =============================================================================
# A row: every compiler, then the ratios
# =============================================================================


def time_in_turns(job: dict, compilers: list[str], caches: dict[str, dict] | None) -> dict:
    """ms per call of every compiler, timed in this process in turns (see `steady`); each
    compiles with the caches its cold process filled."""
    import torch

    import torchweld
    from bench.models import BENCHMARKS

    benchmark = BENCHMARKS[job["model"]]
    fns, failed = {}, {}
    for compiler in compilers:
        case = benchmark.make(job["device"], job["quick"], model_dtype(job))
        cache_dir = (caches or {}).get(compiler, {}).get("TORCHWELD_CACHE_DIR") or torchweld.config.cache_dir
        try:
            with torchweld.config.patch(cache_dir=cache_dir):
                fn = make_callable(job, compiler, case, make_optimizer(job, case))
                fn()
            fns[compiler] = fn
        except Exception as e:  # noqa: BLE001 - one compiler failing should not end the row
            failed[compiler] = {"error": f"{type(e).__name__}: {e}"[:400]}
    timed = steady(fns, job["device"], job["repeat"], job["min_time"]) if fns else {}
    return {**{c: {"ms": ms, "rounds_ms": r} for c, (ms, r) in timed.items()}, **failed}


def run_row(job: dict, compilers: list[str], args) -> dict:
    """{compiler: figures} for one row, with speedups and differences from eager."""
    import torch

    figures: dict[str, dict] = {}
    outputs: dict[str, torch.Tensor] = {}
    warm_outputs: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory(prefix="torchweld-harness-") as tmp:
        caches = {c: runner.empty_caches(tmp, c) for c in compilers} if args.cold else None
        timed_here = args.timing == "fresh"
        for compiler in compilers:
            worker = dict(job, compiler=compiler, time=timed_here, out=os.path.join(tmp, f"{compiler}.pt"))
            got = runner.in_fresh_process(__file__, worker, caches[compiler] if caches else None)
            if "error" not in got:
                got["cold_s" if args.cold else "first_s"] = got.pop("first_s")
                got["cold_calls"] = first_calls(job)
                outputs[compiler] = torch.load(worker["out"])
                if args.warm:
                    again = runner.in_fresh_process(__file__, dict(worker, time=False, out=worker["out"] + ".warm"),
                                                    caches[compiler] if caches else None)
                    got["warm_s"] = again.get("first_s", math.nan)
                    if "phases" in again:
                        got["warm_phases"] = again["phases"]
                    if "error" not in again:  # what the caches gave back is compared with eager too
                        warm_outputs[compiler] = torch.load(worker["out"] + ".warm")
            figures[compiler] = got
            print(f"  {compiler:10s} {_summary(got)}", flush=True)
        if not timed_here:
            ok = [c for c in compilers if "error" not in figures[c]]
            for compiler, timed in time_in_turns(job, ok, caches).items():
                figures[compiler].update(timed)
    label = runner.take_shared(figures, "label")
    add_ratios(figures, outputs)
    for compiler, out in warm_outputs.items():
        if "eager" in outputs and out.shape == outputs["eager"].shape:
            figures[compiler]["warm_max_diff"] = (out - outputs["eager"]).abs().max().item()
    return {"label": label, "compilers": figures}


def add_ratios(figures: dict[str, dict], outputs: dict) -> None:
    eager, torch_ = figures.get("eager", {}), figures.get("torch", {})
    cold = "cold_s" if "cold_s" in torch_ or "cold_s" in eager else "first_s"
    for compiler, f in figures.items():
        if f.get("ms") and eager.get("ms"):
            f["speedup"] = eager["ms"] / f["ms"]
        if compiler not in ("eager", "torch") and f.get(cold) and torch_.get(cold):
            f["cold_vs_torch"] = f[cold] / torch_[cold]
        if compiler in outputs and "eager" in outputs and outputs[compiler].shape == outputs["eager"].shape:
            diff = (outputs[compiler] - outputs["eager"]).abs().max().item()
            f["max_diff"] = diff
            f["rel_diff"] = diff / max(outputs["eager"].abs().max().item(), 1e-12)


def _summary(f: dict) -> str:
    if "error" in f:
        return "failed: " + f["error"][:200]
    return runner.summary(f, ("ms", "cold_s", "first_s", "warm_s", "peak_mib"))


def print_table(label: str, figures: dict[str, dict]) -> None:
    header = f"{'':10s} {'ms':>9s} {'x eager':>8s} {'cold s':>8s} {'x tc cold':>9s} {'warm s':>7s} " \
             f"{'peak MiB':>9s} {'max diff':>9s}"
    print(f"{label}\n{header}")
    runner.print_rows(figures, 10, table_cells, error_chars=150)


def table_cells(f: dict) -> str:
    """A compiler's cells in print_table's line."""
    cold = f.get("cold_s", f.get("first_s"))
    return (f"{fmt(f.get('ms'), '9.3f'):>9s} {fmt(f.get('speedup'), '.2f'):>8s} {fmt(cold, '.2f'):>8s} "
            f"{fmt(f.get('cold_vs_torch'), '.3f'):>9s} {fmt(f.get('warm_s'), '.2f'):>7s} "
            f"{fmt(f.get('peak_mib'), '.0f'):>9s} {fmt(f.get('max_diff'), '.1e'):>9s}")


# =============================================================================
# Command line
# =============================================================================


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[],
                        help="benchmark names, comma-separated or repeated (bench/models.py: "
                             "chain, add_mul, mlp, cnn, block, tiny_mlp, resnet50, densenet121, bert, gpt2, llama); "
                             "default: the device's usual rows")
    runner.add_device_option(parser)
    parser.add_argument("--phase", choices=("inference", "training"), default="inference")
    parser.add_argument("--mode", choices=MODES, default="default")
    parser.add_argument("--compilers", default=",".join(COMPILERS), help="comma-separated: eager,torch,torchweld")
    parser.add_argument("--whole-step", action="store_true",
                        help="training: compile the whole step (zero_grad, forward, loss, backward, Adam), as the "
                             "torch.compile tutorial does, rather than the model alone (Adam native)")
    parser.add_argument("--cold", action="store_true",
                        help="each compiler's process starts with empty torchweld, Triton and Inductor caches")
    parser.add_argument("--warm", action="store_true",
                        help="then time the first call again in a second fresh process, the caches filled")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (the median is reported)")
    parser.add_argument("--min-time", type=float, default=2.0, help="seconds of timed calls per compiler, all rounds")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="the parameters' and inputs' dtype; amp_bfloat16/amp_float16: float32 under torch.autocast")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (the row's label says which)")
    parser.add_argument("--timing", choices=("fresh", "turns"), default=None,
                        help="steady state in each compiler's fresh process (CUDA's default) or in this "
                             "process, compilers in turns (the CPU's default)")
    parser.add_argument("--options", default="{}", help="torchweld options as JSON")
    parser.add_argument("--suite", default=SUITE, help="records go to bench/records/SUITE.jsonl")
    runner.add_record_and_worker_options(parser)
    args = parser.parse_args(argv)
    args.only = [name for item in args.only for name in runner.comma_separated(item)]
    args.compilers = runner.comma_separated(args.compilers)
    if problem := runner.unknown_compiler(args.compilers, COMPILERS):
        parser.error(problem)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return runner.answer_job(run_worker, args.worker)
    import torch

    from bench import records
    from bench.models import available, select

    runner.use_records_dir(args.records_dir)
    device = runner.pick_device(args.device)
    args.timing = args.timing or ("fresh" if device == "cuda" else "turns")
    options = json.loads(args.options)
    print(f"torch {torch.__version__}, {runner.device_name(device)}, {args.phase}, mode {args.mode}, {args.dtype}; "
          f"each compiler in a fresh process ({'empty caches' if args.cold else 'caches as found'}), "
          f"steady state {'there' if args.timing == 'fresh' else 'here, in turns'}")
    failures = 0
    for benchmark in select(args.only, device, args.phase):
        if not available(benchmark):
            print(f"{benchmark.name}: {benchmark.needs} is not installed; skipped")
            continue
        job = {"model": benchmark.name, "device": device, "phase": args.phase, "mode": args.mode,
               "dtype": args.dtype, "quick": args.quick, "whole_step": args.whole_step and args.phase == "training",
               "options": options, "repeat": args.repeat, "min_time": args.min_time}
        print(f"{benchmark.name}:", flush=True)
        figures = run_row(job, args.compilers, args)
        label = figures.pop("label") or benchmark.name
        print_table(label, figures["compilers"])
        failures += sum("error" in f for f in figures["compilers"].values())
        row = {"model": benchmark.name, "label": label, "phase": args.phase, "step": _step(job), "mode": args.mode,
               "device": device, "dtype": args.dtype}
        if not args.no_record:
            record = records.make_record(args.suite, figures, options=runner.record_options(args), row=row)
            path = records.append(args.suite, record)
            print(f"  appended to {path}")
    return 1 if failures else 0


def _step(job: dict) -> str | None:
    if job["phase"] != "training":
        return None
    return "whole step" if job["whole_step"] else "model"


if __name__ == "__main__":
    sys.exit(main())
