"""Whole torchvision-style models through torchweld.compile(backend="weld"), against
eager, in eval under no_grad: a DenseNet (torch.cat of every earlier feature map)
and a ResNet-50-style bottleneck net. Written out here because torchvision is not
installed; the structure follows torchvision.models.densenet / resnet."""
from __future__ import annotations

import os

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before triton is imported.

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torchweld  # noqa: E402

# =============================================================================
# DenseNet (torchvision.models.densenet, small)
# =============================================================================


class _DenseLayer(nn.Module):
    def __init__(self, num_input_features: int, growth_rate: int, bn_size: int):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, kernel_size=1, stride=1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, kernel_size=3, stride=1, padding=1, bias=False)

    def bn_function(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        concated_features = torch.cat(inputs, 1)
        return self.conv1(self.relu1(self.norm1(concated_features)))

    def forward(self, input) -> torch.Tensor:
        prev_features = [input] if isinstance(input, torch.Tensor) else input
        bottleneck_output = self.bn_function(prev_features)
        return self.conv2(self.relu2(self.norm2(bottleneck_output)))


class _DenseBlock(nn.ModuleDict):
    def __init__(self, num_layers: int, num_input_features: int, bn_size: int, growth_rate: int):
        super().__init__()
        for i in range(num_layers):
            layer = _DenseLayer(num_input_features + i * growth_rate, growth_rate, bn_size)
            self.add_module(f"denselayer{i + 1}", layer)

    def forward(self, init_features: torch.Tensor) -> torch.Tensor:
        features = [init_features]
        for name, layer in self.items():
            new_features = layer(features)
            features.append(new_features)
        return torch.cat(features, 1)


class _Transition(nn.Sequential):
    def __init__(self, num_input_features: int, num_output_features: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(num_input_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(num_input_features, num_output_features, kernel_size=1, stride=1, bias=False)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)


class DenseNet(nn.Module):
    def __init__(self, growth_rate=8, block_config=(3, 4), num_init_features=16, bn_size=2, num_classes=10):
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Conv2d(3, num_init_features, kernel_size=7, stride=2, padding=3, bias=False))
        self.features.add_module("norm0", nn.BatchNorm2d(num_init_features))
        self.features.add_module("relu0", nn.ReLU(inplace=True))
        self.features.add_module("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        num_features = num_init_features
        for i, num_layers in enumerate(block_config):
            block = _DenseBlock(num_layers, num_features, bn_size, growth_rate)
            self.features.add_module(f"denseblock{i + 1}", block)
            num_features = num_features + num_layers * growth_rate
            if i != len(block_config) - 1:
                trans = _Transition(num_features, num_features // 2)
                self.features.add_module(f"transition{i + 1}", trans)
                num_features = num_features // 2
        self.features.add_module("norm5", nn.BatchNorm2d(num_features))
        self.classifier = nn.Linear(num_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.features(x)
        out = F.relu(features, inplace=True)
        out = F.adaptive_avg_pool2d(out, (1, 1))
        out = torch.flatten(out, 1)
        return self.classifier(out)


# =============================================================================
# ResNet with bottlenecks (torchvision.models.resnet, small)
# =============================================================================


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, layers=(1, 2, 1, 1), width=8, num_classes=10):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * Bottleneck.expansion, num_classes)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


# =============================================================================
# Tests
# =============================================================================


def randomize_bn(model: nn.Module) -> nn.Module:
    """Non-trivial running statistics, so folding batch norm into conv is checked for real."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model.eval()


def compile_and_check(model: nn.Module, inputs: list[torch.Tensor], options=None):
    compiled = torchweld.compile(model, backend="weld", options=options)
    with torch.no_grad():
        for x in inputs:
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    return compiled


def test_densenet():
    model = randomize_bn(DenseNet())
    compile_and_check(model, [torch.randn(2, 3, 32, 32), torch.randn(2, 3, 32, 32)])


def test_resnet_bottleneck():
    model = randomize_bn(ResNet())
    compile_and_check(model, [torch.randn(2, 3, 32, 32), torch.randn(2, 3, 32, 32)])


# -- the Triton renderer, through Triton's interpreter on the CPU -------------------


@pytest.fixture
def interpret():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Triton's interpreter on CPU tensors; a CUDA machine runs the real kernels instead")


TRITON = {"cpu_codegen": "triton"}


def test_densenet_triton(interpret):
    model = randomize_bn(DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8))
    compile_and_check(model, [torch.randn(1, 3, 16, 16)], options=TRITON)


def test_resnet_bottleneck_triton(interpret):
    model = randomize_bn(ResNet(layers=(1, 1, 1, 1), width=4))
    compile_and_check(model, [torch.randn(1, 3, 16, 16)], options=TRITON)


def test_triton_convolutions_leave_their_bias_to_the_next_kernel(interpret):
    from weld_helpers import check

    conv = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()).eval()
    c = check(conv, [torch.randn(2, 3, 5, 5)], options=TRITON)
    assert c.externs == ["aten.convolution.default"]
    assert "None, [1, 1], [1, 1]" in c.wrapper_source  # called without its bias
    assert c.wrapper_source.count("_k_kernel") == 1  # bias and ReLU in one kernel
    cpu = check(conv, [torch.randn(2, 3, 5, 5)])
    assert "None, [1, 1]" not in cpu.wrapper_source  # oneDNN adds the bias for free


def test_strides_of_size_one_dims_cost_no_copy():
    from weld_helpers import weld_compile

    c = weld_compile(lambda x: x * 2, [torch.randn(4, 1, 3)])
    odd = torch.randn(4, 3).as_strided((4, 1, 3), (3, 7, 1))  # same elements, another stride for the size-1 dim
    restride = c.fn.__globals__["_restride"]
    assert restride(odd, (4, 1, 3), (3, 3, 1)).data_ptr() == odd.data_ptr()
    torch.testing.assert_close(c(odd), odd * 2)
