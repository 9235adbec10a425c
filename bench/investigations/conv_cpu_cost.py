"""CPU time to enqueue one convolution, against the same product as a matrix multiply.

    python3 bench/investigations/conv_cpu_cost.py

densenet121 at batch 16 is bound by the host: its 120 cuDNN convolutions cost more CPU
than the GPU spends on them. A 1x1 convolution with stride 1 and no padding on a
channels-last tensor is exactly the matrix product (N*H*W, Cin) @ (Cin, Cout); this
prints, for densenet121's shapes, the CPU microseconds per call of each way of computing it
(back-to-back calls, the GPU far from busy) and the GPU microseconds (CUDA events).
Then the same for the backward (`aten.convolution_backward`, weld's extern in training)
by each entry point, next to eager autograd's backward of the same convolution, and the
CPU cost of one `torch.empty_strided` on the GPU.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

CASES = [  # (N, Cin, H, W, Cout, kernel)
    (16, 64, 32, 32, 128, 1), (16, 256, 32, 32, 128, 1), (16, 512, 16, 16, 128, 1),
    (16, 1024, 8, 8, 128, 1), (16, 128, 32, 32, 32, 3), (16, 128, 8, 8, 32, 3),
]


def per_call_us(fn, iters: int = 300) -> tuple[float, float]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    cpu = (time.perf_counter() - start) / iters * 1e6
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return cpu, begin.elapsed_time(end) / iters * 1e3


def main() -> None:
    mm = torch.ops.aten.mm.default._op
    conv = torch.ops.aten.convolution.default._op
    print(f"cudnn.allow_tf32={torch.backends.cudnn.allow_tf32} matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}")
    for n, cin, h, w, cout, k in CASES:
        x = torch.randn(n, cin, h, w, device="cuda").to(memory_format=torch.channels_last)
        weight = torch.randn(cout, cin, k, k, device="cuda").to(memory_format=torch.channels_last)
        rows = {
            "F.conv2d NHWC": lambda: F.conv2d(x, weight, padding=k // 2),
            "aten.convolution._op NHWC": lambda: conv(x, weight, None, [1, 1], [k // 2] * 2, [1, 1], False, [0, 0], 1),
            "F.conv2d NCHW": lambda: F.conv2d(x.contiguous(), weight.contiguous(), padding=k // 2),
        }
        if k == 1:
            x2 = x.permute(0, 2, 3, 1).reshape(n * h * w, cin)
            w2 = weight.reshape(cout, cin).t()
            rows["aten.mm._op fp32"] = lambda: mm(x2, w2)
            rows["aten.mm._op tf32"] = "tf32"
        print(f"\nN={n} Cin={cin} {h}x{w} Cout={cout} k={k}")
        for label, fn in rows.items():
            if fn == "tf32":
                torch.backends.cuda.matmul.allow_tf32 = True
                cpu, gpu = per_call_us(lambda: mm(x2, w2))
                torch.backends.cuda.matmul.allow_tf32 = False
            else:
                cpu, gpu = per_call_us(fn)
            print(f"  {label:28s} CPU {cpu:7.1f} us   GPU {gpu:7.1f} us")
    backward_rows()
    try:
        from torchweld.runtime.triton_matmul import CONFIGS, TritonMatmul
        x2 = torch.randn(16 * 32 * 32, 256, device="cuda")
        w2 = torch.randn(128, 256, device="cuda").t()
        for config in CONFIGS[:4]:
            cpu, gpu = per_call_us(lambda: TritonMatmul(config)(x2, w2))
            print(f"  TritonMatmul{config} CPU {cpu:7.1f} us   GPU {gpu:7.1f} us")
    except Exception as e:  # noqa: BLE001
        print("TritonMatmul:", e)


def backward_rows() -> None:
    """convolution_backward's CPU cost per entry point (grad_input and grad_weight, no bias)."""
    op = torch.ops.aten.convolution_backward.default
    for n, cin, h, w, cout, k in CASES[-2:]:
        x = torch.randn(n, cin, h, w, device="cuda").to(memory_format=torch.channels_last)
        weight = torch.randn(cout, cin, k, k, device="cuda").to(memory_format=torch.channels_last)
        grad = F.conv2d(x, weight, padding=k // 2)
        args = (grad, x, weight, [0], [1, 1], [k // 2] * 2, [1, 1], False, [0, 0], 1, [True, True, False])
        x_leaf, w_leaf = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = F.conv2d(x_leaf, w_leaf, padding=k // 2)
        rows = {
            "convolution_backward OpOverload": lambda: op(*args),
            "convolution_backward ._op": lambda: op._op(*args),
            "eager autograd.grad (retain)": lambda: torch.autograd.grad(out, (x_leaf, w_leaf), grad, retain_graph=True),
        }
        print(f"\nbackward N={n} Cin={cin} {h}x{w} Cout={cout} k={k}")
        for label, fn in rows.items():
            cpu, gpu = per_call_us(fn)
            print(f"  {label:34s} CPU {cpu:7.1f} us   GPU {gpu:7.1f} us")
    cpu, _ = per_call_us(lambda: torch.empty_strided((16, 128, 32, 32), (131072, 1, 4096, 128), device="cuda"))
    print(f"\n  torch.empty_strided (cuda, cached)  CPU {cpu:7.1f} us")
    cpu, _ = per_call_us(lambda: torch.empty(0, device="cuda"))
    print(f"  torch.empty(0) (cuda)                CPU {cpu:7.1f} us")


if __name__ == "__main__":
    main()
