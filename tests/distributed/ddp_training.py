"""Training runs under DistributedDataParallel, compiled and eager side by side on each rank,
for the tests of this folder: the same model, data and optimizer steps, the parameters
compared after every step."""
from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchweld
from torchweld.capture.report import collecting


class MLP(nn.Module):
    def __init__(self, unused_layer: bool = False):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.unused = nn.Linear(4, 4) if unused_layer else None

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))

    @staticmethod
    def example(batch: int = 4) -> torch.Tensor:
        return torch.randn(batch, 8)


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.block(self.embed(x)).mean(1))

    @staticmethod
    def example(batch: int = 2) -> torch.Tensor:
        return torch.randn(batch, 5, 8)


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))

    @staticmethod
    def example(batch: int = 2) -> torch.Tensor:
        return torch.randn(batch, 3, 8, 8)


MODELS = {"mlp": MLP, "mlp_unused": lambda: MLP(unused_layer=True), "transformer": TinyTransformer, "convbn": ConvBN}
EXAMPLES = {"mlp": MLP.example, "mlp_unused": MLP.example, "transformer": TinyTransformer.example,
            "convbn": ConvBN.example}


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: `order` 'outer' is torchweld.compile(DDP(model)), 'inner' DDP(torchweld.compile(model)),
    'step' a compiled function computing the loss that calls DDP(model)."""

    order: str = "outer"
    model: str = "mlp"
    backend: str = "eager"
    optimizer: str = "sgd"
    steps: int = 3
    accumulate: int = 1  # micro-batches per step, all but the last under no_sync()
    ddp_options: tuple = ()  # (("find_unused_parameters", True),)
    dynamic: bool | None = None  # torchweld.compile's; True with batches of changing size


@dataclasses.dataclass
class Outcome:
    max_diff_per_step: list  # compiled against eager DDP, on this rank
    rank_spread: float  # largest difference between the ranks' compiled parameters
    graphs: int
    breaks: list  # the reasons of graph breaks and of frames run eagerly


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05) if name == "sgd" else torch.optim.Adam(params, lr=0.01)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train(rank: int, runs: list[Run]) -> list[Outcome]:
    return [_train(rank, run) for run in runs]


def _train(rank: int, run: Run) -> Outcome:
    torchweld.reset()
    torch.manual_seed(0)
    base = MODELS[run.model]()
    eager_model, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    options = dict(run.ddp_options)
    reference = DDP(eager_model, **options)
    if run.order == "outer":
        compiled = torchweld.compile(DDP(compiled_model, **options), backend=run.backend, dynamic=run.dynamic)
    elif run.order == "inner":
        compiled = DDP(torchweld.compile(compiled_model, backend=run.backend, dynamic=run.dynamic), **options)
    else:
        compiled = DDP(compiled_model, **options)
    loss = _loss if run.order != "step" else torchweld.compile(_loss, backend=run.backend, dynamic=run.dynamic)
    optimizers = [_optimizer(run.optimizer, m.parameters()) for m in (eager_model, compiled_model)]
    torch.manual_seed(rank + 1)  # each rank its own data: only the all-reduce keeps them equal
    diffs = []
    with collecting() as reports:
        for step in range(run.steps):
            batch = {"batch": 4 + 2 * step} if run.dynamic else {}
            batches = [EXAMPLES[run.model](**batch) for _ in range(run.accumulate)]
            for model, optimizer in zip((reference, compiled), optimizers):
                for i, x in enumerate(batches):
                    last = i == len(batches) - 1
                    with contextlib.nullcontext() if last else model.no_sync():
                        (loss if model is compiled else _loss)(model, x).backward()
                optimizer.step()
                optimizer.zero_grad()
            diffs.append(float((_params(eager_model) - _params(compiled_model)).abs().max()))
    flat = _params(compiled_model)
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return Outcome(diffs, float((gathered[0] - gathered[1]).abs().max()),
                   graphs=sum(r.graph is not None for r in reports),
                   breaks=[r.break_reason.reason for r in reports if r.break_reason])
