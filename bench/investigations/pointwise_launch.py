"""Launch sizes for weld's pointwise Triton kernels: XBLOCK x num_warps, with and without
weld's eviction hints, on kernel bodies of the shapes weld generates (CUDA only).

    python3 bench/investigations/pointwise_launch.py [--bodies chain1,chain12,bnrelu,bnaddrelu,bn2addrelu]

Each body is written as weld writes it (flat `xindex`, per-channel loads at `xindex % C`) and
timed with `triton.testing.do_bench` (L2 flushed between runs) at resnet50's activation sizes
and at 1M-64M floats; a row per size and body, microseconds per launch for each
configuration (E: streamed loads evict first, per-channel ones evict last, as weld emits;
-: no hints). bench/DECISIONS.md#launch-xblock has the H100's figures behind
`tuning.pointwise_xblock` (torchweld/tuning.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile

import torch

# name: (streamed inputs, per-channel inputs, body: an expression, or statements that set `r`)
BODIES = {
    "chain1": (1, 0, "((b0 + 1.0) * 2.0 + 3.0) * 0.5"),
    "chain12": (1, 0, ["r = b0"] + ["r = tl.sin(r) * 1.5 + 0.5", "r = (2 * tl.sigmoid(2 * r) - 1) - tl.exp(-tl.abs(r))",
                                    "r = tl.sigmoid(r) * r"] * 2),
    "bnrelu": (1, 4, "tl.maximum((b0 - s0) * (1.0 / tl.sqrt_rn(s1 + 1e-05) * s2) + s3, 0.0)"),
    "bnaddrelu": (2, 4, "tl.maximum((b0 - s0) * (1.0 / tl.sqrt_rn(s1 + 1e-05) * s2) + s3 + b1, 0.0)"),
    "bn2addrelu": (2, 8, "tl.maximum((b0 - s0) * (1.0 / tl.sqrt_rn(s1 + 1e-05) * s2) + s3"
                         " + (b1 - s4) * (1.0 / tl.sqrt_rn(s5 + 1e-05) * s6) + s7, 0.0)"),
}
CONFIGS = [(1024, 4), (1024, 8), (2048, 8), (2048, 4), (512, 4)]
# (floats, channels): resnet50 b32's activations in layers 1-3, then flat sizes
SIZES = [(32 * 256 * 56 * 56, 256), (32 * 512 * 28 * 28, 512), (32 * 1024 * 14 * 14, 1024),
         (64 * 2 ** 20, 64), (16 * 2 ** 20, 64), (2 ** 20, 64)]


def kernel_source(name: str, streamed: int, per_channel: int, body, evict: bool) -> str:
    first = ", eviction_policy='evict_first'" if evict else ""
    last = ", eviction_policy='evict_last'" if evict else ""
    params = [f"b{i}p" for i in range(streamed)] + [f"s{i}p" for i in range(per_channel)]
    lines = ["import triton", "import triton.language as tl", "", "", "@triton.jit",
             f"def {name}({', '.join(params)}, outp, N, C: tl.constexpr, XBLOCK: tl.constexpr):",
             "    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)",
             "    xmask = xindex < N",
             "    c = xindex % C"]
    lines += [f"    b{i} = tl.load(b{i}p + xindex, xmask, other=0{first})" for i in range(streamed)]
    lines += [f"    s{i} = tl.load(s{i}p + c, xmask, other=0{last})" for i in range(per_channel)]
    if isinstance(body, list):
        lines += ["    " + statement for statement in body]
        body = "r"
    lines.append(f"    tl.store(outp + xindex, {body}, xmask)")
    return "\n".join(lines) + "\n"


def load_kernel(folder: str, name: str, source: str):
    """The @triton.jit function in `source` (Triton reads a kernel's source from its file)."""
    path = os.path.join(folder, name + ".py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bodies", default=",".join(BODIES), help="comma-separated names of BODIES")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA: this sweep times Triton kernels on a GPU")
        return
    import triton
    from triton.testing import do_bench

    bodies = {name: BODIES[name] for name in args.bodies.split(",")}
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}; us per launch, XBLOCK/num_warps, "
          "E = weld's eviction hints")
    folder = tempfile.mkdtemp()
    for n, channels in SIZES:
        big = [torch.randn(n, device="cuda") for _ in range(2)]
        small = [torch.rand(channels, device="cuda") + 0.5 for _ in range(8)]
        out = torch.empty(n, device="cuda")
        for name, (streamed, per_channel, body) in bodies.items():
            row = []
            for evict in (True, False):
                kname = f"{name}_{'evict' if evict else 'plain'}"
                kernel = load_kernel(folder, kname, kernel_source(kname, streamed, per_channel, body, evict))
                for xblock, warps in CONFIGS:
                    def launch():
                        kernel[(triton.cdiv(n, xblock),)](*big[:streamed], *small[:per_channel], out, n,
                                                          C=channels, XBLOCK=xblock, num_warps=warps)
                    us = do_bench(launch, warmup=25, rep=200) * 1e3
                    row.append(f"{'E' if evict else '-'}{xblock}/{warps}:{us:.1f}")
            print(f"{n:9d} {name:11s}", " ".join(row), flush=True)


if __name__ == "__main__":
    main()
