"""`opt.step()` of torch's Adam and AdamW captured into the graph: the update equals
eager's step after step, for the eager and weld backends, and what capture cannot
model (a closure, hooks) runs natively with the reason logged."""
import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn

import torchweld
from tests.capture.helpers import CountingBackend

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SETTINGS = {
    "adam": (torch.optim.Adam, {}),
    "adam-decay-amsgrad": (torch.optim.Adam, {"weight_decay": 0.1, "amsgrad": True}),
    "adamw-maximize": (torch.optim.AdamW, {"weight_decay": 0.05, "maximize": True}),
    "sgd": (torch.optim.SGD, {}),
    "sgd-nesterov-decay": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    # dampening: the first step runs natively (its buffer is the gradient), the later ones compiled
    "sgd-dampening-maximize": (torch.optim.SGD, {"momentum": 0.8, "dampening": 0.1, "maximize": True}),
}


def model_and_groups(cls, settings, device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4)).to(device)
    model[1].weight.requires_grad_(False)  # a parameter without a gradient: Adam skips it
    groups = [{"params": list(model[0].parameters()) + [model[1].weight]},
              {"params": list(model[1:].parameters())[1:], "lr": 3e-3}]
    return model, cls(groups, lr=1e-2, **settings)


def two_copies(cls=torch.optim.Adam, settings=None, device="cpu"):
    """(model, opt) to compile and (reference, opt_ref) to run eagerly, equal at the start."""
    return (*model_and_groups(cls, settings or {}, device), *model_and_groups(cls, settings or {}, device))


def explained_beside_eager(fn, model, opt, reference, opt_ref, x):
    """torchweld.explain(fn) on (model, opt, x), with the same step run eagerly beside it."""
    explained = torchweld.explain(fn)(model, opt, x)
    fn(reference, opt_ref, x)
    return explained


def train_step(model, opt, x):
    opt.zero_grad(True)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss


def assert_same(model, opt, reference, opt_ref):
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        state, expected = opt.state[p], opt_ref.state[q]
        assert state.keys() == expected.keys()
        for key in expected:
            if expected[key] is None:  # SGD without momentum keeps no buffer
                assert state[key] is None
                continue
            torch.testing.assert_close(state[key].cpu(), expected[key].cpu(), atol=1e-5, rtol=1e-5)
        if p.grad is not None:  # SGD's Nesterov step updates the gradients in place
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["eager", "weld"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_captured_step_matches_eager(setting, backend, device):
    model, opt, reference, opt_ref = two_copies(*SETTINGS[setting], device)
    step = torchweld.compile(train_step, backend=backend)
    for _ in range(5):
        x = torch.randn(4, 8, device=device)
        torch.testing.assert_close(step(model, opt, x), train_step(reference, opt_ref, x))
    assert_same(model, opt, reference, opt_ref)
    # the step moved to the parameter's device (Adam's capturable path), as torch.compile moves it
    assert all(s["step"].device == p.device for p, s in opt.state.items() if "step" in s)


def test_step_is_in_the_graph_and_a_new_learning_rate_is_an_input_not_a_recompile():
    model, opt, reference, opt_ref = two_copies()
    explained = explained_beside_eager(train_step, model, opt, reference, opt_ref, torch.randn(4, 8))
    assert not any("step()" in r.source_line for r in explained.break_reasons)
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes]
    assert any("_foreach_addcdiv_" in op for op in ops)
    assert any("type(L['opt'].param_groups[1]['lr']) is float" in g for g in explained.guards)
    assert not any("['lr'] ==" in g for g in explained.guards)
    for backend in (CountingBackend(), "weld"):
        step = torchweld.compile(train_step, backend=backend)
        for i in range(5):
            if i >= 2:
                for o in (opt, opt_ref):
                    o.param_groups[1]["lr"] = 1e-3 * i
            x = torch.randn(4, 8)
            step(model, opt, x)
            train_step(reference, opt_ref, x)
        assert_same(model, opt, reference, opt_ref)
    assert len(step_graphs(CountingBackend, train_step, two_copies()[:2])) == 2  # the forward and the step


def step_graphs(counting_backend, fn, model_and_opt, lrs=(1e-2, 2e-3, 3e-4)):
    """The graphs `fn` compiles over steps with these learning rates on every group."""
    backend = counting_backend()
    step = torchweld.compile(fn, backend=backend)
    model, opt = model_and_opt
    for lr in lrs:
        for group in opt.param_groups:
            group["lr"] = lr
        step(model, opt, torch.randn(4, 8))
    return backend.graphs


def step_and_scaled_lr(model, opt, x):
    opt.zero_grad(True)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss, opt.param_groups[0]["lr"] * 10  # the step's frame computes with it: specialized


