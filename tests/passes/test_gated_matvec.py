"""A one-row SwiGLU gate as one kernel (torchweld/passes/gated_matvec.py, the kernel in
runtime/decode_matvec.py): the forms rewritten (gpt-fast's F.silu of nn.Linear products,
transformers' act_fn module, F.linear), those left alone, the rewritten graph's results
against eager, and the kernel in Triton's interpreter. The pass only rewrites CUDA tensors;
here it is let rewrite CPU ones, whose op runs eager's three kernels."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchweld
from tests.conftest import INTERPRETED
from torchweld.passes import gated_matvec
from torchweld.runtime import decode_matvec


class GptFast(nn.Module):
    def __init__(self, bias=False):
        super().__init__()
        self.w1, self.w3 = nn.Linear(64, 96, bias=bias), nn.Linear(64, 96, bias=False)
        self.w2 = nn.Linear(96, 64, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Transformers(GptFast):  # LlamaMLP: act_fn a module, the product's operands the other way round
    def __init__(self):
        super().__init__()
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.w3(x) * self.act_fn(self.w1(x)))


class Functional(GptFast):
    def forward(self, x):
        return F.silu(F.linear(x, self.w1.weight)) * F.linear(x, self.w3.weight)


class GateReadTwice(GptFast):
    def forward(self, x):
        gate = F.silu(self.w1(x))
        return self.w2(gate * self.w3(x)) + gate.sum()


def rewritten(model, x, monkeypatch) -> tuple[int, torch.Tensor]:
    """(how many gates the pass rewrote, the rewritten graph's result on x)."""
    monkeypatch.setattr(gated_matvec, "on_kernel_device", lambda t: True)
    counts = []

    def backend(gm, example_inputs):
        gated_matvec.fuse_gated_products(gm)
        counts.append(sum(n.target is decode_matvec.gated_matvec for n in gm.graph.nodes))
        return gm.forward

    with torch.no_grad():
        out = torchweld.compile(model, backend=backend)(x)
    return sum(counts), out


@pytest.mark.parametrize("cls", [GptFast, Transformers, Functional])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_one_row_gate_is_rewritten_and_computes_as_eager(cls, dtype, monkeypatch):
    model = cls().to(dtype)
    x = torch.randn(1, 1, 64, dtype=dtype)
    count, out = rewritten(model, x, monkeypatch)
    assert count == 1
    torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("case", ["two rows", "bias", "float32", "gate read twice"])
def test_what_is_left_alone(case, monkeypatch):
    model = {"bias": GptFast(bias=True), "gate read twice": GateReadTwice()}.get(case, GptFast())
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    x = torch.randn(2 if case == "two rows" else 1, 1, 64, dtype=dtype)
    count, out = rewritten(model.to(dtype), x, monkeypatch)
    assert count == 0
    torch.testing.assert_close(out, model(x))


def test_cpu_tensors_are_left_alone():
    counts = []

    def backend(gm, example_inputs):
        gated_matvec.fuse_gated_products(gm)
        counts.append(sum(n.target is decode_matvec.gated_matvec for n in gm.graph.nodes))
        return gm.forward

    with torch.no_grad():
        torchweld.compile(GptFast().to(torch.bfloat16), backend=backend)(torch.randn(1, 1, 64, dtype=torch.bfloat16))
    assert counts == [0]


@pytest.mark.skipif(not INTERPRETED, reason="Triton's interpreter (on a GPU machine: the CUDA test)")
@pytest.mark.parametrize("n,k", [(40, 48), (9, 1500)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_in_tritons_interpreter(n, k, dtype):
    x = torch.randn(1, k, dtype=dtype)
    w_gate, w_up = torch.randn(n, k, dtype=dtype) / k ** 0.5, torch.randn(n, k, dtype=dtype)
    out = torch.empty(1, n, dtype=dtype)
    decode_matvec.launch_gated(x, w_gate, w_up, out, decode_matvec.gated_launch_config(n, k, 132))
    gate, up = ((x.float() @ w.float().t()).to(dtype) for w in (w_gate, w_up))  # rounded as eager's
    # three roundings (the gate, silu, the product), each of which the interpreter does by
    # truncating for bfloat16 (a unit of 2**-8 off, relative, at each)
    rtol = 4e-2 if dtype == torch.bfloat16 else 4 * 2 ** -11
    torch.testing.assert_close(out, F.silu(gate) * up, atol=2e-2, rtol=rtol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_weld_under_cuda_graphs_equals_eager():
    model = GptFast().cuda().to(torch.bfloat16)
    compiled = torchweld.compile(model, backend="weld", mode="reduce-overhead", options={"gated_matvec": True})
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 1, 64, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x).float(), model(x).float(), atol=3e-2, rtol=3e-2)
