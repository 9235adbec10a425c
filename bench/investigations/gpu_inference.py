"""GPU inference: eager vs torch.compile vs torchweld (weld backend), float32, one run.

    python3 bench/investigations/gpu_inference.py [--only NAME ...] [--mode MODE] [--skip-inductor] [--options JSON]

Rows (issue 4): the 12-op elementwise chain on 16M floats, torchvision resnet50
(batch 32, 224x224) and densenet121 (batch 16, 3x128x128), transformers' BERT
(batch 8, seq 128) and GPT-2 (batch 8, seq 256) from their default configs (no
weights). Each compiler runs each case in a fresh process (eager too): steady state
is the median of CUDA-event timings after warm-up; cold compile is the wall time of
the compile() call and the first call there (the first three under reduce-overhead:
warm-up, recording, first replay), with empty torchweld, inductor and Triton caches;
peak is torch.cuda.max_memory_allocated. The add/mul chain's bandwidth is given per waited
call and back to back (100 calls between two events, the launch gaps hidden), next to
torch's own `copy_` of the same tensor back to back on the same host. The compile() call counts because
torch.compile imports torch._dynamo there (1.5-3.5 s), where torchweld pays for the
same import (through torch's fake tensors) inside its first call.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

import torch  # noqa: E402

import torchweld  # noqa: E402
from bench.models import add_mul_chain, chain  # noqa: E402  (the elementwise chains, defined once)
from profile_weld_gpu import latency_ms, throughput_ms  # noqa: E402  (CUDA-event timings)
from torchweld import config  # noqa: E402


def cases(only: set[str] | None):
    dev = "cuda"
    rows = [("elementwise chain 16M", lambda: (chain, torch.randn(1 << 24, device=dev))),
            ("add/mul chain 64M", lambda: (add_mul_chain, torch.randn(1 << 26, device=dev)))]
    try:
        import torchvision

        rows.append(("resnet50 b32", lambda: (torchvision.models.resnet50().to(dev).eval(),
                                              torch.randn(32, 3, 224, 224, device=dev))))
        rows.append(("densenet121 b16", lambda: (torchvision.models.densenet121().to(dev).eval(),
                                                 torch.randn(16, 3, 128, 128, device=dev))))
    except ImportError:
        print("torchvision missing: no resnet50/densenet121 rows")
    try:
        import transformers

        def bert(dtype=torch.float32):
            model = transformers.BertModel(transformers.BertConfig()).to(dev, dtype).eval()
            return (lambda ids: model(ids).last_hidden_state), torch.randint(0, 30000, (8, 128), device=dev)

        def gpt2(dtype=torch.float32):
            model = transformers.GPT2Model(transformers.GPT2Config()).to(dev, dtype).eval()
            return (lambda ids: model(ids).last_hidden_state), torch.randint(0, 50000, (8, 256), device=dev)

        rows += [("BERT b8 s128", bert), ("GPT-2 b8 s256", gpt2),
                 # half precision, not run unless named (--only BERT-fp16 GPT-2-fp16): cuDNN attention, half matmuls
                 ("BERT-fp16 b8 s128", lambda: bert(torch.float16)), ("GPT-2-fp16 b8 s256", lambda: gpt2(torch.float16))]
    except ImportError:
        print("transformers missing: no BERT/GPT-2 rows")
    return [(n, make) for n, make in rows
            if (n.split()[0] in only if only else "fp16" not in n)]


def gpu_time(fn, x, iters=50) -> float:
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    return latency_ms(fn, x, iters)


def cold(compile_fn, x, calls: int):
    """(wall s of compile_fn() and the first `calls` calls of what it returns, that function, first output)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn = compile_fn()
    out = fn(x)
    out = out.float().cpu()  # before later calls: under CUDA graphs they may overwrite it
    for _ in range(calls - 1):
        fn(x)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, fn, out


