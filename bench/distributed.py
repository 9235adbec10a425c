"""Distributed training, eager against torch.compile and torchweld side by side (issue 47): DDP of
resnet50 and GPT-2, FSDP2 of a ~1B Llama-style decoder; each row is appended as a record to
bench/records/distributed.jsonl (bench/records.py; its "row" names model, label, parallel,
world_size, device, dtype).

    python bench/distributed.py --device cuda --nproc 2 --only ddp_resnet50,ddp_gpt2,fsdp_llama --scaling
    python bench/distributed.py --device cpu --nproc 2 --quick --only ddp_gpt2,fsdp_llama --compilers eager,torchweld

Rows, sizes per rank (--quick: tiny models for the CPU and gloo, resnet18 for resnet50; the label says):
- ddp_resnet50: torchvision resnet50, batch 32 224x224, cross-entropy, SGD with momentum.
- ddp_gpt2: transformers' GPT2LMHeadModel (124M, sdpa attention, dropout 0 so that losses compare),
  batch 8 sequence 512, next-token cross-entropy from the logits, AdamW.
- fsdp_llama: LlamaForCausalLM of 0.98B parameters (width 2048, MLP 5632, 18 layers, 16 heads, 8
  key/value heads), `fully_shard` of each decoder layer then of the root, bfloat16 parameters and
  float32 gradient reduction (MixedPrecisionPolicy), batch 4 sequence 1024, AdamW.
DDP rows run `torch.compile(DDP(model))` / `torchweld.compile(DDP(model))` (DDP without device_ids:
the model is on its rank's GPU; the loss outside, eager). FSDP2 compiles each decoder layer, then
shards it (`layers[i] = torch.compile(layer)`: torch.compile's recipe; torchweld's the same).

Each compiler runs in fresh processes, one a rank (NCCL on CUDA, with NCCL_NVLS_ENABLE=0; gloo on
the CPU), whose torchweld, Triton and Inductor caches start empty. Measured, per row and compiler:
- `cold_s`: the first training step (forward, loss, backward, optimizer step; compiles included),
  the largest over the ranks (`cold_s_ranks` each); `cold_vs_torch`: torchweld's over torch.compile's.
- `steps_per_s`: after --warmup more steps, --steps steps (or as many as fill --min-time seconds),
  devices synchronized and ranks at a barrier at both ends; the lowest over the ranks.
  `samples_per_s`: that times the batch times the ranks; `speedup`: over eager's steps/s.
- `peak_mib` (CUDA): torch.cuda.max_memory_allocated on rank 0, all steps.
- `losses`: rank 0's losses of the first three steps (the same weights, and the same seeded data
  on a rank, for every compiler); `max_diff`: their largest difference from eager's.
- with --scaling, `one_rank`: the same figures on one rank, and `scaling`: samples/s on --nproc
  ranks over samples/s on one.
- with --profile-dir DIR, `profile_ranks`: each rank's --profile-steps more steps under
  torch.profiler, its Chrome trace in DIR (compare two compilers' with torchweld.tools.trace_diff)
  and its GPU time per step: computing, communicating (NCCL kernels), and communicating with no
  computation beside it (`exposed_comm_ms`, what overlap did not hide).
A rank that fails, or a run past --timeout, ends that compiler's run (its ranks killed), not the
row: {"error", "traceback"} in its place. On the GPU machine, one row a command fits its 10
minutes: `--only fsdp_llama --scaling --timeout 300 --records-dir $OUT`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import runner  # noqa: E402
from bench.runner import COMPILERS, fmt  # noqa: E402

runner.set_omp_wait_passive()  # for the ranks, which inherit it

SUITE = "distributed"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=18, num_attention_heads=16,
                num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024, max_position_embeddings=128)


# =============================================================================
# The rows: model, data, loss, optimizer (built in each rank)
# =============================================================================


class LMLogits(nn.Module):
    """A transformers language model returning the logits its output dataclass holds."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