def test_a_learning_rate_the_frame_computes_with_is_guarded_on_its_value():
    model, opt, reference, opt_ref = two_copies()
    step = torchweld.compile(step_and_scaled_lr, backend="weld")
    for lr in (1e-2, 2e-3, 2e-3):
        for o in (opt, opt_ref):
            o.param_groups[0]["lr"] = lr
        x = torch.randn(4, 8)
        (loss, scaled), (loss_ref, scaled_ref) = step(model, opt, x), step_and_scaled_lr(reference, opt_ref, x)
        torch.testing.assert_close(loss, loss_ref)
        assert scaled == scaled_ref
    assert_same(model, opt, reference, opt_ref)
    assert len(step_graphs(CountingBackend, step_and_scaled_lr, two_copies()[:2])) == 1 + 3  # a step per rate


SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1 / (1 + n)),
    # changes the rate and beta1 at every step (cycle_momentum)
    "one-cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=20),
}


SCHEDULED = [(schedule, cls, settings) for schedule in SCHEDULERS
             for cls, settings in [(torch.optim.Adam, {}), (torch.optim.AdamW, {"weight_decay": 0.1})]]
SCHEDULED += [("lambda", torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.01}),
              ("one-cycle", torch.optim.SGD, {"momentum": 0.9, "nesterov": True})]  # cycles the momentum too


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("schedule, cls, settings", SCHEDULED, ids=lambda v: getattr(v, "__name__", str(v)))
def test_lr_scheduler_step_is_captured_and_its_rates_need_no_recompile(schedule, cls, settings, device, caplog):
    """An LR scheduler wraps `opt.step` on the instance; the step is still captured, the
    wrapper's `_opt_called` is set (no warning from the scheduler), and each step's new rate
    and betas reach the graph as inputs, which weld compiles (C++ and Triton alike)."""
    model, opt, reference, opt_ref = two_copies(cls, settings, device)
    schedulers = [SCHEDULERS[schedule](o) for o in (opt, opt_ref)]
    backend = CountingBackend()
    compiled_steps = [torchweld.compile(train_step, backend=backend), torchweld.compile(train_step, backend="weld")]
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":  # Triton's interpreter runs on the CPU
        compiled_steps.append(torchweld.compile(train_step, backend="weld", options={"cpu_codegen": "triton"}))
    for compiled in compiled_steps:
        for _ in range(4):
            x = torch.randn(4, 8, device=device)
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*lr_scheduler")
                torch.testing.assert_close(compiled(model, opt, x), train_step(reference, opt_ref, x))
                for scheduler in schedulers:
                    scheduler.step()
        assert_same(model, opt, reference, opt_ref)
    assert opt.param_groups[0]["lr"] == opt_ref.param_groups[0]["lr"] != 1e-2  # eight scheduler steps
    for group, group_ref in zip(opt.param_groups, opt_ref.param_groups):  # betas, momentum alike
        assert {k: v for k, v in group.items() if k != "params"} == {k: v for k, v in group_ref.items() if k != "params"}
    assert len(backend.graphs) == 2  # the forward and the step, compiled once
    assert "cannot compile" not in caplog.text
    ops = [str(n.target) for n in backend.graphs[1].graph.nodes]
    assert any("_foreach_" in op for op in ops)  # the step is in the graph


def test_sgd_first_step_with_dampening_runs_natively_then_compiles():
    """SGD's first step copies the gradient into the momentum buffer; with dampening a zero
    buffer would not give that, so that one step runs natively, and says why."""
    model, opt, reference, opt_ref = two_copies(torch.optim.SGD, {"momentum": 0.9, "dampening": 0.5})
    explained = explained_beside_eager(train_step, model, opt, reference, opt_ref, torch.randn(4, 8))
    assert any("dampening" in r.reason for r in explained.break_reasons)
    explained = explained_beside_eager(train_step, model, opt, reference, opt_ref, torch.randn(4, 8))
    assert not any("step()" in r.source_line for r in explained.break_reasons)
    assert_same(model, opt, reference, opt_ref)


def test_sgd_momentum_is_an_input_until_it_becomes_zero():
    """SGD's momentum is read at each call; whether it is zero decides the update (no
    buffer then), and is guarded: setting it to 0 compiles the plain update, once."""
    model, opt, reference, opt_ref = two_copies(torch.optim.SGD, {"momentum": 0.9, "nesterov": False})
    backend = CountingBackend()
    step = torchweld.compile(train_step, backend=backend)
    for momentum in (0.9, 0.8, 0.7, 0.0, 0.0):
        for o in (opt, opt_ref):
            for group in o.param_groups:
                group["momentum"] = momentum
        x = torch.randn(4, 8)
        torch.testing.assert_close(step(model, opt, x), train_step(reference, opt_ref, x))
    assert_same(model, opt, reference, opt_ref)
    assert len(backend.graphs) == 3  # the forward, the step with momentum, the step without


def closure_step(model, opt, x):
    def closure():
        opt.zero_grad(True)
        loss = model(x).square().mean()
        loss.backward()
        return loss

    return opt.step(closure)


def test_closure_and_hooks_run_natively_and_say_why():
    model, opt, reference, opt_ref = two_copies()
    explained = explained_beside_eager(closure_step, model, opt, reference, opt_ref, torch.randn(4, 8))
    assert any("closure" in r.reason for r in explained.break_reasons)
    calls = []
    for o in (opt, opt_ref):
        o.register_step_pre_hook(lambda *_: calls.append(1))
    explained = explained_beside_eager(train_step, model, opt, reference, opt_ref, torch.randn(4, 8))
    assert any("hooks" in r.reason for r in explained.break_reasons)
    assert len(calls) == 2  # the hook ran for the compiled step as for the eager one
    assert_same(model, opt, reference, opt_ref)


