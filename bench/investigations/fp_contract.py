"""weld's C++ kernels built with g++'s default floating-point contraction (-ffp-contract=fast:
`a * b + c` becomes one fma) against -ffp-contract=off: how many elements of each result
differ from eager's, bit for bit, and the time per call of a few CPU kernels, in turns.

    .venv/bin/python bench/investigations/fp_contract.py [--numel 1000000] [--min-time 0.5] [--record]

Eager computes each op in a kernel of its own and rounds its result to the tensor's dtype;
a fused weld kernel holding `x * y + z` rounds once where contracted. Eager's own kernels
contract inside one op only (add's alpha, lerp, addcmul: Vectorized fmadd).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "investigations"))
import torchweld  # noqa: E402
from bench import records  # noqa: E402
from compare import steady  # noqa: E402  (timing in turns)
from torchweld.runtime import cpp_loader  # noqa: E402

CONTRACT = {"fast": "-ffp-contract=fast", "off": "-ffp-contract=off"}

# name -> fn of (x, y, z): pointwise chains users write, the ops eager fuses itself, and
# kernels where g++ contracts most (a polynomial, a dot product along rows)
CASES = {
    "x * y + z": lambda x, y, z: x * y + z,
    "z - x * y": lambda x, y, z: z - x * y,
    "relu(x * 0.3 + y)": lambda x, y, z: torch.relu(x * 0.3 + y),
    "add(x, y, alpha=0.3)": lambda x, y, z: torch.add(x, y, alpha=0.3),
    "sub(x, y, alpha=0.3)": lambda x, y, z: torch.sub(x, y, alpha=0.3),
    "addcmul(x, y, z, value=0.7)": lambda x, y, z: torch.addcmul(x, y, z, value=0.7),
    "addcdiv(x, y, z, value=0.7)": lambda x, y, z: torch.addcdiv(x, y, z.abs() + 1, value=0.7),
    "lerp(x, y, 0.3)": lambda x, y, z: torch.lerp(x, y, 0.3),
    "lerp(x, y, 0.8)": lambda x, y, z: torch.lerp(x, y, 0.8),
    "lerp(x, y, z)": lambda x, y, z: torch.lerp(x, y, z),
    "polynomial of degree 8": lambda x, y, z: ((((((((x * 0.1 + 0.2) * x + 0.3) * x + 0.4) * x + 0.5) * x + 0.6)
                                               * x + 0.7) * x + 0.8) * x + 0.9),
    "gelu(x, tanh)": lambda x, y, z: F.gelu(x, approximate="tanh"),
    "(x * y).sum(-1)": lambda x, y, z: (x * y).sum(-1),
    "layer_norm(x)": lambda x, y, z: F.layer_norm(x, x.shape[-1:]),
    "softmax(x)": lambda x, y, z: torch.softmax(x, -1),
}
TIMED = ["x * y + z", "relu(x * 0.3 + y)", "polynomial of degree 8", "gelu(x, tanh)", "(x * y).sum(-1)",
         "layer_norm(x)", "softmax(x)"]


def inputs(numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(numel // 256, 256, generator=g, dtype=dtype) for _ in range(3)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--min-time", type=float, default=0.5)
    parser.add_argument("--record", action="store_true", help="append the figures to bench/records")
    args = parser.parse_args()
    flags = list(cpp_loader.CXXFLAGS)
    compiled: dict[str, dict[str, object]] = {}
    rows = {name: {"differing": {}, "ms": {}} for name in CASES}
    for mode, flag in CONTRACT.items():
        cpp_loader.CXXFLAGS[:] = [f for f in flags if not f.startswith("-ffp-contract")] + [flag]
        torchweld.reset()
        compiled[mode] = {name: torchweld.compile(fn) for name, fn in CASES.items()}
        for name, fn in CASES.items():
            for dtype in (torch.float32, torch.float64):
                xs = inputs(4096, dtype)
                got, want = compiled[mode][name](*xs), fn(*xs)
                rows[name]["differing"][f"{mode} {str(dtype)[6:]}"] = int((got != want).sum())
        for name in TIMED:  # built here, with this mode's flags
            compiled[mode][name](*inputs(args.numel, torch.float32))
    cpp_loader.CXXFLAGS[:] = flags
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; elements differing from eager of 4096 "
          f"(float32, float64); ms per call of {args.numel} float32 elements")
    print(f"{'case':30} {'fast f32':>8} {'f64':>5} {'off f32':>8} {'f64':>5}   {'eager':>7} {'fast':>7} {'off':>7}")
    for name in CASES:
        if name in TIMED:
            xs = inputs(args.numel, torch.float32)
            fns = {"eager": CASES[name], **{mode: compiled[mode][name] for mode in CONTRACT}}
            seconds = steady({k: (lambda _, f=f: f(*xs)) for k, f in fns.items()}, None, min_time=args.min_time)
            rows[name]["ms"] = {k: s * 1e3 for k, s in seconds.items()}
        d, ms = rows[name]["differing"], rows[name]["ms"]
        times = "".join(f" {ms[k]:7.3f}" for k in ("eager", "fast", "off")) if ms else ""
        print(f"{name:30} {d['fast float32']:8} {d['fast float64']:5} {d['off float32']:8} {d['off float64']:5}  {times}")
    if args.record:
        records.append("fp_contract", records.make_record(
            "fp_contract", [{"case": k, **v} for k, v in rows.items()], options=vars(args),
            threads=torch.get_num_threads(), device="cpu"))


if __name__ == "__main__":
    main()