def lm_loss(logits, ids):
    """Next-token cross-entropy, in float32."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def resnet(quick: bool) -> dict:
    import torchvision

    arch, b, size = ("resnet18", 2, 64) if quick else ("resnet50", 32, 224)
    return dict(label=f"DDP {arch} b{b} {size}x{size}", model=getattr(torchvision.models, arch)(), batch=b,
                dtype="float32", data=lambda g: (torch.randn(b, 3, size, size, generator=g),
                                                 torch.randint(0, 1000, (b,), generator=g)),
                loss=lambda model, x, y: F.cross_entropy(model(x), y),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9))


def gpt2(quick: bool) -> dict:
    import transformers

    b, s = (2, 32) if quick else (8, 512)
    tiny = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=1024, n_positions=128, bos_token_id=0, eos_token_id=0)
    config = transformers.GPT2Config(**(tiny if quick else {}), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     attn_implementation="sdpa")
    return dict(label=f"DDP GPT-2 {'2 layers d64' if quick else '124M'} b{b} s{s}",
                model=LMLogits(transformers.GPT2LMHeadModel(config)), batch=b, dtype="float32",
                data=lambda g: (torch.randint(0, config.vocab_size, (b, s), generator=g),),
                loss=lambda model, ids: lm_loss(model(ids), ids),
                optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4))


def llama(quick: bool) -> dict:
    import transformers

    b, s = (2, 32) if quick else (4, 1024)
    config = transformers.LlamaConfig(**(LLAMA_TINY if quick else LLAMA_1B), attn_implementation="sdpa")
    model = LMLogits(transformers.LlamaForCausalLM(config))
    n = sum(p.numel() for p in model.parameters())
    size = f"{n / 1e6:.1f}M" if n < 1e8 else f"{n / 1e9:.2f}B"
    return dict(label=f"FSDP2 Llama {size} {config.num_hidden_layers} layers bf16 b{b} s{s}", model=model,
                batch=b, dtype="bfloat16", data=lambda g: (torch.randint(0, config.vocab_size, (b, s), generator=g),),
                loss=lambda model, ids: lm_loss(model(ids), ids),
                optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4))


# name: (the module it needs, the builder: quick -> {label, model, batch, dtype, data(generator) -> inputs,
# loss(model, *inputs), optimizer(params)}); torch.manual_seed(0) first gives every rank the same weights
ROWS = {"ddp_resnet50": ("torchvision", resnet), "ddp_gpt2": ("transformers", gpt2),
        "fsdp_llama": ("transformers", llama)}


def wrap(name: str, compiler: str, model):
    """`model` under DDP or FSDP2 with `compiler` applied as its row says; what the step calls."""
    compile_ = {"torch": torch.compile, "eager": None}.get(compiler)
    if compiler == "torchweld":
        import torchweld

        compile_ = torchweld.compile
    if name.startswith("ddp_"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        return compile_(DDP(model)) if compile_ else DDP(model)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = model.model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = compile_(layer) if compile_ else layer
        fully_shard(layers[i], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


# =============================================================================
# One rank: what each spawned process runs
# =============================================================================


def run_rank(job: dict) -> dict:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    cuda = job["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", device_id=device)
        torch.cuda.reset_peak_memory_stats()
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    with device:  # built there: a 1B model's initialization on the CPU takes long
        row = ROWS[job["row"]][1](job["quick"])
    model = wrap(job["row"], job["compiler"], row["model"])  # compile() is lazy: the first step compiles
    opt = row["optimizer"](model.parameters())
    inputs = tuple(t.to(device) for t in row["data"](torch.Generator().manual_seed(1000 + rank)))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = row["loss"](model, *inputs)
        loss.backward()
        opt.step()
        return loss.detach()

    def synced():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter()

    t0 = synced()
    losses = [float(step())]  # float() waits for the device
    cold_s = time.perf_counter() - t0
    for _ in range(max(2, job["warmup"])):  # losses of the first three steps
        loss = step()
        if len(losses) < 3:
            losses.append(float(loss))
    steps = job["steps"]
    if not steps:  # as many as fill min_time, by rank 0's count: every rank must take as many steps
        t0 = synced()
        step(), step()
        per_step = (synced() - t0) / 2
        count = torch.tensor([max(3, math.ceil(job["min_time"] / max(per_step, 1e-6)))], device=device)
        dist.broadcast(count, 0)
        steps = int(count.item())
    t0 = synced()
    for _ in range(steps):
        step()
    seconds = synced() - t0
    result = {"rank": rank, "label": row["label"], "batch": row["batch"], "dtype": row["dtype"], "cold_s": cold_s,
              "steps": steps, "steps_per_s": steps / seconds, "losses": losses}
    if cuda:
        result["peak_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
    if job.get("profile_dir"):
        result["profile"] = profile_steps(step, job, rank, cuda)
    return result


def profile_steps(step, job: dict, rank: int, cuda: bool) -> dict:
    """`job["profile_steps"]` more steps under torch.profiler, after the timed ones: the Chrome
    trace to <profile_dir>/<row>-<compiler>-rank<r>.json.gz (for torchweld.tools.trace_diff), and
    the GPU time per step those steps spent computing, communicating (NCCL kernels), and
    communicating while no computation ran ("exposed": what overlap did not hide)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps = max(1, job.get("profile_steps", 2))
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    path = os.path.join(job["profile_dir"], f"{job['row']}-{job['compiler']}-rank{rank}.json.gz")
    prof.export_chrome_trace(path)
    return {"trace": path, **gpu_time_split(path, steps)}


