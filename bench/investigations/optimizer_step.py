"""Adam's `opt.step()` alone: native against captured and compiled by torchweld.

    python3 bench/investigations/optimizer_step.py [--params 364] [--size 16] [--device cpu|cuda] [--backend weld]
    python3 bench/investigations/optimizer_step.py --shapes-of densenet121 --device cuda   # torchvision's shapes

Makes `--params` parameters of `--size` floats (or a torchvision model's parameter shapes) with gradients, then times `opt.step()` run
natively and through `torchweld.compile` (median ms of 200 calls after warm-up; on CUDA each
call is synchronized, so the figures are CPU-bound latency), and prints the compiled step's
cold compile (first call, empty torchweld cache) and its guard check alone (ms per call).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
import warnings

import torch

import torchweld
from torchweld import config
from torchweld.capture import cache


def timed_ms(fn, device: str, calls: int = 200) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(5):
        fn()
    samples = []
    for _ in range(calls):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def optimizer_step(opt):
    opt.step()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=364, help="densenet121 has 364")
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="weld")
    parser.add_argument("--shapes-of", help="a torchvision model whose parameter shapes to use instead")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.shapes_of:
        import torchvision

        shapes = [p.shape for p in getattr(torchvision.models, args.shapes_of)().parameters()]
        what = f"{len(shapes)} parameters of {args.shapes_of} ({len(set(shapes))} distinct shapes)"
    else:
        shapes = [(args.size,)] * args.params
        what = f"{args.params} parameters of {args.size} floats"
    params = [torch.nn.Parameter(torch.randn(shape, device=args.device)) for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    native = torch.optim.Adam(params, lr=1e-3)
    print(f"torch {torch.__version__}, {args.device}, {what}, Adam")
    print(f"  native step      {timed_ms(native.step, args.device):8.3f} ms")
    captured = torch.optim.Adam(params, lr=1e-3)
    compiled = torchweld.compile(optimizer_step, backend=args.backend)
    with tempfile.TemporaryDirectory() as tmp, config.patch(cache_dir=tmp):
        start = time.perf_counter()
        compiled(captured)
        cold = time.perf_counter() - start
        step_ms = timed_ms(lambda: compiled(captured), args.device)
    with warnings.catch_warnings():  # gc.get_objects() meets torch's deprecated module proxies
        warnings.simplefilter("ignore")
        entry = max((o for o in gc.get_objects() if isinstance(o, cache.CacheEntry)), key=lambda o: len(o.guards.guards))
    guard_ms = timed_ms(lambda: entry.check(captured), "cpu")
    print(f"  torchweld step   {step_ms:8.3f} ms   cold compile {cold:6.1f} s   "
          f"guards {guard_ms:.3f} ms ({len(entry.guards.guards)} guards)")
    print("  " + torchweld.compile_times("str").replace("\n", "\n  "))


if __name__ == "__main__":
    main()
