"""torchweld's own decompositions (compiler/decompositions.py) against torch's and eager."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from torchweld.compiler.aten_graph import to_aten_graph
from torchweld.compiler.decompositions import addmm

from weld_helpers import check, tolerances

aten = torch.ops.aten


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_linear_multiplies_in_its_own_dtype(dtype, device):
    """torch's addmm decomposition upcast the activations and the weight to float32 first."""
    def linear(x, w, b):
        return F.gelu(F.linear(x, w, b))

    args = [torch.randn(2, 3, 8, dtype=dtype, device=device), torch.randn(4, 8, dtype=dtype, device=device),
            torch.randn(4, dtype=dtype, device=device)]
    gm = to_aten_graph(torch.fx.symbolic_trace(linear), args).gm
    [mm] = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    assert all(a.meta["val"].dtype == dtype for a in mm.args)
    assert all(a.target is not aten._to_copy.default for a in mm.args)  # no upcast copies feed it
    atol, rtol = tolerances(dtype)
    check(linear, args, atol=atol, rtol=rtol)


@pytest.mark.parametrize("alpha,beta", [(1, 1), (2.0, 1), (1, 0.5), (1, 0)])
def test_addmm_scalings_and_a_nan_bias_under_beta_zero(alpha, beta):
    bias = torch.randn(3, 5)
    bias[0, 0] = float("nan")  # beta == 0 ignores the bias, NaN included
    args = [bias, torch.randn(3, 4), torch.randn(4, 5)]
    check(lambda b, m1, m2: torch.addmm(b, m1, m2, alpha=alpha, beta=beta), args, atol=1e-5, rtol=1e-5)


def test_integer_addmm_takes_torchs_decomposition():
    args = [torch.randint(-5, 5, (3, 5)), torch.randint(-5, 5, (3, 4)), torch.randint(-5, 5, (4, 5))]
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in args]
        out = addmm(*fake, beta=2, alpha=3)
    assert out.dtype == torch.int64
    check(lambda b, m1, m2: torch.addmm(b, m1, m2, beta=2, alpha=3), args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_with_running_statistics(dtype, device, affine):
    """Nine ops where torch's decomposition records seventeen; the same values as eager's,
    half inputs computed in float32, channels-last inputs included."""
    bn = torch.nn.BatchNorm2d(6, affine=affine).to(device).eval()
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    if affine:
        torch.nn.init.uniform_(bn.weight, 0.5, 1.5)
        torch.nn.init.uniform_(bn.bias, -0.5, 0.5)
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(bn, torch.nn.ReLU()))
    for x in (torch.randn(2, 6, 5, 5, dtype=dtype, device=device),
              torch.randn(2, 6, 5, 5, dtype=dtype, device=device).to(memory_format=torch.channels_last)):
        with torch.no_grad():
            traced = to_aten_graph(gm, [x])
            ops = _ops(traced.gm)
            assert len(ops) <= 12 and "aten.unsqueeze.default" not in ops, ops
            atol, rtol = tolerances(dtype)
            tol = {} if atol is None else {"atol": atol, "rtol": rtol}
            torch.testing.assert_close(traced.gm(x)[0], gm(x), **tol)
            check(gm, [x], atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(4, 3), (4, 3, 5), (2, 3, 4, 5), (2, 3, 2, 3, 2)])
@pytest.mark.parametrize("affine,running", [(True, True), (False, True), (True, False)])
def test_training_batch_norm_and_its_backward_match_torchs_decompositions(device, dtype, shape, affine, running):
    """The batch's statistics, the running statistics' update and the three gradients, as
    torch's decompositions compute them (the same arithmetic in fewer ops), for every rank,
    without weight and bias, without running statistics, and in half precision."""
    from torch._decomp import get_decompositions

    from torchweld.compiler import decompositions

    torch_ = get_decompositions([aten.native_batch_norm.default, aten.native_batch_norm_backward.default])
    c = shape[1]
    x = torch.randn(shape, device=device).to(dtype)
    weight, bias = (torch.rand(c, device=device) + 0.5, torch.randn(c, device=device)) if affine else (None, None)
    stats = (torch.randn(c, device=device), torch.rand(c, device=device) + 0.5) if running else (None, None)
    ours_stats = [s.clone() if s is not None else None for s in stats]
    ours = decompositions.native_batch_norm(x, weight, bias, *ours_stats, True, 0.1, 1e-5)
    expected = torch_[aten.native_batch_norm.default](x, weight, bias, *stats, True, 0.1, 1e-5)
    atol, rtol = tolerances(dtype)
    for got, want in [*zip(ours, expected), *zip(ours_stats, stats)]:
        if want is not None:
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    grad = torch.randn_like(x)
    _, mean, invstd = expected
    for mask in ([True, True, True], [True, False, False]):
        args = (grad, x, weight, *stats, mean, invstd, True, 1e-5, mask)
        for got, want in zip(decompositions.native_batch_norm_backward(*args),
                             torch_[aten.native_batch_norm_backward.default](*args)):
            assert (got is None) == (want is None)
            if want is not None:
                assert got.dtype == want.dtype
                torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_softmax_of_integers_raises_as_eager():
    """aten's softmax kernels refuse integer tensors; the decomposition computed zeros."""
    import torchweld

    for fn in (lambda x: torch.softmax(x, -1), lambda x: torch.log_softmax(x, 0)):
        compiled = torchweld.compile(fn)
        x = torch.randint(-3, 4, (3, 4))
        with pytest.raises(NotImplementedError) as eager:
            fn(x)
        for _ in range(2):
            with pytest.raises(NotImplementedError) as ours:
                compiled(x)
            assert str(ours.value) == str(eager.value)
        y = torch.randn(3, 4)
        torch.testing.assert_close(compiled(y), fn(y))
