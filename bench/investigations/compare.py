"""Eager vs torch.compile vs torchweld (weld backend), side by side in one run.

    .venv/bin/python bench/investigations/compare.py [--quick]

Reports steady-state time per call, speedup over eager, and the cold compile
time (first call, with an empty torchweld kernel cache and inductor's caches off;
training rows (--train) time each compiler's cold step in a fresh process of its own;
the CUDA-mode rows (--cuda-modes) run each compiler's whole row in a fresh process).
On the CPU, eager, torch.compile and weld are timed in turns (see `steady`), so that
the load of a shared machine weighs on all three alike; torch.compile runs first,
so its compile() call imports torch._dynamo, which weld then finds imported.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import tempfile
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout: bench.models

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import torchweld  # noqa: E402
from bench.models import CNN, Block, Chain, LastHidden, mlp  # noqa: E402, F401  (the models, defined once)
from torchweld import config  # noqa: E402


def weld_compile(model):
    """torchweld.compile when capture is there; else the weld backend on a symbolic trace."""
    if hasattr(torchweld, "compile"):
        return torchweld.compile(model, backend="weld")
    from torchweld.backends import lookup_backend

    backend = lookup_backend("weld")
    compiled = {}

    def run(*args):
        if "fn" not in compiled:
            compiled["fn"] = backend(torch.fx.symbolic_trace(model), list(args))
        return compiled["fn"](*args)

    return run


def steady(fns: dict, x, min_time=1.0, rounds=5) -> dict:
    """Median seconds per call of each of `fns`, timed in turns: `rounds` rounds, each giving every
    function min_time/rounds of calls, so that a shared machine's load swings hit all of them alike."""
    for fn in fns.values():
        for _ in range(3):
            fn(x)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            while len(times[name]) < 2 or time.perf_counter() - start < min_time / rounds:
                t0 = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


SKIPPED_VARIANTS: set[str] = set()  # filled from the command line
ONLY_ROWS: list[str] = []  # --only: row names must contain one of these


def wanted(row_name: str) -> bool:
    return not ONLY_ROWS or any(part in row_name for part in ONLY_ROWS)


def selected(variants: list) -> list:
    return [v for v in variants if v[0] not in SKIPPED_VARIANTS]


