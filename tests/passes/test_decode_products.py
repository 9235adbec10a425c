"""A decoding step's one-row products with fewer kernels (torchweld/passes/decode_products.py,
the kernels in runtime/decode_matvec.py): a SwiGLU gate as one kernel (gpt-fast's F.silu of
nn.Linear products, transformers' act_fn module, F.linear), the linear layers of one input as
one (transformers' q/k/v projections), the forms left alone, the rewritten graphs' results
against eager, and the kernels in Triton's interpreter. The passes only rewrite CUDA tensors;
here they are let rewrite CPU ones, whose ops run eager's kernels."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchweld
from tests.conftest import INTERPRETED
from torchweld.passes import decode_products
from torchweld.runtime import decode_matvec


class GptFast(nn.Module):
    def __init__(self, bias=False, hidden=96):
        super().__init__()
        self.w1, self.w3 = nn.Linear(64, hidden, bias=bias), nn.Linear(64, hidden, bias=False)
        self.w2 = nn.Linear(hidden, 64, bias=False)

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


def rewritten(model, x, monkeypatch, rewrite=decode_products.fuse_gated_products,
              op=decode_matvec.gated_matvec) -> tuple[int, torch.Tensor]:
    """(how many calls of `op` the `rewrite` made, the rewritten graph's result on x)."""
    monkeypatch.setattr(decode_products, "on_kernel_device", lambda t: True)
    counts = []

    def backend(gm, example_inputs):
        rewrite(gm)
        counts.append(sum(n.target is op for n in gm.graph.nodes))
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


def test_the_rewritten_gate_reads_weights_changed_in_place(monkeypatch):
    monkeypatch.setattr(decode_products, "on_kernel_device", lambda t: True)
    model = GptFast().to(torch.bfloat16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(decode_products.fuse_gated_products(gm))
        return gm.forward

    compiled = torchweld.compile(model, backend=backend)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x), model(x))
            model.w3.weight.mul_(-0.5)  # the up projection's weight, between calls
            model.w1.weight.add_(0.01)
    assert len(graphs) == 1 and any(n.target is decode_matvec.gated_matvec for n in graphs[0].graph.nodes)


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
        decode_products.fuse_gated_products(gm)
        counts.append(sum(n.target is decode_matvec.gated_matvec for n in gm.graph.nodes))
        return gm.forward

    with torch.no_grad():
        torchweld.compile(GptFast().to(torch.bfloat16), backend=backend)(torch.randn(1, 1, 64, dtype=torch.bfloat16))
    assert counts == [0]


class Projections(nn.Module):  # transformers' attention: three weights of one input, a fourth reads another
    def __init__(self, functional=False, heads=4):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(64, n, bias=False) for n in (16 * heads, 16, 16))
        self.o = nn.Linear(16 * heads, 64, bias=False)
        self.functional = functional

    def forward(self, x):
        if self.functional:
            q, k, v = (F.linear(x, m.weight) for m in (self.q, self.k, self.v))
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        return self.o(q * (k.sum(-1, keepdim=True) + v.mean(-1, keepdim=True)))


@pytest.mark.parametrize("functional", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_layers_of_one_row_are_grouped_and_compute_as_eager(functional, dtype, monkeypatch):
    model = Projections(functional).to(dtype)
    x = torch.randn(1, 1, 64, dtype=dtype)
    count, out = rewritten(model, x, monkeypatch, decode_products.group_shared_input_products,
                           decode_matvec.grouped_matvec)
    assert count == 1
    torch.testing.assert_close(out, model(x))


def test_gate_and_up_are_grouped_where_they_are_not_gated(monkeypatch):
    model = GptFast().to(torch.bfloat16)
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    count, out = rewritten(model, x, monkeypatch, decode_products.group_shared_input_products,
                           decode_matvec.grouped_matvec)
    assert count == 1
    torch.testing.assert_close(out, model(x))


def test_two_rows_or_biases_are_not_grouped(monkeypatch):
    for model, rows in ((Projections(), 2), (GptFast(bias=True), 1)):
        x = torch.randn(rows, 1, 64, dtype=torch.bfloat16)
        count, out = rewritten(model.to(torch.bfloat16), x, monkeypatch, decode_products.group_shared_input_products,
                               decode_matvec.grouped_matvec)
        assert count == 0
        torch.testing.assert_close(out, model(x))


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


@pytest.mark.skipif(not INTERPRETED, reason="Triton's interpreter (on a GPU machine: the CUDA test)")
def test_grouped_kernel_in_tritons_interpreter():
    x = torch.randn(1, 100, dtype=torch.float16)
    weights = [torch.randn(n, 100, dtype=torch.float16) for n in (40, 16, 9)]
    for config in {decode_matvec.launch_config(65, 100, 132), (4, 64, 2)}:
        outs = [torch.full((1, w.shape[0]), float("nan"), dtype=torch.float16) for w in weights]
        decode_matvec.launch_grouped(x, weights, outs, config)
        for out, w in zip(outs, weights):
            torch.testing.assert_close(out, x @ w.t())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("make", [lambda: GptFast(hidden=512), lambda: Projections(heads=24)])
@pytest.mark.parametrize("options", [{"gated_matvec": True}, {"grouped_matvec": True},
                                     {"gated_matvec": True, "grouped_matvec": True}])
def test_weld_under_cuda_graphs_equals_eager(make, options):
    """Widths of at least decode_matvec.MIN_COLUMNS, so that the kernels run."""
    model = make().cuda().to(torch.bfloat16)
    compiled = torchweld.compile(model, backend="weld", mode="reduce-overhead", options=options)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 1, 64, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x).float(), model(x).float(), atol=3e-2, rtol=3e-2)
