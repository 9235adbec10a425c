"""Tests of torchweld.tools.profile: per-node times of an FX graph, checked against eager outputs."""
from __future__ import annotations

import json
import operator
import time

import pytest
import torch
import torch.fx
from torch import nn

from torchweld.tools.node_profiler import (
    CpuClock,
    CudaEventClock,
    ProfileError,
    ProfileResult,
    clock_for,
    profile,
)

# -- a small torchvision-style ResNet (BasicBlock), no weights needed ----------------------


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (8, 16), blocks: int = 2, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers, inplanes = [], widths[0]
        for i, planes in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(*[BasicBlock(inplanes if b == 0 else planes, planes, stride if b == 0 else 1) for b in range(blocks)]))
            inplanes = planes
        self.layer1, self.layer2 = layers
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


@pytest.fixture(scope="module")
def resnet() -> nn.Module:
    torch.manual_seed(0)
    model = ResNet().eval()
    for module in model.modules():  # non-trivial batch-norm statistics, so eval mode matters
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def resnet_result(resnet: nn.Module) -> tuple[ProfileResult, torch.Tensor]:
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        return profile(resnet, x, runs=3), x


# -- ResNet --------------------------------------------------------------------------------


def test_resnet_outputs_equal_eager(resnet, resnet_result):
    result, x = resnet_result
    with torch.no_grad():
        torch.testing.assert_close(result.output, resnet(x))
        other = torch.randn(1, 3, 48, 48)  # the traced graph is not tied to one shape
        torch.testing.assert_close(profile(resnet, other, runs=1).output, resnet(other))


def test_resnet_table_lists_every_node_slowest_first(resnet_result):
    result, _ = resnet_result
    graph_nodes = [n for n in result.graph_module.graph.nodes if n.op not in ("placeholder", "output")]
    assert sorted(n.name for n in result.nodes) == sorted(n.name for n in graph_nodes)
    means = [n.mean_s for n in result.nodes]
    assert means == sorted(means, reverse=True)
    assert all(len(n.times_s) == 3 and min(n.times_s) >= 0 for n in result.nodes)
    assert sum(result.share(n) for n in result.nodes) == pytest.approx(1.0)
    assert result.device == "cpu"


def test_resnet_nodes_carry_op_target_and_shape(resnet_result):
    result, _ = resnet_result
    by_name = {n.name: n for n in result.nodes}
    stem = by_name["conv1"]
    assert (stem.op, stem.target, stem.operator, stem.shape) == ("call_module", "conv1", "Conv2d", "[2, 8, 16, 16]")
    assert by_name["flatten"].target == "torch.flatten"
    assert by_name["flatten"].shape == "[2, 16]"
    assert by_name["fc"].shape == "[2, 10]"
    residual_adds = [n for n in result.nodes if n.target == "operator.add"]
    assert len(residual_adds) == 4 and all(n.operator == "add" for n in residual_adds)


def test_resnet_summary_per_operator_type(resnet_result):
    result, _ = resnet_result
    summary = {row.operator: row for row in result.by_operator()}
    # stem conv + 2 per block (4 blocks) + 1 downsample conv
    assert summary["Conv2d"].nodes == 10
    assert summary["BatchNorm2d"].nodes == 10
    assert summary["Linear"].nodes == 1
    assert summary["add"].nodes == 4
    assert sum(row.nodes for row in summary.values()) == len(result.nodes)
    assert sum(row.mean_s for row in summary.values()) == pytest.approx(result.total_s)
    rows = result.by_operator()
    assert [r.mean_s for r in rows] == sorted((r.mean_s for r in rows), reverse=True)


def test_resnet_str_is_a_readable_table(resnet_result):
    result, _ = resnet_result
    text = str(result)
    lines = text.splitlines()
    assert lines[0].startswith(f"torchweld.profile: {len(result.nodes)} nodes, 3 runs on cpu")
    assert lines[1].split() == ["node", "op", "target", "shape", "mean", "(ms)", "share"]
    assert lines[2].split()[0] == result.nodes[0].name  # slowest first
    assert "layer1.0.conv1" in text and "[2, 8, 8, 8]" in text
    assert "per operator type" in text and "BatchNorm2d" in text
    assert len(result.table(top=5).splitlines()) == 2 + 5