def first_call(fn, x):
    t0 = time.perf_counter()
    out = fn(x)
    return time.perf_counter() - t0, out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller shapes, shorter timing")
    parser.add_argument("--train", action="store_true",
                        help="training rows: forward + backward + Adam step (see training_rows)")
    parser.add_argument("--skip-inductor", action="store_true",
                        help="leave torch.compile out (its cold compiles take minutes on the big rows)")
    parser.add_argument("--cuda-modes", action="store_true",
                        help="CUDA only: mode='reduce-overhead' / 'max-autotune' rows (see cuda_mode_rows)")
    parser.add_argument("--whole-step", action="store_true",
                        help="--train: compile the whole step function (zero_grad, forward, loss, backward, "
                             "Adam), as the tutorial does, rather than the model alone")
    parser.add_argument("--train-mode", default=None,
                        help="--train: the mode both compilers compile with (e.g. reduce-overhead)")
    parser.add_argument("--only", default="", help="comma-separated parts of row names to run")
    parser.add_argument("--modes", default="reduce-overhead,max-autotune", help="comma-separated modes for --cuda-modes")
    parser.add_argument("--cold-here", action="store_true",
                        help="--train: time each compiler's cold step in this process, after the variants "
                             "before it, rather than in a fresh process of its own")
    parser.add_argument("--cold-only", default=None, help=argparse.SUPPRESS)  # a fresh process's one cold step
    parser.add_argument("--cuda-here", action="store_true",
                        help="--cuda-modes: run every compiler's row in this process, in turn, rather than "
                             "each in a fresh process of its own")
    parser.add_argument("--variant-only", default=None, help=argparse.SUPPRESS)  # a fresh process's one row
    parser.add_argument("--out-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    ONLY_ROWS.extend(p.strip() for p in args.only.split(",") if p.strip())
    q = args.quick
    if args.skip_inductor:
        SKIPPED_VARIANTS.add("inductor")
    if args.cuda_modes:
        return cuda_mode_rows(q, tuple(m.strip() for m in args.modes.split(",") if m.strip()), not args.cuda_here,
                              args.variant_only, args.out_file)
    if args.train:
        return training_rows(q, args.whole_step, args.train_mode, args.cold_only, not args.cold_here)
    cases = [
        ("elementwise chain 4M f32", Chain(), torch.randn(1 << 20 if q else 1 << 22)),
        ("MLP 4x1024 LN+GELU b64", mlp(256 if q else 1024), torch.randn(64, 256 if q else 1024)),
        ("CNN conv/bn/relu/pool", CNN(), torch.randn(8, 3, 32 if q else 64, 32 if q else 64)),
        ("transformer block", Block(d=256, heads=8), torch.randn(4 if q else 8, 64 if q else 128, 256)),
    ]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    header = f"{'case':28s} {'eager ms':>9s} {'inductor ms':>11s} {'weld ms':>8s} {'ind x':>6s} {'weld x':>7s} " \
             f"{'ind cold s':>10s} {'weld cold s':>11s} {'weld warm s':>11s}"
    print(header)
    print("-" * len(header))
    for name, model, x in [c for c in cases if wanted(c[0])]:
        model.eval()
        with torch.no_grad():
            torch._dynamo.reset()
            inductor = torch.compile(model)
            ind_cold, ind_out = first_call(inductor, x)
            with tempfile.TemporaryDirectory() as tmp, config.patch(cache_dir=tmp):
                welded = weld_compile(model)
                weld_cold, weld_out = first_call(welded, x)
                weld_warm, _ = first_call(weld_compile(model), x)  # same kernels, found on disk
            timed = steady({"eager": model, "inductor": inductor, "weld": welded}, x,
                           min_time=1.5 if q else 3.0)
            eager, ind, weld = timed["eager"], timed["inductor"], timed["weld"]
            expected = model(x)
            torch.testing.assert_close(weld_out, expected, atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(ind_out, expected, atol=1e-3, rtol=1e-3)
        print(f"{name:28s} {eager * 1e3:9.3f} {ind * 1e3:11.3f} {weld * 1e3:8.3f} {eager / ind:6.2f} "
              f"{eager / weld:7.2f} {ind_cold:10.2f} {weld_cold:11.2f} {weld_warm:11.2f}")


# =============================================================================
# CUDA: reduce-overhead (CUDA graphs) and max-autotune, with cold time and memory
# =============================================================================


def cuda_mode_cases(q: bool):
    """(name, make() -> (fn, args), train) rows: densenet121 inference and the torch.compile tutorial's
    train step (densenet121, batch 16, 3x128x128, Adam), resnet50, BERT, GPT-2; guarded imports."""
    dev = "cuda"
    rows = []
    try:
        import torchvision

        def densenet():
            return torchvision.models.densenet121().to(dev).eval(), (torch.randn(16, 3, 128, 128, device=dev),)

        def densenet_train():
            model = torchvision.models.densenet121().to(dev).train()
            data = (torch.randn(16, 3, 128, 128, device=dev), torch.randint(0, 1000, (16,), device=dev))
            return model, data

        rows += [("densenet121 b16 infer", densenet, False), ("densenet121 b16 train step", densenet_train, True)]
        rows.append((f"resnet50 b{8 if q else 32} infer", lambda: (torchvision.models.resnet50().to(dev).eval(),
                                                     (torch.randn(8 if q else 32, 3, 224, 224, device=dev),)), False))
    except ImportError:
        print("torchvision missing: no densenet121/resnet50 rows")
    try:
        import transformers

        rows.append(("BERT b8 s128 infer", lambda: (
            LastHidden(transformers.BertModel(transformers.BertConfig())).to(dev).eval(),
            (torch.randint(0, 30000, (8, 128), device=dev),)), False))
        rows.append((f"GPT-2 b8 s{64 if q else 256} infer", lambda: (
            LastHidden(transformers.GPT2Model(transformers.GPT2Config())).to(dev).eval(),
            (torch.randint(0, 50000, (8, 64 if q else 256), device=dev),)), False))
    except ImportError:
        print("transformers missing: no BERT/GPT-2 rows")
    return rows


def _train_step(model):
    opt = torch.optim.Adam(model.parameters())
    loss_fn = nn.CrossEntropyLoss()

    def step(x, y):
        opt.zero_grad(True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _cuda_run(make_compiled, make, train: bool, iters: int):
    """(ms per call: the median of 3 rounds of `iters` calls, cold s for the first 3 calls: compile +
    warm-up + recording, peak MiB allocated, peak MiB reserved, output)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()  # what earlier rows left: not this variant's
    reserved_before = torch.cuda.memory_reserved()
    model, args = make()
    t0 = time.perf_counter()
    compiled = make_compiled(model)
    fn = _train_step(compiled) if train else compiled
    with torch.set_grad_enabled(train):
        for _ in range(3):  # torch.compile's cudagraphs record on the 2nd/3rd call, torchweld's on the 1st
            out = fn(*args)
        torch.cuda.synchronize()
        cold = time.perf_counter() - t0
        for _ in range(3):
            fn(*args)
        # the compile's garbage collected now, not in a timed round; the median of 3 rounds
        gc.collect()
        rounds = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                out = fn(*args)
            torch.cuda.synchronize()
            rounds.append((time.perf_counter() - t0) / iters * 1e3)
        ms = statistics.median(rounds)
    peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
    reserved = (torch.cuda.max_memory_reserved() - reserved_before) / 2 ** 20
    out = out.detach().float().clone() if isinstance(out, torch.Tensor) else out
    return ms, cold, peak, reserved, out


def cuda_mode_rows(q: bool, modes=("reduce-overhead", "max-autotune"), fresh: bool = True,
                   variant_only: str | None = None, out_file: str | None = None):
    """Eager runs here; each compiler's row runs in a fresh process of its own (`fresh`), with
    empty caches, so that neither its cold time nor its steady state depends on what ran
    before it in this process (torch.compile's compile leaves a heap of Python objects and
    threads behind). With `variant_only`, this process is such a child: it runs that variant
    alone, saves its output to `out_file` and prints `RESULT <ms> <cold s> <peak MiB> <reserved MiB>`."""
    if not torch.cuda.is_available():
        print("no CUDA: the reduce-overhead / max-autotune rows need a GPU")
        return
    if variant_only is None:
        where = "each compiler in a fresh process" if fresh else "in this process, variants in turn"
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; cold = first 3 calls "
              f"(compile, warm-up, CUDA-graph recording; {where}); peak = max_memory_allocated over what "
              "was allocated before the row; reserved = max_memory_reserved likewise (CUDA graph trees do "
              "not count their outputs as allocated, and a graph's scratch is reserved, not allocated)")
        header = f"{'case':28s} {'mode':22s} {'variant':10s} {'ms':>9s} {'x eager':>8s} {'cold s':>8s} " \
                 f"{'peak MiB':>9s} {'reserved':>9s} {'max |diff|':>10s}"
        print(header)
        print("-" * len(header))
    iters = 10 if q else 50
    for name, make, train in cuda_mode_cases(q):
        if not wanted(name):
            continue
        if variant_only is None:
            torch.manual_seed(0)
            eager_ms, eager_cold, eager_peak, eager_reserved, expected = _cuda_run(lambda m: m, make, train, iters)
            print(f"{name:28s} {'-':22s} {'eager':10s} {eager_ms:9.3f} {1.0:8.2f} {eager_cold:8.2f} {eager_peak:9.0f} "
                  f"{eager_reserved:9.0f}")
        for mode in modes[:1] if train else modes:
            variants = [("inductor", lambda m, mode=mode: (torch._dynamo.reset(), torch.compile(m, mode=mode))[1]),
                        ("torchweld", lambda m, mode=mode: (torchweld.reset(),
                                                            torchweld.compile(m, backend="weld", mode=mode))[1])]
            for variant, make_compiled in selected(variants):
                if variant_only is not None and variant != variant_only:
                    continue
                if fresh and variant_only is None:
                    result = _cuda_row_in_fresh_process(name, mode, variant, q)
                else:
                    with tempfile.TemporaryDirectory() as tmp, config.patch(cache_dir=tmp):
                        torch.manual_seed(0)
                        try:
                            result = _cuda_run(make_compiled, make, train, iters)
                        except Exception as e:  # noqa: BLE001 - one failing row should not end the bench
                            result = f"{type(e).__name__}: {e}"
                if variant_only is not None:
                    if isinstance(result, str):
                        print(f"FAILED {result}"[:300])
                    else:
                        torch.save(result[-1], out_file)
                        print(f"RESULT {result[0]:.6f} {result[1]:.6f} {result[2]:.3f} {result[3]:.3f}")
                    continue
                if isinstance(result, str):
                    print(f"{name:28s} {mode:22s} {variant:10s} failed: {result}"[:200])
                    continue
                ms, cold, peak, reserved, out = result
                diff = (out - expected).abs().max().item() if isinstance(out, torch.Tensor) else float("nan")
                print(f"{name:28s} {mode:22s} {variant:10s} {ms:9.3f} {eager_ms / ms:8.2f} {cold:8.2f} "
                      f"{peak:9.0f} {reserved:9.0f} {diff:10.2e}")


def _cuda_row_in_fresh_process(name: str, mode: str, variant: str, q: bool):
    """(ms, cold s, peak MiB, reserved MiB, output) of one compiler's row, run in a process of its own with
    empty Triton and torchweld caches; a string saying why where it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "out.pt")
        args = ["--cuda-modes", "--only", name, "--modes", mode, "--variant-only", variant, "--out-file", out_file]
        lines, failure = _in_fresh_process(args + ["--quick"] * q, ("RESULT", "FAILED"))
        if failure or lines[0][0] != "RESULT":
            return failure or " ".join(lines[0][1:])
        ms, cold, peak, reserved = map(float, lines[0][1:])
        return ms, cold, peak, reserved, torch.load(out_file)


def _in_fresh_process(args: list[str], markers: tuple[str, ...]) -> tuple[list[list[str]], str | None]:
    """Run this script with `args` in a process of its own with an empty Triton cache (this
    process's runs filled it and warmed the libraries up; torchweld's cache is a temporary
    folder per row anyway): (its one output line that starts with a marker, split into words;
    None) or ([], the tail of what it printed) where it failed."""
    import subprocess

    with tempfile.TemporaryDirectory() as triton_cache:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                              env={**os.environ, "TRITON_CACHE_DIR": triton_cache})
    lines = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] and line.split()[0] in markers]
    if proc.returncode != 0 or len(lines) != 1:
        return [], (proc.stderr or proc.stdout)[-300:]
    return lines, None


