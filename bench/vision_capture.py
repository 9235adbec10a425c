"""How many graphs capture makes of real vision models built from torchvision's and timm's
constructors (no weights): torchweld's capture against torch.compile's, each with a backend
that only counts the graphs and runs them eagerly, and the output checked against eager's.

    python bench/vision_capture.py [--train] [--record] [model ...]

torchvision and timm load their operators with torch's CUDA build: on this CPU machine, run
it in a CPython 3.12 venv with `pip install torch==2.13.0 torchvision==0.28.0 timm` (the
3.12 venv `make test PYTHON=python3.12 VENV=.venv312` makes has that torch). With --record,
the rows are appended to bench/records/capture.jsonl. With --train, each model is also
captured in training mode (graphs of a training step, `loss(out).backward()` with a mean squared
error to a fixed random target (torchvision's ViT heads start at zero: `out.square()` would
give no gradient), for
both compilers) and one weld-compiled training step (dropout and stochastic depth off, batch 2)
is checked for accuracy: its output and gradients as close to a float64 step as eager's are.
"""
from __future__ import annotations

import copy
import logging
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.transformers_capture import CountingBackend, _same_grad, compare, print_row, report  # noqa: E402
import torchweld  # noqa: E402

TORCHVISION = ["resnet18", "resnet50", "densenet121", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny",
               "vit_b_16", "swin_t", "regnet_y_400mf", "shufflenet_v2_x0_5", "inception_v3", "mnasnet0_5",
               "squeezenet1_0", "googlenet", "maxvit_t"]
TIMM = ["resnet18d", "efficientnet_b0", "vit_tiny_patch16_224", "convnext_atto", "mobilevitv2_050", "deit_tiny_patch16_224"]


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    if name.startswith("timm:"):
        import timm

        model = timm.create_model(name[len("timm:"):], pretrained=False)
    else:
        import torchvision

        kwargs = {"aux_logits": False, "init_weights": False} if name in ("inception_v3", "googlenet") else {}
        model = getattr(torchvision.models, name)(weights=None, **kwargs)
    size = 299 if name == "inception_v3" else 224
    return model.eval(), torch.randn(1, 3, size, size)


def _without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Dropout, stochastic depth and drop-path off: weld's random numbers are not eager's."""
    for module in model.modules():
        for key, value in list(vars(module).items()):
            if isinstance(value, float) and ("drop" in key.lower() or key == "p"):
                setattr(module, key, 0.0)
    return model


def train_row(name: str) -> dict:
    """Graphs of a training step for both compilers (counting backends), and one weld-compiled
    step's output and gradients against eager's."""
    torch.manual_seed(0)
    model, x = build(name)
    model, x = _without_dropout(model.train()), torch.randn(2, *x.shape[1:], generator=torch.Generator().manual_seed(1))
    target = torch.randn(2, 1000, generator=torch.Generator().manual_seed(2))
    loss = lambda out: (out - target.to(out.dtype)).square().mean()  # noqa: E731
    ours, theirs = CountingBackend(), CountingBackend()
    loss(torchweld.compile(model, backend=ours)(x)).backward()
    torch._dynamo.reset()
    loss(torch.compile(model, backend=theirs)(x)).backward()
    model.zero_grad(set_to_none=True)
    results = []
    for run in (torchweld.compile(model), model):
        out = run(x)
        loss(out).backward()
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    (got, got_grads), (expected, expected_grads) = results
    reference, accuracy = _float64_step(model, x, loss), {}
    matches = _as_accurate(got, got_grads, expected, expected_grads, reference, accuracy)
    return {"train_torchweld_graphs": len(ours.graphs), "train_torch_compile_graphs": len(theirs.graphs),
            "train_step_matches": matches, **accuracy}


def _float64_step(model: torch.nn.Module, x: torch.Tensor, loss) -> tuple[torch.Tensor, dict]:
    """The same step in float64: the reference both float32 runs are measured against."""
    model64 = copy.deepcopy(model).double()
    out = model64(x.double())
    loss(out).backward()
    return out.detach(), {n: p.grad for n, p in model64.named_parameters()}


def _as_accurate(got, got_grads, expected, expected_grads, reference, accuracy: dict) -> bool:
    """weld's output and gradients as close to the float64 step as eager's: each compiler's
    error is the norm of its difference from float64 over the output, and over all gradients
    together, relative to float64's norm; weld's within twice eager's (or 1e-5). Not per tensor,
    nor against eager itself: batch norm at batch 2 makes the last blocks' gradients
    ill-conditioned (resnet50's are 20% off float64 in eager itself), and a ReLU whose input is
    zero up to rounding passes or stops a gradient as the compiler's rounding falls, so one
    small gradient alone can differ by 10% in either compiler."""
    ref_out, ref_grads = reference
    names = [n for n, r in ref_grads.items() if r is not None]
    for name in ref_grads:
        if name not in names and not _same_grad(got_grads[name], expected_grads[name]):
            return False
    if any(got_grads[n] is None or expected_grads[n] is None for n in names):
        return False

    def relative(diff: torch.Tensor, ref: torch.Tensor) -> float:  # absolute where the reference is all zeros
        return (diff.norm() / ref.norm()).item() if ref.norm() > 0 else diff.norm().item()

    def error(out, grads) -> tuple[float, float]:
        flat = torch.cat([grads[n].double().flatten() for n in names])
        ref = torch.cat([ref_grads[n].flatten() for n in names])
        return relative(out.double() - ref_out, ref_out), relative(flat - ref, ref)

    ours, eagers = error(got, got_grads), error(expected, expected_grads)
    accuracy.update(weld_grad_error=round(ours[1], 8), eager_grad_error=round(eagers[1], 8))
    return all(o <= max(2 * e, 1e-5) for o, e in zip(ours, eagers))


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or [*TORCHVISION, *(f"timm:{n}" for n in TIMM)]
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    print(f"{'model':28s} {'weld graphs':>11s} {'tc graphs':>9s} {'weld capture s':>14s}  matches eager")
    rows = []
    for name in names:
        torch.manual_seed(0)
        model, x = build(name)
        row = compare(name, model, x)
        extra = ""
        if "--train" in sys.argv:
            row |= train_row(name)
            extra = (f"  train graphs {row['train_torchweld_graphs']} / {row['train_torch_compile_graphs']}, "
                     f"weld step as accurate as eager: {row['train_step_matches']} (gradient error from float64: "
                     f"weld {row.get('weld_grad_error', float('nan')):.1e}, eager {row.get('eager_grad_error', float('nan')):.1e})")
        rows.append(row)
        print_row(row, extra)
    report(rows, "models", "vision")


if __name__ == "__main__":
    main()
