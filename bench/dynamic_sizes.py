"""Dynamic shapes (issue 45): one model called with many sequence lengths in a random (seeded)
order; how often each compiler compiles, what the compiles and calls cost, how fast each length
runs afterwards beside a compile specialized for it, and whether the outputs are eager's.
Appends a record to bench/records/dynamic_sizes.jsonl (bench/records.py).

--model block (the default, and the first record's mode): a small transformer block on the CPU,
12 lengths in 16..128 each called --repeats times; torchweld (dynamic=None, True, False; backends
eager and weld) beside torch.compile (dynamic=None; eager and inductor), one after another in
this process. Figures {"lengths", "rows"}.

    .venv/bin/python bench/dynamic_sizes.py [--lengths 12] [--repeats 3]

--model bert|gpt2: transformers' BERT or GPT-2 (configs, random weights: bench/models.py's
BERT and GPT-2; --quick: tiny configs, for a CPU smoke run), batch 8, 16 lengths in [32, 512] in a
random (seeded) order; each compiler in a fresh process of its own whose torchweld, Triton and
Inductor caches start empty (bench/DECISIONS.md#fresh-process), so its compiles are cold:

    python bench/dynamic_sizes.py --model gpt2 --device cuda
    python bench/dynamic_sizes.py --model bert --device cuda --compilers torchweld,torchweld-static,torch,torch-static
    python bench/dynamic_sizes.py --model gpt2 --device cuda --phase training     # 8 lengths, AdamW steps
    python bench/dynamic_sizes.py --model gpt2 --device cpu --quick --lengths 4 --compilers eager,torchweld

--compilers (default eager,torchweld,torchweld-static,torch; training eager,torchweld,torch):
  eager; torchweld (torchweld.compile dynamic=None, backend "weld"); torchweld-static (dynamic=False:
  one compile per length, the steady-state reference); torchweld-dynamic (dynamic=True); torch
  (torch.compile dynamic=None, "inductor"); torch-static (dynamic=False: a cold Inductor compile
  per length, slow, so only when named); torch-dynamic (dynamic=True).

Figures, under figures["compilers"][name]:
- graphs: graphs handed to the backend (a counting backend around weld or inductor), over the
  pass; symbolic_graphs: those with a symbolic input size; weld_compiles (torchweld): the graphs
  weld compiled: for a graph with symbolic sizes one over its symbols (backends/weld_symbolic.py),
  plus one per length compiled per size (backends/weld_sizes.py);
  graphs_in_steady / weld_compiles_in_steady: those made after the pass (0 unless a cache dropped one).
- total_s: the compile() call and two calls per length in the pass order, each call synchronized
  (weld compiles a size of a graph with symbolic sizes at its second call: backends/weld_sizes.py);
  first_compile_s: the first length's calls (compile() included); dynamic_compile_s /
  dynamic_compile_len: the length whose calls first handed the backend a graph with symbolic sizes. Every worker
  imports torch._dynamo before its timer starts, so that no compiler is charged that import.
- per_length[length]: pass_s (its two calls in the pass) and new_graphs; ms, the steady state after
  the pass: one warm call, then --rounds rounds of --calls synchronized calls, the median round's
  ms per call (training: a whole step: zero_grad, forward, MSE loss, backward, AdamW);
  ratio_to_static: ms over the -static compiler's for that length (torchweld's goal in issue 45: a
  mean within 5% of 1); max_diff (and rel_diff, over eager's largest): the largest absolute
  difference of the output from eager's, computed in the same process; in training, of the step's
  forward output and (loss_diff) its loss from those of an eager copy of the model taking the same
  steps. mean_ms, mean_ratio_to_static and max_diff (the largest) over the lengths.
- cache_size_limit: torchweld's and torch.compile's, raised to twice the lengths so that a compile
  per length shows as such rather than as eager calls past the limit.
- peak_mib (CUDA): torch.cuda.max_memory_allocated over the whole worker.
Training builds the model without dropout, so that its losses can be compared with eager's.
A record's figures are {"lengths": the pass's order, "compilers": {name: the above}}, its "row"
{model, label, phase, device, batch, dtype, lengths, min_len, max_len}; a block record's "row"
says the block's.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import runner  # noqa: E402
from bench.runner import fmt, sync  # noqa: E402

runner.set_omp_wait_passive()  # before torch is imported, here and in the workers

import torch  # noqa: E402

import torchweld  # noqa: E402
from bench import records  # noqa: E402
from tests.models import Block  # noqa: E402

SUITE = "dynamic_sizes"
# name -> (compiler, dynamic); the backend is weld for torchweld and inductor for torch.compile
COMPILERS = {
    "eager": ("eager", None),
    "torchweld": ("torchweld", None),
    "torchweld-static": ("torchweld", False),
    "torchweld-dynamic": ("torchweld", True),
    "torch": ("torch.compile", None),
    "torch-static": ("torch.compile", False),
    "torch-dynamic": ("torch.compile", True),
}
DEFAULT_COMPILERS = {"inference": "eager,torchweld,torchweld-static,torch", "training": "eager,torchweld,torch"}
DEFAULT_LENGTHS = {"block": 12, "inference": 16, "training": 8}
PASS_CALLS = 2  # calls of each length in the pass: weld compiles a size at its second (tuning.specialize_at_call)
TINY = {  # --quick: a CPU smoke run's configs (the real ones are bench/models.py's)
    "bert": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                 vocab_size=1000),
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0),
}
NO_DROPOUT = {
    "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


def _graphs_counted(backend):
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs)

    return counting, graphs


# =============================================================================
# --model block: the first record's mode, all in this process on the CPU
# =============================================================================


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


def run_block(args) -> None:
    if args.device not in (None, "cpu"):
        raise SystemExit("--model block runs on the CPU only")
    rng = random.Random(args.seed)
    lengths = rng.sample(range(16, 129), args.lengths)
    torch.set_num_threads(2)
    rows = []
    for compiler, backend, dynamic in [("torchweld", "eager", None), ("torchweld", "eager", True),
                                       ("torchweld", "eager", False), ("torch.compile", "eager", None),
                                       ("torchweld", "weld", None), ("torch.compile", "inductor", None)]:
        with torchweld.config.patch(cache_size_limit=max(8, args.lengths)):
            row = run(compiler, backend, dynamic, lengths, args.repeats)
        rows.append(row)
        print(f"{compiler:14} {backend:8} dynamic={str(dynamic):5}: {row['graphs']:2} graphs, "
              f"{row['total_s']:7.2f} s for {row['calls']} calls", flush=True)
    if not args.no_record:
        record = records.make_record(SUITE, {"lengths": lengths, "rows": rows}, runner.record_options(args),
                                     row={"model": "block", "label": "transformer block d64 b4", "phase": "inference",
                                          "device": "cpu", "batch": 4, "dtype": "float32"})
        print(f"recorded in {records.append(SUITE, record)}")


# =============================================================================
# --model bert|gpt2: one compiler in a fresh process (the worker)
# =============================================================================


def build(job: dict):
    """(label, model on the device, its hidden size, its vocabulary size): BERT or GPT-2 as
    bench/models.py builds them (tiny with quick; without dropout for training)."""
    import transformers

    from bench.models import LastHidden

    name, quick, training = job["model"], job["quick"], job["phase"] == "training"
    config = dict(TINY[name] if quick else {}, **(NO_DROPOUT[name] if training else {}))
    torch.manual_seed(0)
    if name == "bert":
        config.setdefault("max_position_embeddings", max(512, job["max_len"]))
        model = transformers.BertModel(transformers.BertConfig(**config))
        label, hidden = "BERT", model.config.hidden_size
    else:
        config.setdefault("n_positions", max(1024, job["max_len"]))
        model = transformers.GPT2Model(transformers.GPT2Config(**config))
        label, hidden = "GPT-2", model.config.n_embd
    label += f" b{job['batch']}" + (f" tiny d{hidden} 2 layers" if quick else "") + (", no dropout" if training else "")
    return label, LastHidden(model).to(job["device"]), hidden, model.config.vocab_size


def make_inputs(job: dict, hidden: int, vocab: int) -> dict[int, tuple]:
    """{length: (token ids, training target)}, each drawn from its own seed: every process the same."""
    inputs = {}
    for n in job["lengths"]:
        g = torch.Generator().manual_seed(1000 + n)
        ids = torch.randint(0, vocab, (job["batch"], n), generator=g)
        target = torch.randn(job["batch"], n, hidden, generator=g) if job["phase"] == "training" else None
        inputs[n] = (ids.to(job["device"]), None if target is None else target.to(job["device"]))
    return inputs


def symbolic(gm, example_inputs) -> bool:
    """Whether the graph has an input with a symbolic size (or a symbolic size as an input)."""
    def sym(v):
        if isinstance(v, torch.SymInt):
            return True
        return isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape)
    return any(sym(a) for a in example_inputs) or any(
        sym(n.meta.get("example_value")) for n in gm.graph.nodes if n.op == "placeholder")


class Counter:
    """A backend around `backend` that keeps what it was handed and what it returned."""

    def __init__(self, backend):
        self.graphs: list[bool] = []  # one a graph: whether it had symbolic sizes
        self.compiled: list = []
        inner = backend

        def counting(gm, example_inputs):
            self.graphs.append(symbolic(gm, example_inputs))
            out = inner(gm, example_inputs)
            self.compiled.append(out)
            return out

        self.backend = counting

    def weld_compiles(self) -> int:
        """The graphs weld compiled: one for each static graph; for a graph with symbolic sizes,
        one over its symbols (weld_symbolic.CompiledSymbolic) where weld could, and one for each
        length compiled per size (weld_sizes.CompiledPerSize counts them)."""
        def count(c) -> int:
            per_size = getattr(c, "per_size", None)
            if per_size is not None:  # compiled over symbols, then per size for the lengths its guards refused
                return 1 + per_size.compiles
            return c.compiles if hasattr(c, "specializations") else 1

        return sum(map(count, self.compiled))


def family(name: str) -> str:
    """The compiler a --compilers name runs: eager, torchweld or torch (torch.compile)."""
    return name.split("-")[0]


def compile_with(name: str, model, counter: Counter | None, limit: int):
    """`model` as the --compilers `name` compiles it, through `counter`'s backend; torch.compile
    with `limit` as its recompile limit (torchweld's comes from the config run_worker patches)."""
    compiler, dynamic = COMPILERS[name]
    if compiler == "eager":
        return model
    if compiler == "torch.compile":
        config = torch._dynamo.config
        setattr(config, "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit", limit)
    return runner.compile_with(family(name), model, backend=counter.backend, dynamic=dynamic)


def make_step(job: dict, model, opt):
    """The argument-less call for one length: inference under no_grad, or one training step."""
    if job["phase"] == "inference":
        def infer(ids, target):
            with torch.no_grad():
                return model(ids)
        return infer

    def step(ids, target):
        opt.zero_grad(set_to_none=True)
        out = model(ids)
        loss = (out - target).square().mean()
        loss.backward()
        opt.step()
        return out.detach(), loss.detach()
    return step


def run_worker(job: dict) -> dict:
    """One compiler over every length, in this fresh process: the pass (compile and PASS_CALLS
    calls a length, in order), the differences from eager, then the steady state of each length."""
    import copy

    import torch._dynamo  # noqa: F401  before any timer, for every compiler (torchweld's capture imports it too)
    from torch._dynamo.backends.registry import lookup_backend

    from torchweld.backends import lookup_backend as weld_backend

    name, device = job["compiler"], job["device"]
    compiler, dynamic = COMPILERS[name]
    training = job["phase"] == "training"
    limit = max(8, 2 * len(job["lengths"]))  # room for a compile per length, where dynamic=False makes one
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    label, model, hidden, vocab = build(job)
    model.train(training)
    inputs = make_inputs(job, hidden, vocab)
    reference = copy.deepcopy(model) if training and compiler != "eager" else None  # steps beside, eagerly
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if training else None
    counter = None
    if compiler == "torch.compile":
        counter = Counter(lookup_backend("inductor"))
    elif compiler == "torchweld":
        counter = Counter(weld_backend("weld", options=job["options"] or None))
    graphs = (lambda: len(counter.graphs)) if counter else (lambda: 0)

    result: dict = {"label": label, "compiler": compiler, "dynamic": dynamic, "cache_size_limit": limit,
                    "backend": {"torchweld": "weld", "torch.compile": "inductor"}.get(compiler)}
    per_length: dict[int, dict] = {}
    outputs = {}
    with torchweld.config.patch(cache_size_limit=limit):
        # the pass: compile() and two calls of each length, in the random order
        sync(device)
        t0 = time.perf_counter()
        compiled = compile_with(name, model, counter, limit)
        fn = make_step(job, compiled, opt)
        total = 0.0
        for i, n in enumerate(job["lengths"]):
            if i:
                sync(device)
                t0 = time.perf_counter()
            before, symbolic_before = graphs(), sum(counter.graphs) if counter else 0
            for _ in range(PASS_CALLS):
                out = fn(*inputs[n])
            sync(device)
            seconds = time.perf_counter() - t0
            total += seconds
            outputs[n] = tuple(t.clone() for t in out) if training else out.clone()
            per_length[n] = {"pass_s": seconds, "new_graphs": graphs() - before}
            if counter and "dynamic_compile_s" not in result and sum(counter.graphs) > symbolic_before:
                result.update(dynamic_compile_s=seconds, dynamic_compile_len=n)
            print(f"{name}: length {n}: {seconds:.3f} s, {per_length[n]['new_graphs']} new graphs", flush=True)
        result.update(total_s=total, first_compile_s=per_length[job["lengths"][0]]["pass_s"], graphs=graphs(),
                      symbolic_graphs=sum(counter.graphs) if counter else 0)
        result.setdefault("dynamic_compile_s", None)
        result.setdefault("dynamic_compile_len", None)
        if compiler == "torchweld":
            result["weld_compiles"] = counter.weld_compiles()

        # eager's outputs: the uncompiled model (training: its copy, stepped with the same inputs)
        eager_step = make_step(job, reference if training else model,
                               torch.optim.AdamW(reference.parameters(), lr=1e-4) if reference is not None else None)
        for n in job["lengths"]:
            if compiler == "eager":
                per_length[n].update(max_diff=0.0, rel_diff=0.0, **({"loss_diff": 0.0} if training else {}))
                continue
            for _ in range(PASS_CALLS):
                want = eager_step(*inputs[n])
            got = outputs[n]
            if training:  # (output, loss) of the step
                per_length[n]["loss_diff"] = (got[1].float() - want[1].float()).abs().item()
                got, want = got[0], want[0]
            diff = (got.float() - want.float()).abs().max().item()
            per_length[n].update(max_diff=diff, rel_diff=diff / max(want.float().abs().max().item(), 1e-12))
        del outputs, reference, eager_step

        # the steady state of each length: a warm call, then rounds of calls
        gc.collect()
        graphs_after_pass = graphs()
        weld_after_pass = result.get("weld_compiles")
        for n in sorted(job["lengths"]):
            args = inputs[n]
            fn(*args)
            rounds = []
            for _ in range(job["rounds"]):
                sync(device)
                t0 = time.perf_counter()
                for _ in range(job["calls"]):
                    fn(*args)
                sync(device)
                rounds.append((time.perf_counter() - t0) / job["calls"] * 1e3)
            per_length[n].update(ms=statistics.median(rounds), rounds_ms=rounds)
        result["graphs_in_steady"] = graphs() - graphs_after_pass
        if compiler == "torchweld":
            result["weld_compiles_in_steady"] = counter.weld_compiles() - weld_after_pass
    result["per_length"] = {str(n): per_length[n] for n in sorted(per_length)}
    result["mean_ms"] = statistics.mean(f["ms"] for f in per_length.values())
    result["max_diff"] = max(f["max_diff"] for f in per_length.values())
    if device == "cuda":
        result["peak_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
    return result


# =============================================================================
# --model bert|gpt2: the run, each compiler in a fresh process
# =============================================================================


def add_ratios(figures: dict[str, dict]) -> None:
    """ratio_to_static for each length (and its mean), where the compiler's -static counterpart ran."""
    for name, f in figures.items():
        static = figures.get(f"{family(name)}-static")
        if name.endswith("-static") or "error" in f or not static or "error" in static:
            continue
        ratios = []
        for n, per in f["per_length"].items():
            ref = static["per_length"].get(n, {}).get("ms")
            if ref and per.get("ms"):
                per["ratio_to_static"] = per["ms"] / ref
                ratios.append(per["ratio_to_static"])
        if ratios:
            f["mean_ratio_to_static"] = statistics.mean(ratios)


def print_tables(label: str, lengths: list[int], figures: dict[str, dict]) -> None:
    print(f"\n{label}, lengths in the pass's order: {lengths}")
    print(f"{'':18s} {'graphs':>6s} {'symb':>4s} {'weld':>4s} {'total s':>8s} {'first s':>8s} {'dyn s':>7s} "
          f"{'mean ms':>8s} {'x static':>8s} {'max diff':>9s}")
    runner.print_rows(figures, 18, compiler_cells)
    for name, f in figures.items():
        if f.get("mean_ratio_to_static") is not None:
            static = f"{family(name)}-static"
            print(f"{name} over {static}, steady state: mean {f['mean_ratio_to_static']:.3f} "
                  f"(goal, issue 45: within 5%, {'met' if abs(f['mean_ratio_to_static'] - 1) <= 0.05 else 'not met'})")
    ok = [name for name, f in figures.items() if "error" not in f]
    if not ok:
        return
    print("\nms per length (steady state); x static: over the -static compiler's")
    print(f"{'length':>6s} " + " ".join(f"{name:>17s}" for name in ok))
    for n in sorted(lengths):
        cells = []
        for name in ok:
            per = figures[name]["per_length"][str(n)]
            ratio = per.get("ratio_to_static")
            cells.append(f"{per['ms']:9.3f}" + (f" ({ratio:.3f})" if ratio else " " * 8))
        print(f"{n:6d} " + " ".join(f"{c:>17s}" for c in cells))


def compiler_cells(f: dict) -> str:
    """A compiler's cells in the first table's line."""
    return (f"{f['graphs']:6d} {f['symbolic_graphs']:4d} {fmt(f.get('weld_compiles'), '4d'):>4s} "
            f"{f['total_s']:8.2f} {f['first_compile_s']:8.2f} {fmt(f['dynamic_compile_s'], '7.2f'):>7s} "
            f"{f['mean_ms']:8.3f} {fmt(f.get('mean_ratio_to_static'), '8.3f'):>8s} {f['max_diff']:9.1e}")


def run_models(args) -> int:
    device = runner.pick_device(args.device)
    count = args.lengths or DEFAULT_LENGTHS[args.phase]
    if count > args.max_len - args.min_len + 1 or args.min_len < 2:
        raise SystemExit("--lengths: more lengths than [--min-len, --max-len] holds (or --min-len below 2)")
    lengths = random.Random(args.seed).sample(range(args.min_len, args.max_len + 1), count)
    names = runner.comma_separated(args.compilers or DEFAULT_COMPILERS[args.phase])
    if problem := runner.unknown_compiler(names, COMPILERS):
        raise SystemExit(problem)
    calls = args.calls or (10 if device == "cuda" else 3)
    job = {"model": args.model, "phase": args.phase, "device": device, "batch": args.batch, "quick": args.quick,
           "lengths": lengths, "max_len": args.max_len, "calls": calls, "rounds": args.rounds,
           "options": json.loads(args.options)}
    print(f"torch {torch.__version__}, {runner.device_name(device)}, {args.model} {args.phase}, batch {args.batch}, "
          f"{count} lengths in [{args.min_len}, {args.max_len}]; each compiler in a fresh process with empty caches",
          flush=True)
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="torchweld-dynamic-") as tmp:
        for name in names:
            print(f"{name}:", flush=True)
            started = time.perf_counter()
            figures[name] = runner.in_fresh_process(__file__, dict(job, compiler=name), runner.empty_caches(tmp, name),
                                                    args.worker_timeout)
            print(f"  {name}: {'failed: ' + figures[name]['error'] if 'error' in figures[name] else 'done'} "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
    label = runner.take_shared(figures, "label") or args.model
    add_ratios(figures)
    print_tables(label, lengths, figures)
    if not args.no_record:
        row = {"model": args.model, "label": label, "phase": args.phase, "device": device, "batch": args.batch,
               "dtype": "float32", "lengths": count, "min_len": args.min_len, "max_len": args.max_len}
        record = records.make_record(SUITE, {"lengths": lengths, "compilers": figures}, runner.record_options(args),
                                     row=row)
        print(f"recorded in {records.append(SUITE, record)}")
    return 1 if any("error" in f for f in figures.values()) else 0


# =============================================================================
# Command line
# =============================================================================


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("block", "bert", "gpt2"), default="block")
    parser.add_argument("--phase", choices=("inference", "training"), default="inference",
                        help="training: forward, backward and an AdamW step a call (bert, gpt2)")
    runner.add_device_option(parser)
    parser.add_argument("--lengths", type=int, default=None,
                        help="how many lengths (default: block 12, inference 16, training 8)")
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0, help="of the lengths' sample and order")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--compilers", default=None,
                        help=f"comma-separated, of {', '.join(COMPILERS)} (default: inference "
                             f"{DEFAULT_COMPILERS['inference']}; training {DEFAULT_COMPILERS['training']})")
    parser.add_argument("--quick", action="store_true", help="tiny configs (2 layers, width 64): a CPU smoke run")
    parser.add_argument("--calls", type=int, default=None,
                        help="calls a timed round (default: 10 on CUDA, 3 on the CPU)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds a length (the median is kept)")
    parser.add_argument("--repeats", type=int, default=3, help="block: passes over the lengths")
    parser.add_argument("--options", default="{}", help="weld's options as JSON ('{\"size_specializations\": 16}')")
    parser.add_argument("--worker-timeout", type=float, default=1800, help="seconds a compiler's process may take")
    runner.add_record_and_worker_options(parser)
    args = parser.parse_args(argv)
    if args.model == "block":
        args.lengths = args.lengths or DEFAULT_LENGTHS["block"]
        if args.phase != "inference":
            parser.error("--model block measures inference only")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return runner.answer_job(run_worker, args.worker)
    runner.use_records_dir(args.records_dir)
    if args.model == "block":
        run_block(args)
        return 0
    return run_models(args)


if __name__ == "__main__":
    sys.exit(main())