def worker(case: str, compiler: str, mode: str | None, options: dict, out_path: str) -> None:
    """One compiler on one case in this (fresh) process: prints a JSON line and saves the output."""
    torch.manual_seed(0)  # the same weights and inputs in every process
    [(_, make)] = cases({case})
    fn, x = make()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp, config.patch(cache_dir=tmp):
        if compiler == "inductor":
            compile_fn = lambda: torch.compile(fn, mode=mode)  # noqa: E731
        elif compiler == "weld":
            compile_fn = lambda: torchweld.compile(fn, backend="weld", mode=mode, options=options)  # noqa: E731
        else:
            compile_fn = lambda: fn  # noqa: E731
        calls = 3 if mode and "reduce-overhead" in mode else 1
        cold_s, fn, out = cold(compile_fn, x, calls)
        ms = gpu_time(fn, x)
        back_to_back_ms = throughput_ms(fn, x, 100)[0] if case == "add/mul" else float("nan")
    torch.save(out, out_path)
    peak = torch.cuda.max_memory_allocated() / 2**20
    result = {"ms": ms, "cold_s": cold_s, "peak_mib": peak, "back_to_back_ms": back_to_back_ms}
    if case == "add/mul" and compiler == "eager":  # the copy ceiling, measured on this host
        target = torch.empty_like(x)
        result["copy_ms"] = throughput_ms(target.copy_, x, 100)[0]
    print(json.dumps(result))


def run_worker(case: str, compiler: str, args, out_path: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", case, compiler, "--options", args.options, "--out", out_path]
    if args.mode:
        cmd += ["--mode", args.mode]
    with tempfile.TemporaryDirectory() as triton_cache:  # Triton's own kernel cache starts empty too
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TRITON_CACHE_DIR": triton_cache}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        print(f"  {compiler} failed on {case}:\n{proc.stderr[-3000:]}")
        return {"ms": float("nan"), "cold_s": float("nan"), "peak_mib": float("nan")}
    return json.loads(lines[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", help="first words of row names, e.g. resnet50 BERT")
    parser.add_argument("--mode", default=None)
    parser.add_argument("--skip-inductor", action="store_true")
    parser.add_argument("--options", default="{}", help='torchweld options as JSON, e.g. \'{"channels_last": false}\'')
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "COMPILER"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    options = json.loads(args.options)
    if args.worker:
        return worker(args.worker[0], args.worker[1], args.mode, options, args.out)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, float32 unless a row says fp16, "
          f"mode={args.mode}, options={options}")
    print("each compiler runs each case in a fresh process; cold = compile() and the first call there "
          "(3 calls under reduce-overhead), with empty caches")
    header = (f"{'case':24s} {'eager ms':>9s} {'inductor ms':>11s} {'weld ms':>8s} {'ind x':>6s} {'weld x':>7s} "
              f"{'ind cold s':>10s} {'weld cold s':>11s} {'peak MiB e/i/w':>16s} {'max err':>8s}")
    print(header)
    print("-" * len(header))
    compilers = ["eager"] + ([] if args.skip_inductor else ["inductor"]) + ["weld"]
    nan = {"ms": float("nan"), "cold_s": float("nan"), "peak_mib": float("nan")}
    for name, _ in cases(set(args.only) if args.only else None):
        case = name.split()[0]
        with tempfile.TemporaryDirectory() as tmp:
            got = {c: run_worker(case, c, args, os.path.join(tmp, f"{c}.pt")) for c in compilers}
            try:
                expected = torch.load(os.path.join(tmp, "eager.pt"))
                out = torch.load(os.path.join(tmp, "weld.pt"))
                err = (out - expected).abs().max().item() / max(expected.abs().max().item(), 1e-6)
            except FileNotFoundError:
                err = float("nan")
        e, i, w = got["eager"], got.get("inductor", nan), got["weld"]
        print(f"{name:24s} {e['ms']:9.3f} {i['ms']:11.3f} {w['ms']:8.3f} {e['ms'] / i['ms']:6.2f} {e['ms'] / w['ms']:7.2f} "
              f"{i['cold_s']:10.1f} {w['cold_s']:11.1f} {e['peak_mib']:5.0f}/{i['peak_mib']:4.0f}/{w['peak_mib']:5.0f} "
              f"{err:8.1e}", flush=True)
        if name.startswith("add/mul"):  # one read and one write of 64M floats, as a copy moves
            def tbs(ms):
                return 2 * (1 << 26) * 4 / (ms * 1e-3) / 1e12

            copy = tbs(e.get("copy_ms", float("nan")))
            print(f"  add/mul chain, TB/s: weld {tbs(w['ms']):.2f} per waited call, {tbs(w.get('back_to_back_ms', float('nan'))):.2f} "
                  f"back to back; torch.compile {tbs(i['ms']):.2f} / {tbs(i.get('back_to_back_ms', float('nan'))):.2f}; "
                  f"torch's copy_ back to back {copy:.2f}: weld at {tbs(w.get('back_to_back_ms', float('nan'))) / copy:.0%} of it "
                  "(nominal ceiling ~3.0)")


if __name__ == "__main__":
    main()