def gpu_time_split(trace_path: str, steps: int) -> dict:
    """ms per step of a Chrome trace's GPU kernels: `compute_ms` (the union of non-NCCL kernels'
    intervals), `comm_ms` (of NCCL kernels'), `exposed_comm_ms` (NCCL time with no computation
    beside it), `span_ms` (first kernel start to last kernel end), `kernels` (a count)."""
    import gzip

    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {}
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
    comm_union, compute_union = _union(comm), _union(compute)
    start, end = min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels)
    per = 1000.0 * steps  # trace times are microseconds
    return {"compute_ms": _length(compute_union) / per, "comm_ms": _length(comm_union) / per,
            "exposed_comm_ms": (_length(comm_union) - _overlap(comm_union, compute_union)) / per,
            "span_ms": (end - start) / per, "kernels": len(kernels) / steps}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(xs, ys) -> float:
    """The length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def rank_main(job: dict) -> None:
    """run_rank's figures on stdout (a line "RESULT {...}"), or why it failed ("ERROR ..."), the
    traceback on stderr. Then exit at once: no destroy_process_group, which can wait on ranks
    stuck in a collective."""
    code = 0
    try:
        print(runner.result_line(run_rank(job)))
    except BaseException as e:  # noqa: BLE001
        traceback.print_exc()
        print("ERROR " + json.dumps({"error": f"{type(e).__name__}: {e}"[:600], "time": time.time()}))
        code = 1
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


# =============================================================================
# A compiler on N ranks, a row, the table
# =============================================================================


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(job: dict, world: int, caches: dict, timeout: float, logs: str) -> dict:
    """`job` on `world` fresh rank processes; their figures combined, or {"error": ...}. The
    first rank to fail, or the timeout, kills the others."""
    port, procs = free_port(), []
    for rank in range(world):
        env = {**runner.worker_env(caches), **NO_MULTICAST, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
        if job["device"] == "cpu":
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
        out = open(os.path.join(logs, f"rank{rank}.out"), "w")
        err = open(os.path.join(logs, f"rank{rank}.err"), "w")
        procs.append(subprocess.Popen(runner.worker_command(__file__, job, "--rank-job"), stdout=out, stderr=err,
                                      env=env, cwd=ROOT, start_new_session=True))
        out.close(), err.close()
    deadline, problem, first_failed = time.monotonic() + timeout, None, None
    try:
        while problem is None and any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:  # a crash without an ERROR line (a signal) says this
                first_failed = failed[0]
                problem = f"exited with {procs[first_failed].returncode}"
            elif time.monotonic() > deadline:
                problem = f"no result in {timeout:.0f} s (--timeout)"
            time.sleep(0.1)
    finally:  # each rank leads a process group of its own: its compile workers go with it
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
    results, errors = [], {}
    for rank in range(world):
        lines = Path(logs, f"rank{rank}.out").read_text().splitlines()
        got = [ln.split(" ", 1) for ln in lines if ln.startswith(("RESULT ", "ERROR "))]
        if got and got[-1][0] == "RESULT":
            results.append(json.loads(got[-1][1]))
        elif got:
            errors[rank] = json.loads(got[-1][1])
    if len(results) < world:  # the rank that failed first (the others may fail for want of it)
        rank = min(errors, key=lambda r: errors[r]["time"]) if errors else first_failed or 0
        why = errors[rank]["error"] if errors else problem
        tail = Path(logs, f"rank{rank}.err").read_text().strip().splitlines()[-25:]
        return {"error": f"rank {rank}: {why}", "traceback": "\n".join(tail)[-3000:]}
    first = results[0]
    figures = {"label": first["label"], "dtype": first["dtype"], "cold_s": max(r["cold_s"] for r in results),
               "cold_s_ranks": [r["cold_s"] for r in results], "steps": first["steps"],
               "steps_per_s": min(r["steps_per_s"] for r in results), "losses": first["losses"]}
    figures["samples_per_s"] = figures["steps_per_s"] * first["batch"] * world
    if "peak_mib" in first:
        figures["peak_mib"] = first["peak_mib"]
    if "profile" in first:
        figures["profile_ranks"] = [r["profile"] for r in results]
    return figures


def run_row(name: str, args) -> tuple[dict, str | None, str | None]:
    """{compiler: figures} of one row, with the ratios; and the row's label and dtype."""
    figures = {}
    with tempfile.TemporaryDirectory(prefix="torchweld-distributed-") as tmp:
        for compiler in args.compilers:
            job = {"row": name, "compiler": compiler, "device": args.device, "quick": args.quick,
                   "warmup": args.warmup, "steps": args.steps, "min_time": args.min_time,
                   "profile_dir": args.profile_dir, "profile_steps": args.profile_steps}
            worlds = [args.nproc] + ([1] if args.scaling and args.nproc > 1 else [])
            for world in worlds:
                logs = os.path.join(tmp, f"{compiler}-{world}")
                os.makedirs(logs)
                got = launch(job, world, runner.empty_caches(tmp, f"{compiler}-{world}"), args.timeout, logs)
                if world == args.nproc:
                    figures[compiler] = got
                else:
                    got.pop("label", None), got.pop("dtype", None)
                    figures[compiler]["one_rank"] = got
                    if "error" not in got and "error" not in figures[compiler]:
                        figures[compiler]["scaling"] = figures[compiler]["samples_per_s"] / got["samples_per_s"]
                print(f"  {compiler:10s} {world} rank{'s' * (world > 1)}: {_summary(got)}", flush=True)
    label, dtype = runner.take_shared(figures, "label"), runner.take_shared(figures, "dtype")
    add_ratios(figures)
    return figures, label, dtype


