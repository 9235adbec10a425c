"""The benchmark models, defined once: each a `Benchmark` the harness (bench/harness.py) and
the investigations (bench/investigations/) build by name.

A benchmark builds a `Case` for a device and a size: the model, its example inputs, and the
target and loss a training step uses. Sizes are the rows' own (the README's table names
them: resnet50 at batch 32, densenet121 at batch 16 3x128x128, BERT b8 s128, GPT-2 b8 s256);
`quick=True` gives smaller ones for a fast look, and the row's label says which it was.
Weights are random (no downloads): `torch.manual_seed(0)` before building gives every
process the same model and inputs. torchvision and transformers are imported only by the
benchmarks that need them; `available()` says which can be built here.
"""
from __future__ import annotations

import functools

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.models
from tests.models import MLP as TinyMLP  # noqa: E402  (the MLP the tests compile)
from tests.models import Block  # noqa: E402  (the transformer block the tests compile too)

# =============================================================================
# Models of our own
# =============================================================================


def chain(t):
    """The 12-op elementwise chain: transcendental, one read and one write of `t`."""
    for _ in range(2):
        t = torch.sin(t) * 1.5 + 0.5
        t = torch.tanh(t) - torch.exp(-t.abs())
        t = torch.sigmoid(t) * t
    return t


class Chain(nn.Module):
    def forward(self, t):
        return chain(t)


def add_mul_chain(t):
    """Memory-bound: compared with the bandwidth of a copy."""
    return ((t + 1.0) * 2.0 + 3.0) * 0.5


class AddMulChain(nn.Module):
    def forward(self, t):
        return add_mul_chain(t)


def mlp(width: int = 1024, layers: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
                           for _ in range(layers)])


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x):
        return self.body(x)