def test_resnet_chrome_trace_is_valid_json(resnet_result, tmp_path):
    result, _ = resnet_result
    path = result.export_chrome_trace(tmp_path / "resnet.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    runs = [e for e in complete if e["cat"] == "run"]
    node_events = [e for e in complete if e["cat"] != "run"]
    assert len(runs) == 3
    assert len(node_events) == 3 * len(result.nodes)
    assert all(isinstance(e["ts"], float) and e["dur"] >= 0 for e in complete)
    first = next(e for e in node_events if e["name"] == "conv1" and e["args"]["run"] == 0)
    assert first["args"] == {"op": "call_module", "target": "conv1", "shape": "[2, 8, 16, 16]", "run": 0}
    run0 = runs[0]
    assert all(run0["ts"] <= e["ts"] <= run0["ts"] + run0["dur"] for e in node_events if e["args"]["run"] == 0)
    assert [p.name for p in tmp_path.iterdir()] == ["resnet.json"]  # no temporary file left behind


# -- inputs: GraphModule, function, bad arguments -----------------------------------------------


def test_graph_module_is_profiled_as_is():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(operator.mul, (x, 2))
    graph.output(graph.call_method("relu", (y,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    inp = torch.randn(5)
    result = profile(gm, inp, runs=2)
    assert result.graph_module is gm
    torch.testing.assert_close(result.output, torch.relu(inp * 2))
    assert {(n.name, n.op, n.target, n.operator) for n in result.nodes} == {
        ("mul", "call_function", "operator.mul", "mul"),
        ("relu", "call_method", "relu", "relu"),
    }


def test_aten_graph_names_its_operators():
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x: (x.sin() + 1).sum())(torch.randn(3))
    result = profile(gm, torch.randn(3), runs=1)
    assert {n.target for n in result.nodes} == {"aten.sin.default", "aten.add.Tensor", "aten.sum.default"}
    assert {row.operator for row in result.by_operator()} == {"aten.sin", "aten.add", "aten.sum"}


def test_function_with_tuple_output():
    def fn(x, y):
        return torch.chunk(x + y, 2), x.size(0)

    x, y = torch.randn(4, 3), torch.randn(4, 3)
    result = profile(fn, x, y, runs=2, warmup=0)
    (a, b), n = result.output
    torch.testing.assert_close(torch.cat([a, b]), x + y)
    assert n == 4
    shapes = {node.name: node.shape for node in result.nodes}
    assert shapes["chunk"] == "([2, 3], [2, 3])"


def test_untraceable_model_names_it_and_says_what_to_do():
    class Branchy(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.raises(ProfileError) as info:
        profile(Branchy(), torch.randn(3))
    message = str(info.value)
    assert message.startswith(f"{__file__}:")  # the user's file and line
    assert "cannot trace Branchy: TraceError" in message
    assert "return x if x.sum() > 0 else -x" in message
    assert "pass that GraphModule to profile()" in message


@pytest.mark.parametrize("kwargs", [{"runs": 0}, {"warmup": -1}])
def test_bad_run_counts(kwargs):
    with pytest.raises(ProfileError, match="runs >= 1 and warmup >= 0"):
        profile(lambda x: x + 1, torch.randn(2), **kwargs)


def test_not_callable():
    with pytest.raises(ProfileError, match="not int"):
        profile(3, torch.randn(2))


# -- clocks -----------------------------------------------------------------------------------


def test_cpu_inputs_get_the_cpu_clock():
    assert isinstance(clock_for(nn.Linear(2, 2), [torch.randn(2)]), CpuClock)


class FakeCudaEvent:
    """Stands in for torch.cuda.Event on the CPU: records host time; elapsed_time in ms."""

    created = 0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        FakeCudaEvent.created += 1
        self.time_ns: int | None = None

    def record(self) -> None:
        self.time_ns = time.perf_counter_ns()

    def elapsed_time(self, end: "FakeCudaEvent") -> float:
        assert self.time_ns is not None and end.time_ns is not None, "event read before it was recorded"
        return (end.time_ns - self.time_ns) / 1e6


def test_cuda_event_clock_path_with_a_fake_event():
    synchronized = []
    clock = CudaEventClock(event_type=FakeCudaEvent, synchronize=lambda: synchronized.append(True))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(3, 4)
    FakeCudaEvent.created = 0
    result = profile(model, x, runs=2, warmup=1, clock=clock)
    assert result.device == "cuda"
    assert len(synchronized) == 2  # once per timed run, before reading the events
    assert FakeCudaEvent.created == 2 * 2 * 3  # start and end of 2 nodes, over warmup + 2 runs
    assert all(len(n.times_s) == 2 and min(n.times_s) >= 0 for n in result.nodes)
    torch.testing.assert_close(result.output, model(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_inputs_are_timed_with_events():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU()).cuda()
    x = torch.randn(8, 64, device="cuda")
    assert isinstance(clock_for(model, [x]), CudaEventClock)
    result = profile(model, x, runs=3)
    assert result.device == "cuda" and result.total_s > 0
    torch.testing.assert_close(result.output, model(x))