# =============================================================================
# Training: forward + loss + backward + Adam step, eager vs torch.compile vs torchweld
# =============================================================================


def training_cases(q: bool, device: str):
    """(name, make_model, make_batch, loss) rows: the MLP and transformer block on the CPU;
    densenet121 (b16, 3x128x128), resnet50, BERT and GPT-2 where CUDA is there (guarded imports)."""
    ce = nn.CrossEntropyLoss()
    mse = lambda out, target: (out - target).square().mean()
    d = 256 if q else 1024
    rows = [
        (f"MLP 4x{d} LN+GELU b64", lambda: mlp(d), lambda: (torch.randn(64, d), torch.randn(64, d)), mse),
        ("transformer block", lambda: Block(d=256, heads=8),
         lambda: (torch.randn(4 if q else 8, 64 if q else 128, 256), torch.randn(4 if q else 8, 64 if q else 128, 256)),
         mse),
    ]
    if device != "cuda":
        return rows
    try:
        import torchvision

        rows.append(("densenet121 b16 3x128x128", torchvision.models.densenet121,
                     lambda: (torch.randn(16, 3, 128, 128), torch.randint(0, 1000, (16,))), ce))
        rows.append((f"resnet50 b{8 if q else 32} 3x224x224", torchvision.models.resnet50,
                     lambda: (torch.randn(8 if q else 32, 3, 224, 224), torch.randint(0, 1000, (8 if q else 32,))), ce))
    except ImportError:
        print("torchvision missing: no densenet121/resnet50 training rows")
    try:
        import transformers

        rows.append(("BERT b8 s128", lambda: LastHidden(transformers.BertModel(transformers.BertConfig())),
                     lambda: (torch.randint(0, 30000, (8, 128)), torch.randn(8, 128, 768)), mse))
        rows.append((f"GPT-2 b8 s{64 if q else 256}", lambda: LastHidden(transformers.GPT2Model(transformers.GPT2Config())),
                     lambda: (torch.randint(0, 50000, (8, 64 if q else 256)), torch.randn(8, 64 if q else 256, 768)),
                     mse))
    except ImportError:
        print("transformers missing: no BERT/GPT-2 training rows")
    return rows