class LastHidden(nn.Module):
    """A transformers model returning the tensor its output dataclass holds."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).last_hidden_state


# =============================================================================
# Benchmarks: a model, its inputs and its training target, by name
# =============================================================================


def mse(out, target):
    return (out - target).square().mean()


def cross_entropy(out, target):
    return nn.functional.cross_entropy(out, target)


@dataclass
class Case:
    """One built benchmark: call `model(*inputs)`; a training step minimises `loss(out, target)`."""
    label: str  # the row's name: model and sizes, "resnet50 b32"
    model: nn.Module
    inputs: tuple
    target: torch.Tensor | None = None
    loss: Callable = mse

    def to(self, device: str, dtype: torch.dtype = torch.float32) -> "Case":
        """The case on `device`, its parameters and floating inputs in `dtype` (token ids stay integers)."""
        def move(t):
            if t is None:
                return None
            return t.to(device, dtype) if t.is_floating_point() else t.to(device)

        self.model = self.model.to(device, dtype) if dtype != torch.float32 else self.model.to(device)
        self.inputs = tuple(move(t) for t in self.inputs)
        self.target = move(self.target)
        return self


@dataclass(frozen=True)
class Benchmark:
    name: str  # what --only matches
    build: Callable[[str, bool], Case]  # (device, quick) -> the case, on the CPU, float32
    phases: tuple[str, ...] = ("inference", "training")
    needs: str | None = None  # the module it imports: "torchvision", "transformers"
    devices: tuple[str, ...] = ("cpu", "cuda")  # where the default run (no --only) takes it
    aliases: tuple[str, ...] = field(default=())

    def make(self, device: str, quick: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0) -> Case:
        torch.manual_seed(seed)
        return self.build(device, quick).to(device, dtype)


def _chain(device: str, quick: bool) -> Case:
    n = 1 << 20 if quick else (1 << 24 if device == "cuda" else 1 << 22)
    return Case(f"elementwise chain {n >> 20}M", Chain(), (torch.randn(n),))


def _add_mul(device: str, quick: bool) -> Case:
    n = 1 << 22 if quick else 1 << 26
    return Case(f"add/mul chain {n >> 20}M", AddMulChain(), (torch.randn(n),))


def _mlp(device: str, quick: bool) -> Case:
    d = 256 if quick else 1024
    return Case(f"MLP 4x{d} LN+GELU b64", mlp(d), (torch.randn(64, d),), torch.randn(64, d))


def _tiny_mlp(device: str, quick: bool) -> Case:
    return Case("tiny MLP d16 b8", TinyMLP(16), (torch.randn(8, 16),), torch.randn(8, 4))


def _cnn(device: str, quick: bool) -> Case:
    s = 32 if quick else 64
    return Case(f"CNN conv/bn/relu/pool b8 {s}x{s}", CNN(), (torch.randn(8, 3, s, s),),
                torch.randint(0, 10, (8,)), cross_entropy)


def _block(device: str, quick: bool) -> Case:
    b, s = (4, 64) if quick else (8, 128)
    return Case(f"transformer block d256 b{b} s{s}", Block(d=256, heads=8), (torch.randn(b, s, 256),),
                torch.randn(b, s, 256))


def _torchvision(name: str, batch: int, size: int, quick_batch: int):
    def build(device: str, quick: bool) -> Case:
        import torchvision

        b = quick_batch if quick else batch
        model = getattr(torchvision.models, name)()
        return Case(f"{name} b{b}" + ("" if size == 224 else f" {size}x{size}"), model,
                    (torch.randn(b, 3, size, size),), torch.randint(0, 1000, (b,)), cross_entropy)
    return build


def _bert(device: str, quick: bool) -> Case:
    import transformers

    b, s = 8, 128
    model = transformers.BertModel(transformers.BertConfig(**({"num_hidden_layers": 2} if quick else {})))
    return Case(f"BERT b{b} s{s}" + (" 2 layers" if quick else ""), LastHidden(model),
                (torch.randint(0, 30000, (b, s)),), torch.randn(b, s, 768))


def _gpt2(device: str, quick: bool, b: int = 8, s: int = 256) -> Case:
    import transformers

    s = 64 if quick else s
    model = transformers.GPT2Model(transformers.GPT2Config(**({"n_layer": 2} if quick else {})))
    return Case(f"GPT-2 b{b} s{s}" + (" 2 layers" if quick else ""), LastHidden(model),
                (torch.randint(0, 50000, (b, s)),), torch.randn(b, s, 768))


LLAMA_CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)


# TinyLlama-1.1B's shape: 22 layers of width 2048, 4 key/value heads for 32 query heads
LLAMA_1B_CONFIG = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)


def _llama(device: str, quick: bool, config: dict = LLAMA_CONFIG, b: int = 8, s: int = 256,
           name: str = "Llama-style decoder") -> Case:
    """A Llama-style decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU) from
    transformers' LlamaConfig: by default 8 layers of width 1024, 4 key/value heads for 16 query heads."""
    import transformers

    b, s = (2, 64) if quick else (b, s)
    config = dict(config, **({"num_hidden_layers": 2} if quick else {}))
    model = transformers.LlamaModel(transformers.LlamaConfig(**config))
    return Case(f"{name} b{b} s{s}" + (" 2 layers" if quick else ""), LastHidden(model),
                (torch.randint(0, 32000, (b, s)),), torch.randn(b, s, config["hidden_size"]))


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in [
    Benchmark("chain", _chain, phases=("inference",), aliases=("elementwise",)),
    Benchmark("add_mul", _add_mul, phases=("inference",), devices=("cuda",), aliases=("add/mul",)),
    Benchmark("mlp", _mlp, devices=("cpu",)),
    Benchmark("cnn", _cnn, devices=("cpu",)),
    Benchmark("block", _block, devices=("cpu",), aliases=("transformer",)),
    Benchmark("tiny_mlp", _tiny_mlp, devices=()),  # the smoke test's: only when named
    Benchmark("resnet50", _torchvision("resnet50", 32, 224, 8), needs="torchvision", devices=("cuda",)),
    Benchmark("densenet121", _torchvision("densenet121", 16, 128, 4), needs="torchvision", devices=("cuda",),
              aliases=("densenet",)),
    Benchmark("bert", _bert, needs="transformers", devices=("cuda",)),
    Benchmark("gpt2", _gpt2, needs="transformers", devices=("cuda",), aliases=("gpt-2",)),
    Benchmark("llama", _llama, needs="transformers", devices=("cuda",)),
    # issue 49's bfloat16 rows (--dtype amp_bfloat16): only when named
    Benchmark("resnet50_b64", _torchvision("resnet50", 64, 224, 8), needs="torchvision", devices=()),
    Benchmark("gpt2_s1024", functools.partial(_gpt2, s=1024), needs="transformers", devices=()),
    Benchmark("llama_1b", functools.partial(_llama, config=LLAMA_1B_CONFIG, b=4, s=1024, name="Llama 1.1B"),
              needs="transformers", devices=()),
]}


def available(benchmark: Benchmark) -> bool:
    if benchmark.needs is None:
        return True
    try:
        __import__(benchmark.needs)
        return True
    except ImportError:
        return False


def select(only: list[str] | None, device: str, phase: str) -> list[Benchmark]:
    """The benchmarks a run takes: those named in `only` (by name or alias, any case), else
    those whose default devices include `device`; in either case only those with `phase`."""
    if only:
        wanted = {w.lower() for w in only}
        unknown = wanted - {n for b in BENCHMARKS.values() for n in (b.name, *b.aliases)}
        if unknown:
            raise SystemExit(f"unknown benchmark(s) {sorted(unknown)}; known: {', '.join(BENCHMARKS)}")
        chosen = [b for b in BENCHMARKS.values() if wanted & {b.name, *b.aliases}]
    else:
        chosen = [b for b in BENCHMARKS.values() if device in b.devices]
    return [b for b in chosen if phase in b.phases]