def test_weld_matches_torch_compile():
    """torch.compile captures Adam's step too; both equal eager, and each other."""
    model, opt, anchor, opt_anchor = two_copies(torch.optim.AdamW, {"weight_decay": 0.05})
    step = torchweld.compile(train_step, backend="weld")
    anchor_step = torch.compile(train_step)
    for _ in range(3):
        x = torch.randn(4, 8)
        step(model, opt, x)
        anchor_step(anchor, opt_anchor, x)
    assert_same(model, opt, anchor, opt_anchor)
    assert all(s["step"].device == p.device for p, s in opt_anchor.state.items() if s)


def test_loaded_state_is_read_afresh():
    """load_state_dict replaces the state tensors: the identity guards see it."""
    model, opt, reference, opt_ref = two_copies()
    step = torchweld.compile(train_step, backend="weld")
    for i in range(4):
        x = torch.randn(4, 8)
        step(model, opt, x)
        train_step(reference, opt_ref, x)
        if i == 1:
            saved = opt_ref.state_dict()  # loading may keep its tensors: one copy each
            opt.load_state_dict(copy.deepcopy(saved))
            opt_ref.load_state_dict(copy.deepcopy(saved))
    assert_same(model, opt, reference, opt_ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", ["weld", "cudagraphs"])
def test_captured_step_under_cuda_graphs(backend):
    """The optimizer's graph replays as a CUDA graph: parameters and state are read and
    written in place (the state is resident, by its identity guards), step after step."""
    mode = "reduce-overhead" if backend == "weld" else None
    model, opt, reference, opt_ref = two_copies(torch.optim.Adam, {"weight_decay": 0.1}, "cuda")
    step = torchweld.compile(train_step, backend=backend, mode=mode)
    for _ in range(6):
        x = torch.randn(4, 8, device="cuda")
        torch.testing.assert_close(step(model, opt, x), train_step(reference, opt_ref, x))
    assert_same(model, opt, reference, opt_ref)


def test_scheduled_rates_compile_no_more_graphs_than_torch_compile():
    """torch.compile recompiles the step once the rate changes (then reads it as a
    symbolic float); weld reads it as an input from the first compile."""
    counts = {}
    for name, compiler in (("weld", torchweld.compile), ("torch.compile", torch.compile)):
        torch._dynamo.reset()
        model, opt, _, _ = two_copies()
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1 / (1 + n))
        backend = CountingBackend()
        step = compiler(train_step, backend=backend)
        for _ in range(5):
            step(model, opt, torch.randn(4, 8))
            scheduler.step()
        counts[name] = len(backend.graphs)
    torch._dynamo.reset()
    assert counts["weld"] == 2 and counts["weld"] <= counts["torch.compile"], counts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", ["weld", "cudagraphs"])
def test_scheduled_step_under_cuda_graphs_reads_each_new_rate(backend):
    """The rate and betas a replay reads are the holders' tensors, in place: a scheduler's
    new values, refilled before the replay, reach every step."""
    mode = "reduce-overhead" if backend == "weld" else None
    model, opt, reference, opt_ref = two_copies(torch.optim.AdamW, {"weight_decay": 0.1}, "cuda")
    schedulers = [SCHEDULERS["one-cycle"](o) for o in (opt, opt_ref)]
    step = torchweld.compile(train_step, backend=backend, mode=mode)
    for _ in range(8):
        x = torch.randn(4, 8, device="cuda")
        torch.testing.assert_close(step(model, opt, x), train_step(reference, opt_ref, x))
        for scheduler in schedulers:
            scheduler.step()
    assert_same(model, opt, reference, opt_ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_step_weld_cannot_compile_runs_eagerly_and_right_under_cuda_graphs(monkeypatch, caplog):
    """weld's fallback for a graph it cannot lower (its eager ops) is recorded as a CUDA
    graph too, and must write the parameters and state in place as eager does."""
    import torchweld.compiler as compiler
    from torchweld.compiler.lowering import LoweringError

    real_compile = compiler.compile_graph

    def refusing_the_step(gm, *args, **kwargs):
        if any("_foreach_addcdiv_" in str(n.target) for n in gm.graph.nodes):
            raise LoweringError("refused by the test")
        return real_compile(gm, *args, **kwargs)

    monkeypatch.setattr(compiler, "compile_graph", refusing_the_step)
    model, opt, reference, opt_ref = two_copies(torch.optim.Adam, {"weight_decay": 0.1}, "cuda")
    step = torchweld.compile(train_step, backend="weld", mode="reduce-overhead")
    for _ in range(6):
        x = torch.randn(4, 8, device="cuda")
        torch.testing.assert_close(step(model, opt, x), train_step(reference, opt_ref, x))
    assert_same(model, opt, reference, opt_ref)
    assert "refused by the test" in caplog.text