class SavedActivations:
    """Bytes autograd saves for backward during one forward (distinct storages, parameters excluded)."""

    def __init__(self, model: nn.Module):
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.skip:
            self.storages[ptr] = t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def mib(self) -> float:
        return sum(self.storages.values()) / 2 ** 20


def _train_setup(model, batch, loss_fn, make_compiled, device: str, compile_step=None, before: int = 0):
    """(step, cold s, saved MiB, peak MiB or nan, first loss): the step run once cold and three
    times warm. Cold is the compile() call and the first step, as a user waits for them (torch.optim's
    constructor has imported torch._dynamo by then, which either compiler would otherwise pay). With
    `compile_step`, the step function is compiled by it (`make_compiled` then leaves the model as
    it is). The peak counts from `before`, the bytes allocated before this variant's copy of the
    model: the variants run before it keep their models and Adam states."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    compiled = make_compiled(model)

    def step(x, y):
        opt.zero_grad(True)
        loss = loss_fn(compiled(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    if compile_step is not None:
        step = compile_step(step)
    # a copy: under reduce-overhead, torch.compile's CUDA graph trees overwrite the tensor a
    # replay returned at the next replay, and reading it then is an error
    first_loss = step(*batch).detach().clone()
    sync()
    cold = time.perf_counter() - t0
    for _ in range(3):
        step(*batch)
    sync()
    # read before the saved-activation pass: with the whole step compiled, that pass runs the
    # model eagerly beside the step's CUDA-graph pools, a peak no step of the user's reaches
    peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20 if device == "cuda" else float("nan")
    with SavedActivations(model) as saved:
        out = compiled(batch[0])
    del out
    return step, cold, saved.mib, peak, first_loss


def training_rows(q: bool, whole_step: bool = False, mode: str | None = None, cold_only: str | None = None,
                  fresh_cold: bool = True):
    """With `cold_only`, only that variant's setup runs, and its cold step's seconds and peak
    MiB are printed (`COLD <s> <MiB>`) for the process that started this one
    (`_cold_in_fresh_process`)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = "each compiler in a fresh process, eager here" if fresh_cold else "in this process, variants in turn"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device}; a step = zero_grad, "
          f"forward, loss, backward, Adam; cold = the compile() call and the first step ({where}); saved = activations kept for "
          "backward (saved_tensors_hooks, parameters excluded); peak = max_memory_allocated (CUDA) over "
          "what was allocated before the variant's copy of the model, in the cold step and three warm ones "
          f"({where}: the caching allocator's rounding depends on what ran before)")
    header = f"{'case':28s} {'variant':10s} {'ms/step':>9s} {'x eager':>8s} {'cold s':>8s} {'saved MiB':>10s} " \
             f"{'peak MiB':>9s} {'loss diff':>10s}"
    print(header)
    print("-" * len(header))
    min_time = 0.5 if q else 2.0
    for name, make_model, make_batch, loss_fn in training_cases(q, device):
        if not wanted(name):
            continue
        torch.manual_seed(0)
        base = make_model().to(device).train()
        batch = tuple(t.to(device) for t in make_batch())
        variants = [("eager", lambda m: m),
                    ("inductor", lambda m: (torch._dynamo.reset(), torch.compile(m, mode=mode))[1]),
                    ("torchweld", lambda m: (torchweld.reset(), torchweld.compile(m, backend="weld", mode=mode))[1])]
        step_compilers = {"inductor": lambda f: (torch._dynamo.reset(), torch.compile(f, mode=mode))[1],
                          "torchweld": lambda f: (torchweld.reset(),
                                                  torchweld.compile(f, backend="weld", mode=mode))[1]}
        if whole_step:  # the step function is compiled; "weld model" compiles the model alone, Adam native
            variants = [(v, lambda m: m) for v, _ in variants] + [("weld model", variants[2][1])]
        # each variant's cold step in turn, with its own peak memory; then the steady state of
        # all of them timed in turns (compare.steady), so load swings hit every variant alike
        runs = {}
        for variant, make_compiled in selected(variants):
            if cold_only is not None and variant != cold_only:
                continue
            before = torch.cuda.memory_allocated() if device == "cuda" else 0
            model = copy.deepcopy(base)
            with tempfile.TemporaryDirectory() as tmp, config.patch(cache_dir=tmp):
                try:
                    compile_step = step_compilers.get(variant) if whole_step else None
                    runs[variant] = _train_setup(model, batch, loss_fn, make_compiled, device, compile_step,
                                                 before)
                except Exception as e:  # noqa: BLE001 - one failing row should not end the bench
                    print(f"{name:28s} {variant:10s} failed: {type(e).__name__}: {e}"[:200])
        if cold_only is not None:
            for _, cold, _, peak, _ in runs.values():
                print(f"COLD {cold:.6f} {peak:.3f}")
            continue
        if fresh_cold:
            for variant in [v for v in runs if v != "eager"]:
                _, _, saved, _, loss = runs[variant]
                cold, peak = _cold_in_fresh_process(name, variant, q, whole_step, mode)
                runs[variant] = (runs[variant][0], cold, saved, peak, loss)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        seconds = steady({variant: (lambda _, step=run[0]: (step(*batch), sync())) for variant, run in runs.items()},
                         None, min_time=min_time * len(runs))
        eager_ms, eager_loss = None, None
        for variant, (_, cold, saved, peak, loss) in runs.items():
            ms = seconds[variant] * 1e3
            if eager_ms is None:
                eager_ms, eager_loss = ms, loss
            diff = (loss - eager_loss).abs().item()
            print(f"{name:28s} {variant:10s} {ms:9.3f} {eager_ms / ms:8.2f} {cold:8.2f} {saved:10.2f} "
                  f"{peak:9.0f} {diff:10.2e}")
        runs.clear()
        if name == "transformer block":
            _partition_report(base, batch[0])