def add_ratios(figures: dict[str, dict]) -> None:
    """speedup and max_diff (of the losses) against eager, cold_vs_torch for torchweld."""
    eager, torch_ = figures.get("eager", {}), figures.get("torch", {})
    for compiler, f in figures.items():
        if f.get("steps_per_s") and eager.get("steps_per_s"):
            f["speedup"] = f["steps_per_s"] / eager["steps_per_s"]
        if f.get("losses") and eager.get("losses"):
            f["max_diff"] = max(abs(a - b) for a, b in zip(f["losses"], eager["losses"]))
        if compiler == "torchweld" and f.get("cold_s") and torch_.get("cold_s"):
            f["cold_vs_torch"] = f["cold_s"] / torch_["cold_s"]


def _summary(f: dict) -> str:
    if "error" in f:
        return "failed: " + f["error"][:300] + "\n    " + "\n    ".join(f["traceback"].splitlines()[-8:])
    return runner.summary(f, ("cold_s", "steps_per_s", "samples_per_s", "peak_mib"))


def print_table(label: str, figures: dict) -> None:
    print(f"{label}\n{'':10s} {'steps/s':>8s} {'x eager':>8s} {'samples/s':>10s} {'cold s':>7s} {'x tc cold':>9s} "
          f"{'peak MiB':>9s} {'scaling':>8s} {'max diff':>9s}  losses")
    runner.print_rows(figures, 10, table_cells)


