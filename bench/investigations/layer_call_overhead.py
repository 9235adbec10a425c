"""The host time a compiled transformer layer adds per training step, as FSDP2's recipe
calls it: each decoder layer of a Llama compiled on its own (issue 47's FSDP2 row, where the
GPU waits for the host). Tiny widths, so that the device's work is small beside the host's:
the step time is then the host's time to issue it.

    python bench/investigations/layer_call_overhead.py [--device cuda] [--layers 18] [--hidden 64]
        [--steps 200] [--compilers eager,torch,torchweld] [--cprofile torchweld]

Per compiler: ms per step (forward of the whole model, a float32 mean of the logits, backward;
no optimizer), its difference from eager's, and that difference per layer call (forward and
backward together). --cprofile NAME prints the 30 functions NAME's steps spend most time in
(cProfile, own time), for torchweld's per-call path. --kernels prints each compiler's 20 kernels
of most device time per step (torch.profiler), for the real widths (`--hidden 2048 --seq 1024`).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402


def build(args, compiler: str):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=256, max_position_embeddings=256, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(args.device, torch.bfloat16)
    layers = model.model.layers
    if compiler != "eager":
        import torchweld

        compile_ = torch.compile if compiler == "torch" else torchweld.compile
        for i, layer in enumerate(layers):
            layers[i] = compile_(layer)
    ids = torch.randint(0, 256, (args.batch, args.seq), device=args.device)

    def step():
        logits = model(input_ids=ids, use_cache=False).logits
        logits.float().mean().backward()

    return step


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def print_kernels(step, args, steps: int = 3) -> None:
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if args.device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            step()
        sync(args.device)
    key = "self_device_time_total" if args.device == "cuda" else "self_cpu_time_total"
    rows = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    rows.sort(key=lambda e: -getattr(e, key))
    total = sum(getattr(e, key) for e in rows)
    print(f"  device time {total / steps / 1e3:.3f} ms a step; top kernels (ms a step, calls a step):")
    for e in rows[:20]:
        print(f"  {getattr(e, key) / steps / 1e3:8.3f} {e.count / steps:6.1f}  {e.key[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compilers", default="eager,torch,torchweld")
    parser.add_argument("--cprofile", default=None, help="a compiler whose steps cProfile breaks down")
    parser.add_argument("--kernels", action="store_true", help="each compiler's top kernels by device time")
    args = parser.parse_args()
    times = {}
    for compiler in args.compilers.split(","):
        step = build(args, compiler)
        for _ in range(5):
            step()
        sync(args.device)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync(args.device)
            best = min(best, (time.perf_counter() - t0) / args.steps * 1e3)
        times[compiler] = best
        eager = times.get("eager")
        extra = f"  {best - eager:+.3f} ms over eager, {(best - eager) / args.layers * 1e3:+.1f} us a layer" if eager else ""
        print(f"{compiler:10s} {best:.3f} ms a step{extra}", flush=True)
        if compiler == args.cprofile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.steps):
                step()
            sync(args.device)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        if args.kernels:
            print_kernels(step, args)
    if "torch" in times and "torchweld" in times:
        d = times["torchweld"] - times["torch"]
        print(f"torchweld - torch.compile: {d:+.3f} ms a step, {d / args.layers * 1e3:+.1f} us a layer call "
              "(forward and backward)")


if __name__ == "__main__":
    main()