def _cold_in_fresh_process(name: str, variant: str, q: bool, whole_step: bool,
                           mode: str | None) -> tuple[float, float]:
    """`variant`'s cold step of row `name`, timed in a process of its own (`_in_fresh_process`),
    and the peak memory of its first four steps there."""
    args = ["--train", "--only", name, "--cold-only", variant]
    args += ["--quick"] * q + ["--whole-step"] * whole_step + (["--train-mode", mode] if mode else [])
    lines, failure = _in_fresh_process(args, ("COLD",))
    if failure:
        print(f"  ({variant}'s cold step in a fresh process failed: {failure})")
        return float("nan"), float("nan")
    return float(lines[0][1]), float(lines[0][2])


def _partition_report(model: nn.Module, x: torch.Tensor) -> None:
    """Saved-activation bytes of torchweld's recompute (min-cut) partition next to save-all's."""
    from torchweld.autograd import compile_training

    gm = torch.fx.symbolic_trace(model)
    x = x.detach().requires_grad_(False)
    for strategy in ("save_all", "min_cut"):
        compiled = compile_training(gm, [x], {"training_codegen": False}, strategy=strategy)
        part = compiled.partition
        print(f"  {'':26s} partition {strategy:8s}: saves {len(part.saved):3d} tensors, "
              f"{part.saved_bytes / 2 ** 20:8.2f} MiB of intermediates")


if __name__ == "__main__":
    main()