def table_cells(f: dict) -> str:
    """A compiler's cells in print_table's line."""
    return (f"{fmt(f.get('steps_per_s'), '8.3f'):>8s} {fmt(f.get('speedup'), '.2f'):>8s} "
            f"{fmt(f.get('samples_per_s'), '.1f'):>10s} {fmt(f.get('cold_s'), '.2f'):>7s} "
            f"{fmt(f.get('cold_vs_torch'), '.3f'):>9s} {fmt(f.get('peak_mib'), '.0f'):>9s} "
            f"{fmt(f.get('scaling'), '.2f'):>8s} {fmt(f.get('max_diff'), '.1e'):>9s}  "
            + " ".join(f"{x:.5f}" for x in f.get("losses", [])))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Distributed training (DDP, FSDP2): eager, torch.compile and "
                                                 "torchweld side by side; see the module's docstring")
    parser.add_argument("--only", default=",".join(ROWS), help=f"rows, comma-separated: {', '.join(ROWS)}")
    parser.add_argument("--compilers", default=",".join(COMPILERS), help="comma-separated: eager,torch,torchweld")
    runner.add_device_option(parser)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (one a GPU on CUDA)")
    parser.add_argument("--scaling", action="store_true", help="each compiler on one rank too, for `scaling`")
    parser.add_argument("--quick", action="store_true", help="tiny models (the CPU smoke test)")
    parser.add_argument("--warmup", type=int, default=3, help="steps after the first before timing (at least 2)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default: as many as fill --min-time)")
    parser.add_argument("--min-time", type=float, default=10.0, help="seconds of timed steps, without --steps")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for one compiler's ranks, all steps")
    parser.add_argument("--profile-dir", default=None,
                        help="after the timed steps, profile --profile-steps more on every rank: Chrome traces "
                             "here, and each rank's GPU time split into compute and (exposed) communication")
    parser.add_argument("--profile-steps", type=int, default=2)
    runner.add_record_and_worker_options(parser, "--rank-job")
    args = parser.parse_args(argv)
    args.only = runner.comma_separated(args.only)
    args.compilers = runner.comma_separated(args.compilers)
    if args.profile_dir:
        args.profile_dir = os.path.abspath(args.profile_dir)
        os.makedirs(args.profile_dir, exist_ok=True)
    for bad, known in ((set(args.only) - set(ROWS), ROWS), (set(args.compilers) - set(COMPILERS), COMPILERS)):
        if bad:
            parser.error(f"unknown {sorted(bad)}; known: {', '.join(known)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank_job:
        runner.apply_tuning_changes()
        rank_main(json.loads(args.rank_job))
    from bench import records

    runner.use_records_dir(args.records_dir)
    args.device = runner.pick_device(args.device)
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"--nproc {args.nproc}: {torch.cuda.device_count()} CUDA devices here")
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {os.cpu_count()} cores"
    print(f"torch {torch.__version__}, {args.nproc} x {where}, {'nccl' if args.device == 'cuda' else 'gloo'}; "
          f"each compiler in fresh processes with empty caches", flush=True)
    command = records.command_line([__file__, *(sys.argv[1:] if argv is None else argv)])
    failures = 0
    for name in args.only:
        if importlib.util.find_spec(ROWS[name][0]) is None:
            print(f"{name}: {ROWS[name][0]} is not installed; skipped")
            continue
        print(f"{name}:", flush=True)
        figures, label, dtype = run_row(name, args)
        print_table(label or name, figures)
        failures += sum("error" in f or "error" in f.get("one_rank", {}) for f in figures.values())
        if not args.no_record:
            row = {"model": name, "label": label or name, "parallel": "DDP" if name.startswith("ddp") else "FSDP2",
                   "world_size": args.nproc, "device": args.device, "dtype": dtype}
            record = records.make_record(SUITE, {"compilers": figures}, options=runner.record_options(args),
                                         command=command, row=row)
            print(f"  appended to {records.append(SUITE, record)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
