"""The "Introduction to torch.compile" tutorial, with torchweld in place of torch.compile.

    make demo        (or: .venv/bin/python examples/tutorial.py)
"""
import copy
import time

import torch
import torch.nn as nn

import torchweld


def banner(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)))


# 1. Compile a function ------------------------------------------------------------------
banner("1. a compiled function")


def foo(x, y):
    a = torch.sin(x)
    b = torch.cos(y)
    return a + b


opt_foo1 = torchweld.compile(foo)
x, y = torch.randn(10, 10), torch.randn(10, 10)
print("matches eager:", torch.allclose(opt_foo1(x, y), foo(x, y)))


# 2. Decorate a function ---------------------------------------------------------------------
banner("2. a decorated function")


@torchweld.compile
def opt_foo2(x, y):
    a = torch.sin(x)
    b = torch.cos(y)
    return a + b


print("matches eager:", torch.allclose(opt_foo2(x, y), foo(x, y)))


# 3. Compile an nn.Module --------------------------------------------------------------------
banner("3. a compiled nn.Module")


class MyModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(100, 10)

    def forward(self, x):
        return torch.nn.functional.relu(self.lin(x))


mod = MyModule()
opt_mod = torchweld.compile(mod)
t = torch.randn(10, 100)
print("matches eager:", torch.allclose(opt_mod(t), mod(t)))
print("state_dict keys are unchanged:", list(opt_mod.state_dict()))


# 4. A custom backend sees each FX graph ---------------------------------------------------------
banner("4. a custom backend that prints each graph")


def print_graph_backend(gm: torch.fx.GraphModule, example_inputs):
    print(f"graph with {len(example_inputs)} inputs:")
    gm.graph.print_tabular()
    return gm.forward


def bar(a, b):
    x = a / (torch.abs(a) + 1)
    if b.sum() < 0:
        b = b * -1
    return x * b


torchweld.compile(foo, backend=print_graph_backend)(x, y)


# 5. Eager vs compiled timings -----------------------------------------------------------------
banner("5. eager vs compiled timings (median of 50 calls)")


def timed(fn, *args, calls=200):
    for _ in range(10):
        fn(*args)
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def chain(t):  # 12 pointwise operations: weld fuses them into one C++ loop
    for _ in range(2):
        t = torch.sin(t) * 1.5 + 0.5
        t = torch.tanh(t) - torch.exp(-t.abs())
        t = torch.sigmoid(t) * t
    return t


model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256)).eval()
for name, fn, inp in [("elementwise chain, 1M floats", chain, torch.randn(1 << 20)),
                      ("MLP, batch 64", model, torch.randn(64, 256))]:
    start = time.perf_counter()
    compiled_fn = torchweld.compile(fn)
    with torch.no_grad():
        compiled_fn(inp)
        first_ms = (time.perf_counter() - start) * 1000
        eager_us, compiled_us = timed(fn, inp, calls=50), timed(compiled_fn, inp, calls=50)
    print(f"{name:30s} first call (capture + compile) {first_ms:7.1f} ms   eager {eager_us:8.1f} us   "
          f"torchweld {compiled_us:8.1f} us   speedup {eager_us / compiled_us:.2f}x")


# 6. explain(): graphs, breaks and guards ----------------------------------------------------------
banner("6. explain() on a function with data-dependent control flow")
print(torchweld.explain(bar)(torch.randn(10), torch.randn(10)))


# 7. A whole train step: forward, backward and Adam ------------------------------------------------
banner("7. a whole train step compiled: the backward is compiled, Adam's step is captured")
train_model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
reference_model = copy.deepcopy(train_model)
train_opt = torch.optim.Adam(train_model.parameters(), lr=1e-2)
reference_opt = torch.optim.Adam(reference_model.parameters(), lr=1e-2)


def train(model, opt, x, y):
    opt.zero_grad(True)
    loss = nn.CrossEntropyLoss()(model(x), y)
    loss.backward()
    opt.step()
    return loss


compiled_train = torchweld.compile(train)
for _ in range(3):
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    loss = compiled_train(train_model, train_opt, x, y)
    train(reference_model, reference_opt, x, y)
print("loss:", loss)  # grad_fn=<CompiledFunctionBackward>: the backward is weld's
print("parameters after 3 Adam steps match eager:",
      all(torch.allclose(p, q, atol=1e-5) for p, q in zip(train_model.parameters(), reference_model.parameters())))
report = str(torchweld.explain(train)(train_model, train_opt, x, y))
shown = ("Graph count", "Graph break count", "Break reasons", "  1.", "  2.", "Ops in graph")
print("\n".join(line[:150] for line in report.splitlines() if line.startswith(shown)))
