"""How fast runtime/decode_matvec.py's kernel multiplies a decoder's weights by a row,
against cuBLAS (`x @ w.t()`, what aten.mm runs), for the 0.85B decoder's products (bench/decode.py):
each configuration of the kernel, its chosen one (`launch_config`), and the fused shapes
(q/k/v as one product, gate/up as one), and a SwiGLU gate's three kernels against
gated_matvec's one, and q/k/v apart against grouped_matvec. Each call is timed inside a CUDA graph of calls over
distinct weight copies (more bytes than L2 holds), so that weights come from memory, as in a
decoding step. Prints us a call and GB/s of weights read.

    python bench/investigations/matvec.py [--sweep]

One H200 run (2026-11-28) found cuBLAS 2-9x faster at 8 rows with a kernel that kept eight
rows of sums: decode_matvec takes one row only.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from torchweld.runtime import decode_matvec  # noqa: E402

SHAPES = {  # name: (n, k) of w [n, k] (a Linear's weight)
    "q/o 2048x2048": (2048, 2048), "k/v 512x2048": (512, 2048), "gate/up 5632x2048": (5632, 2048),
    "down 2048x5632": (2048, 5632), "lm_head 32000x2048": (32000, 2048),
    "qkv fused 3072x2048": (3072, 2048), "gate+up fused 11264x2048": (11264, 2048),
}


def time_calls(call, copies: int, replays: int = 20) -> float:
    """us a call of `call(i)` for i over the weight copies, replayed in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm-up: Triton compiles, cuBLAS picks
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * copies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="every configuration, not only the chosen one")
    args = parser.parse_args()
    dtype = torch.bfloat16
    processors = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {processors} multiprocessors, {dtype}")
    m = 1
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, min(64, (512 << 20) // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5 for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        outs = [torch.empty(m, n, device="cuda", dtype=dtype) for _ in range(copies)]
        ref = (x.float() @ weights[0].float().t())
        results = {"cublas": time_calls(lambda i: torch.mm(x, weights[i].t(), out=outs[i]), copies)}
        chosen = decode_matvec.launch_config(n, k, processors)
        configs = [chosen]
        if args.sweep:
            configs += list(itertools.product((1, 2, 4, 8, 16, 32), (128, 256, 512, 1024), (2, 4, 8)))
        for config in dict.fromkeys(configs):
            try:
                results[config] = time_calls(lambda i: decode_matvec.launch(x, weights[i].t(), outs[i], config),
                                             copies)
            except Exception as e:  # noqa: BLE001 (a configuration Triton refuses)
                print(f"  {config}: {type(e).__name__}: {str(e)[:100]}")
                continue
            decode_matvec.launch(x, weights[0].t(), outs[0], config)
            err = (outs[0].float() - ref).abs().max().item()
            if err > 0.05 * ref.abs().max().item():
                print(f"  {config}: WRONG, max diff {err}")
        best = sorted(results.items(), key=lambda kv: kv[1])
        line = ", ".join(f"{c}: {us:.2f} us {nbytes / us / 1e3:.0f} GB/s" for c, us in best[:4])
        print(f"{name}: cublas {results['cublas']:.2f} us ({nbytes / results['cublas'] / 1e3:.0f} GB/s), "
              f"chosen {chosen} {results.get(chosen, float('nan')):.2f} us; best: {line}")
        del weights, outs
    gated(processors, dtype, args.sweep)
    grouped(processors, dtype)


def grouped(processors: int, dtype: torch.dtype, k: int = 2048, ns: tuple = (2048, 512, 512)) -> None:
    """transformers' q/k/v projections of one row: cuBLAS's three products, decode_matvec's
    three, and grouped_matvec's one kernel."""
    copies = max(2, min(64, (512 << 20) // (sum(ns) * k * 2)))
    groups = [[torch.randn(n, k, device="cuda", dtype=dtype) for n in ns] for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    outs = [[torch.empty(1, n, device="cuda", dtype=dtype) for n in ns] for _ in range(copies)]

    def apart(i, product):  # product(w, out) writes x @ w.T into out
        for w, out in zip(groups[i], outs[i]):
            product(w, out)

    def matvec(w, out):
        decode_matvec.launch(x, w.t(), out, decode_matvec.launch_config(w.shape[0], k, processors))

    config = decode_matvec.launch_config(sum(ns), k, processors)
    results = {"cublas x3": time_calls(lambda i: apart(i, lambda w, out: torch.mm(x, w.t(), out=out)), copies),
               "matvec x3": time_calls(lambda i: apart(i, matvec), copies),
               f"grouped {config}": time_calls(lambda i: decode_matvec.launch_grouped(x, groups[i], outs[i], config),
                                               copies)}
    nbytes = sum(ns) * k * 2
    print(f"q/k/v {ns}x{k}: " + ", ".join(f"{name}: {us:.2f} us {nbytes / us / 1e3:.0f} GB/s"
                                          for name, us in sorted(results.items(), key=lambda kv: kv[1])))


def gated(processors: int, dtype: torch.dtype, sweep: bool, n: int = 5632, k: int = 2048) -> None:
    """silu(x @ w_gate.T) * (x @ w_up.T): cuBLAS's two products and aten's pointwise kernels,
    decode_matvec's two products and aten's, and gated_matvec's one kernel."""
    import torch.nn.functional as F

    copies = max(2, min(64, (512 << 20) // (2 * n * k * 2)))
    pairs = [(torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5, torch.randn(n, k, device="cuda", dtype=dtype))
             for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    outs = [torch.empty(1, n, device="cuda", dtype=dtype) for _ in range(copies)]

    def matvecs(i):
        g, u = (decode_matvec.matvec(x, w.t()) for w in pairs[i])
        torch.mul(F.silu(g), u, out=outs[i])

    results = {"cublas x2 + pointwise": time_calls(lambda i: torch.mul(F.silu(x @ pairs[i][0].t()),
                                                                         x @ pairs[i][1].t(), out=outs[i]), copies),
               "matvec x2 + pointwise": time_calls(matvecs, copies)}
    chosen = decode_matvec.gated_launch_config(n, k, processors)
    configs = [chosen] + ([(bn, bk, nw) for bn in (1, 2, 4, 8) for bk in (512, 1024) for nw in (2, 4)] if sweep else [])
    for config in dict.fromkeys(configs):
        results[f"gated {config}"] = time_calls(
            lambda i: decode_matvec.launch_gated(x, *pairs[i], outs[i], config), copies)
    nbytes = 2 * n * k * 2
    ranked = sorted(results.items(), key=lambda kv: kv[1])
    print(f"gate+up {n}x{k} (chosen {chosen}): "
          + ", ".join(f"{name}: {us:.2f} us {nbytes / us / 1e3:.0f} GB/s" for name, us in ranked))


if __name__ == "__main__":
    main()
