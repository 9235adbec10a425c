"""GPU inference: eager vs torch.compile vs torchweld (weld backend), float32, one run.

    python3 bench/gpu_inference.py [--only NAME ...] [--mode MODE] [--skip-inductor] [--options JSON]

Rows (issue 4): the 12-op elementwise chain on 16M floats, torchvision resnet50
(batch 32, 224x224) and densenet121 (batch 16, 3x128x128), transformers' BERT
(batch 8, seq 128) and GPT-2 (batch 8, seq 256) from their default configs (no
weights). Steady state is the median of CUDA-event timings after warm-up; cold
compile is the first call in this process with empty torchweld and inductor caches.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402

import torchweld  # noqa: E402
from compare import chain  # noqa: E402  (bench/compare.py: the 12-op elementwise chain)
from profile_weld_gpu import latency_ms  # noqa: E402  (median of CUDA-event timings of single calls)
from torchweld import config  # noqa: E402


def add_mul_chain(t):  # memory-bound: compared with the copy bandwidth
    return ((t + 1.0) * 2.0 + 3.0) * 0.5


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

        def bert():
            model = transformers.BertModel(transformers.BertConfig()).to(dev).eval()
            return (lambda ids: model(ids).last_hidden_state), torch.randint(0, 30000, (8, 128), device=dev)

        def gpt2():
            model = transformers.GPT2Model(transformers.GPT2Config()).to(dev).eval()
            return (lambda ids: model(ids).last_hidden_state), torch.randint(0, 50000, (8, 256), device=dev)

        rows += [("BERT b8 s128", bert), ("GPT-2 b8 s256", gpt2)]
    except ImportError:
        print("transformers missing: no BERT/GPT-2 rows")
    return [(n, make) for n, make in rows if not only or n.split()[0] in only]


def gpu_time(fn, x, iters=50) -> float:
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    return latency_ms(fn, x, iters)


def cold(fn, x):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(x)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", help="first words of row names, e.g. resnet50 BERT")
    parser.add_argument("--mode", default=None)
    parser.add_argument("--skip-inductor", action="store_true")
    parser.add_argument("--options", default="{}", help='torchweld options as JSON, e.g. \'{"channels_last": false}\'')
    args = parser.parse_args()
    options = json.loads(args.options)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, float32, mode={args.mode}, options={options}")
    header = (f"{'case':24s} {'eager ms':>9s} {'inductor ms':>11s} {'weld ms':>8s} {'ind x':>6s} {'weld x':>7s} "
              f"{'ind cold s':>10s} {'weld cold s':>11s} {'max err':>8s}")
    print(header)
    print("-" * len(header))
    for name, make in cases(set(args.only) if args.only else None):
        fn, x = make()
        with torch.no_grad():
            eager = gpu_time(fn, x)
            expected = fn(x)
            if args.skip_inductor:
                ind, ind_cold = float("nan"), float("nan")
            else:
                torch._dynamo.reset()
                compiled = torch.compile(fn, mode=args.mode)
                ind_cold, _ = cold(compiled, x)
                ind = gpu_time(compiled, x)
                torch._dynamo.reset()
            with tempfile.TemporaryDirectory() as tmp, config.patch(cache_dir=tmp):
                welded = torchweld.compile(fn, backend="weld", mode=args.mode, options=options)
                weld_cold, out = cold(welded, x)
                weld = gpu_time(welded, x)
            err = (out - expected).abs().max().item() / max(expected.abs().max().item(), 1e-6)
        print(f"{name:24s} {eager:9.3f} {ind:11.3f} {weld:8.3f} {eager / ind:6.2f} {eager / weld:7.2f} "
              f"{ind_cold:10.1f} {weld_cold:11.1f} {err:8.1e}", flush=True)
        if name.startswith("add/mul"):
            bytes_moved = 2 * x.numel() * 4
            print(f"  weld add/mul chain bandwidth: {bytes_moved / (weld * 1e-3) / 1e12:.2f} TB/s (copy ceiling ~3.0)")
        del fn, x


if __name__ == "__main__":
    main()
