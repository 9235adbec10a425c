"""Batch norm's example values made without a fake run (capture/module_fakes.py) equal a fake run's."""
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

import torchweld
from torchweld.capture.module_fakes import batch_norm_example
from torchweld.fake_tensors import fake_copy


def fake_run(mode, module, x, grad):
    state = {n: fake_copy(mode, t) for n, t in [*module.named_parameters(), *module.named_buffers()]}
    with mode, torch.set_grad_enabled(grad), _reparametrize_module(module, state):
        return module(x)


CASES = [
    (nn.BatchNorm2d(8), lambda: torch.randn(4, 8, 5, 6)),
    (nn.BatchNorm2d(8), lambda: torch.randn(4, 8, 5, 6).to(memory_format=torch.channels_last)),
    (nn.BatchNorm1d(8), lambda: torch.randn(4, 8)),
    (nn.BatchNorm1d(8), lambda: torch.randn(4, 8, 7)),
    (nn.BatchNorm3d(8), lambda: torch.randn(2, 8, 3, 4, 5).to(memory_format=torch.channels_last_3d)),
]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("device", DEVICES)  # CUDA's batch norm is cuDNN's, with a fake rule of its own
def test_example_is_what_a_fake_run_gives(case, training, grad, device):
    module, make = CASES[case]
    module.train(training).to(device)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    x = fake_copy(mode, make().to(device).requires_grad_(grad))
    expected = fake_run(mode, module, x, grad)
    with mode:
        got = batch_norm_example(module, [x], {}, grad)
    assert got is not None
    assert (got.shape, got.stride(), got.dtype, got.device, got.requires_grad) == \
        (expected.shape, expected.stride(), expected.dtype, expected.device, expected.requires_grad)
    assert got.requires_grad == (got.grad_fn is not None)  # not a leaf: in-place ops after it are allowed


def test_unusual_calls_run_on_fakes():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    bn = nn.BatchNorm2d(8)
    with mode:
        fake = lambda t: fake_copy(mode, t)  # noqa: E731
        assert batch_norm_example(bn, [fake(torch.randn(4, 7, 5, 5))], {}, True) is None  # wrong channels
        assert batch_norm_example(bn, [fake(torch.randn(4, 8, 5, 5)[:, :, ::2])], {}, True) is None  # strided
        assert batch_norm_example(bn, [fake(torch.randn(1, 8, 1, 1))], {}, True) is None  # one value per channel
        assert batch_norm_example(bn, [fake(torch.randn(4, 8, 5, 5).double())], {}, True) is None  # dtypes differ
        assert batch_norm_example(bn, [fake(torch.randn(4, 8, 5, 5))], {}, True) is None  # params need grad, x not

        class Shifted(nn.BatchNorm2d):
            def forward(self, x):
                return super().forward(x) + 1

        assert batch_norm_example(Shifted(8), [fake(torch.randn(4, 8, 5, 5))], {}, False) is None


def test_compiled_densenet_layer_with_in_place_relu_trains_like_eager():
    """BN then ReLU(inplace=True): the example from a clone must take the in-place op, as eager's result does."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.BatchNorm2d(6), nn.ReLU(inplace=True), nn.Conv2d(6, 4, 3, padding=1))
    x = torch.randn(2, 6, 8, 8, requires_grad=True)
    expected = layer(x)
    expected.sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    x.grad = None
    got = torchweld.compile(layer, backend="eager")(x)
    got.sum().backward()
    torch.testing.assert_close(got, expected)
    for a, b in zip([p.grad for p in layer.parameters()] + [x.grad], grads):
        torch.testing.assert_close(a, b)
