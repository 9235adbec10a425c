"""A transformers GPT-2's training step under torch.autocast on CUDA: eager vs weld vs torch.compile.

    python3 bench/investigations/amp_train_gpu.py [--dtype bfloat16|float16] [--batch 8] [--size 256]
                                   [--where around|inside] [--compilers torch.compile weld]

The model (default config, dropout 0) runs its forward inside `torch.autocast("cuda", dtype)`;
the loss is `out.float().square().mean()` and the backward runs outside the region, as in a
mixed-precision loop (no optimizer, no grad scaler). With `--where around` (the default) the
model is compiled and the region is around its call; with `--where inside` the whole step
function is compiled, the region inside it (both compilers then break the graph at
`loss.backward()`). Eager runs first, then each of `--compilers` in that order, each on its own
copy of the same weights, in this one process: the first step's wall time (cold), then five
rounds of ten steps timed with CUDA events (the median round), and each compiled first step's
gradients against eager's (the largest error over the parameters, relative to that gradient's
largest entry).
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import torchweld


def step(model, x, dtype):
    with torch.autocast("cuda", dtype=dtype):
        out = model(x).last_hidden_state
        loss = out.float().square().mean()
    loss.backward()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--where", default="around", choices=["around", "inside"])
    parser.add_argument("--compilers", nargs="*", default=["torch.compile", "weld"], choices=["torch.compile", "weld"])
    args = parser.parse_args()
    import transformers

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    config = transformers.GPT2Config(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    base = transformers.GPT2Model(config).cuda().train()
    x = torch.randint(0, config.vocab_size, (args.batch, args.size), device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPT-2 b{args.batch} s{args.size}, "
          f"autocast {args.dtype} {args.where} the compiled code")
    results = {}
    compilers = {"eager": lambda f: f, "torch.compile": torch.compile, "weld": torchweld.compile}
    for name in ("eager", *args.compilers):
        model = copy.deepcopy(base)
        if args.where == "around":
            fn, run = compilers[name](model), step
        else:
            fn, run = model, compilers[name](step)
        torch.cuda.synchronize()
        start = time.perf_counter()
        run(fn, x, dtype)
        torch.cuda.synchronize()
        cold = time.perf_counter() - start
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        for _ in range(5):
            model.zero_grad(set_to_none=True)
            run(fn, x, dtype)
        begin, end, rounds = torch.cuda.Event(True), torch.cuda.Event(True), []
        for _ in range(5):
            begin.record()
            for _ in range(10):
                model.zero_grad(set_to_none=True)
                run(fn, x, dtype)
            end.record()
            torch.cuda.synchronize()
            rounds.append(begin.elapsed_time(end) / 10)
        results[name] = (sorted(rounds)[2], cold, grads)
    eager_ms, _, eager_grads = results["eager"]
    print(f"{'':14s} {'ms/step':>8s} {'x eager':>8s} {'cold s':>7s} {'worst grad err':>15s}")
    for name, (ms, cold, grads) in results.items():
        err = max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                  for n, g in eager_grads.items()) if name != "eager" else 0.0
        print(f"{name:14s} {ms:8.3f} {eager_ms / ms:8.2f} {cold:7.1f} {err:15.1e}")


if __name__ == "__main__":
    main()
