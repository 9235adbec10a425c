"""Externs are called through torch's public bindings where those select the same overload."""
import torch

from torchweld.compiler.codegen.bindings import _BOUND_BY, fast_callable

from weld_helpers import check

aten = torch.ops.aten


def test_every_listed_operator_has_its_binding_in_this_torch():
    for name, module in _BOUND_BY.items():
        assert getattr(torch.ops.aten, name).default._opname == name
        assert fast_callable(getattr(torch.ops.aten, name).default) is getattr(module, name), name


def test_bindings_select_the_default_overload():
    x, w = torch.randn(2, 4, 8, 8), torch.randn(6, 4, 3, 3)
    a, b, bias = torch.randn(5, 7), torch.randn(7, 3), torch.randn(3)
    cases = [
        (aten.convolution.default, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
        (aten.mm.default, (a, b)),
        (aten.addmm.default, (bias, a, b)),
        (aten.bmm.default, (a.expand(2, 5, 7), b.expand(2, 7, 3))),
        (aten.embedding.default, (torch.randn(10, 3), torch.tensor([[1, 9], [0, 2]]))),
        (aten.gather.default, (a, 1, torch.tensor([[0, 6]] * 5))),
        (aten.avg_pool2d.default, (x, [2, 2], [2, 2])),
        (aten.max_pool2d_with_indices.default, (x, [2, 2], [2, 2])),
        (aten.native_layer_norm.default, (a, [7], None, None, 1e-5)),
    ]
    for op, args in cases:
        torch.testing.assert_close(fast_callable(op)(*args), op(*args), msg=str(op))


def test_other_overloads_keep_the_operator():
    assert fast_callable(aten.mm.out) == aten.mm.out._op
    assert fast_callable(aten.sum.dim_IntList) == aten.sum.dim_IntList._op
    assert fast_callable(aten.convolution_backward.default) == aten.convolution_backward.default._op
    assert fast_callable(len) is len


def test_compiled_cnn_calls_torch_convolution():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU()).eval()
    compiled = check(model, [torch.randn(2, 3, 8, 8)])
    assert any("convolution" in e for e in compiled.externs)
    namespace = compiled.fn.__globals__
    assert torch._C._VariableFunctions.convolution in namespace.values()
