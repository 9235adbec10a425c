"""Where the tutorial's whole training step spends its cold compile, phase by phase.

    TORCHWELD_COMPILE_TRACE=trace.json python3 bench/investigations/whole_step_cold.py [densenet121|resnet50]

One process, empty Triton and torchweld caches: the step (`opt.zero_grad(True)`, forward,
CrossEntropyLoss, `loss.backward()`, Adam's `opt.step()`; batch 16, 3x128x128, float32,
CUDA) compiled whole with `torchweld.compile(train)`, then three steps timed, then
`torchweld.compile_times()`. The first step's time is `compare.py --train --whole-step`'s
cold time; TORCHWELD_COMPILE_TRACE writes each phase with its thread as a Chrome trace.
"""
import os
import sys
import tempfile
import time

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-cache-"))
os.environ.setdefault("TORCHWELD_CACHE_DIR", tempfile.mkdtemp(prefix="torchweld-cache-"))

import torch  # noqa: E402
import torchvision  # noqa: E402

import torchweld  # noqa: E402


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "densenet121"
    model = getattr(torchvision.models, name)().cuda().train()
    opt = torch.optim.Adam(model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(16, 3, 128, 128, device="cuda")
    y = torch.randint(0, 1000, (16,), device="cuda")

    def train(x, y):
        opt.zero_grad(True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    step = torchweld.compile(train)
    for i in range(3):
        start = time.perf_counter()
        step(x, y)
        torch.cuda.synchronize()
        print(f"step {i}: {time.perf_counter() - start:.2f} s", flush=True)
    print(torchweld.compile_times("str"))


if __name__ == "__main__":
    main()
