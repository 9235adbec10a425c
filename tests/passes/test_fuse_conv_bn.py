"""Folding eval-mode BatchNorm into the Conv before it."""
import pytest
import torch
import torch.nn as nn

from torchweld.passes.fuse_conv_bn import fuse_conv_bn


@pytest.mark.parametrize("conv,bn,shape", [(nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), (2, 3, 9)),
                                           (nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), (2, 3, 7, 7)),
                                           (nn.Conv3d(2, 4, 2), nn.BatchNorm3d(4, affine=False), (1, 2, 4, 4, 4))])
def test_folds_and_matches_eager(conv, bn, shape):
    model = nn.Sequential(conv, bn, nn.ReLU()).eval()
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    x = torch.randn(shape)
    fused = fuse_conv_bn(model)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fused.modules() if m is not bn)
    assert "1" not in [n.target for n in fused.graph.nodes if n.op == "call_module"]
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model[0].weight, conv.weight)  # the original is untouched


def test_training_bn_and_shared_conv_are_left_alone():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))  # training mode
    gm = fuse_conv_bn(model)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["0", "1"]


def test_live_folding_follows_parameter_updates():
    """live=True computes the folded weights in the graph on each call, so in-place updates
    of the conv's weights or the batch norm's statistics after folding are seen."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    gm = fuse_conv_bn(model, live=True)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["2"]
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
        model[1].running_mean.add_(0.5)
        model[0].weight.mul_(2)
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("freeze", [False, True])
def test_weld_inference_sees_updated_weights(freeze):
    """Frozen (folded, hoisted) or not, in-place updates of parameters and buffers after
    compiling give eager's results: frozen constants are recomputed when a version changes."""
    import torchweld
    from tests.models import CNN

    model, x = CNN().eval(), torch.randn(2, 3, 12, 12)
    compiled = torchweld.compile(model, options={"freeze": freeze})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
        model.body[1].running_var.mul_(3)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
        model.body[0].weight.mul_(2)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
        model.load_state_dict(CNN().state_dict())
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
