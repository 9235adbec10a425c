"""max-autotune: choosing among candidates with a fake timer, the choice cached on
disk, launch candidates, and the tuned Triton path (kernels and the matmul
template) run through Triton's interpreter on the CPU."""
import os

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before triton is imported

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from torchweld import config  # noqa: E402
from torchweld.runtime.autotune import Autotuner, load_choices  # noqa: E402

triton = pytest.importorskip("triton")
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


class FakeTimer:
    """Times from a table keyed by call order; optionally runs what it times."""

    def __init__(self, times=None, run=False):
        self.times, self.run, self.calls = times, run, 0

    def __call__(self, fn):
        if self.run:
            fn()
        self.calls += 1
        return self.times[self.calls - 1] if self.times else 100.0 - self.calls  # later is faster


def weld_compile(fn, inputs, options=None):
    from torchweld.compiler import compile_graph

    with torch.no_grad():
        return compile_graph(torch.fx.symbolic_trace(fn), list(inputs), options)


def check(fn, inputs, options, atol=None, rtol=None):
    compiled = weld_compile(fn, inputs, options)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), fn(*inputs), atol=atol, rtol=rtol)
    return compiled


def never(fn):
    raise AssertionError("timed again: the choice should come from the cache")


def test_fastest_wins_and_is_cached_on_disk(tmp_path):
    path = str(tmp_path / "k.py.tune.json")
    cands = [{"XBLOCK": 64}, {"XBLOCK": 128}, {"XBLOCK": 256}]
    tuner = Autotuner(FakeTimer([3.0, 1.0, 2.0]))
    assert tuner.choose(path, "gpu/k1", cands, run=lambda c: None) == {"XBLOCK": 128}
    assert json.load(open(path)) == {"gpu/k1": {"XBLOCK": 128}}
    # a second process: same file, no timing
    assert Autotuner(never).choose(path, "gpu/k1", cands, run=lambda c: None) == {"XBLOCK": 128}
    # another kernel in the same file is tuned and added
    Autotuner(FakeTimer([1.0, 2.0, 3.0])).choose(path, "gpu/k2", cands, run=lambda c: None)
    assert load_choices(path) == {"gpu/k1": {"XBLOCK": 128}, "gpu/k2": {"XBLOCK": 64}}


def test_a_failing_candidate_loses(tmp_path):
    def timer(fn):
        fn()
        return 1.0

    def run(c):
        if c["XBLOCK"] == 64:
            raise RuntimeError("out of resources")

    tuner = Autotuner(lambda fn: timer(fn))
    assert tuner.choose(str(tmp_path / "t.json"), "k", [{"XBLOCK": 64}, {"XBLOCK": 32}], run) == {"XBLOCK": 32}


def test_stale_cache_entry_is_retuned(tmp_path):
    path = str(tmp_path / "t.json")
    Autotuner(FakeTimer([1.0, 2.0])).choose(path, "k", [{"XBLOCK": 8}, {"XBLOCK": 16}], lambda c: None)
    assert Autotuner(FakeTimer([2.0, 1.0])).choose(path, "k", [{"XBLOCK": 16}, {"XBLOCK": 32}],
                                                   lambda c: None) == {"XBLOCK": 32}


@interpreter
def test_launch_candidates():
    from torchweld.compiler.codegen.triton import block_sizes, launch_candidates, launch_config
    from torchweld.tuning import tuning
    fn = lambda x, y: [x.sin() * 2, x.sum(1), y.sum(1)]  # noqa: E731
    c = weld_compile(fn, [torch.randn(64, 100), torch.randn(4, 5000)], {"cpu_codegen": "triton"})
    for k in c.schedule.kernels():
        cands = launch_candidates(k)
        xblock, rblock = block_sizes(k)
        assert cands[0] == {"XBLOCK": xblock, "RBLOCK": rblock, "num_warps": launch_config(k).get("num_warps", 4)}
        assert 2 <= len(cands) <= 8 and len({tuple(sorted(d.items())) for d in cands}) == len(cands)
        if k.is_reduction and max(k.reduced) <= tuning.max_persistent_rblock:
            assert {d["RBLOCK"] for d in cands} == {rblock}


@interpreter
def test_tuned_triton_graph_matches_eager_and_second_compile_does_not_tune(tmp_path):
    def fn(a, b, x):
        return [torch.relu(a @ b) + 1, torch.softmax(x, -1), (x * 2).sum(0), torch.bmm(a[None], b[None])]

    inputs = [torch.randn(20, 12), torch.randn(12, 24), torch.randn(6, 40)]
    with config.patch(cache_dir=str(tmp_path)):
        timer = FakeTimer(run=True)  # later candidates "faster": non-default configs and the template win
        c = check(fn, inputs, options={"cpu_codegen": "triton", "max_autotune": True, "autotune_timer": timer},
                  atol=1e-4, rtol=1e-4)
        assert timer.calls > 0
        assert c.paths["triton"] and all(os.path.exists(path + ".tune.json") for path in c.paths["triton"])
        assert "num_warps=" in c.wrapper_source
        assert "TritonMatmul" in repr(c.fn.__globals__) or any(
            "TritonMatmul" in type(v).__name__ for v in c.fn.__globals__.values())
        assert len(load_choices(str(tmp_path / "autotune" / "matmul.tune.json"))) == 2  # mm and bmm
        c2 = check(fn, inputs, options={"cpu_codegen": "triton", "max_autotune": True, "autotune_timer": never},
                   atol=1e-4, rtol=1e-4)
        assert c2.wrapper_source == c.wrapper_source


@interpreter
def test_without_max_autotune_nothing_is_tuned(tmp_path):
    with config.patch(cache_dir=str(tmp_path)):
        c = check(lambda a, b: torch.relu(a @ b), [torch.randn(4, 3), torch.randn(3, 5)],
                  options={"cpu_codegen": "triton", "autotune_timer": never})
    assert not any(os.path.exists(path + ".tune.json") for path in c.paths["triton"])
    assert "num_warps" not in c.wrapper_source


cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                          reason="needs CUDA (and not the interpreter)")


@cuda
@pytest.mark.parametrize("mode", ["max-autotune-no-cudagraphs", "max-autotune"])
def test_cuda_max_autotune(mode, tmp_path):
    import torchweld

    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512),
                                torch.nn.Linear(512, 256)).cuda().eval()
    with config.patch(cache_dir=str(tmp_path)), torch.no_grad():
        fast = torchweld.compile(model, backend="weld", mode=mode)
        for _ in range(3):
            x = torch.randn(64, 256, device="cuda")
            torch.testing.assert_close(fast(x), model(x), atol=1e-3, rtol=1e-3)
        assert any(p.name.endswith(".tune.json") for p in (tmp_path / "triton").iterdir())
