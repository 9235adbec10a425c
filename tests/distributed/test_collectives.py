"""Collectives called inside a compiled function (`dist.all_reduce(y)` in user code): each is
a graph break, run in Python between graphs on every rank in eager's order. In a graph, an
all_reduce whose result nobody reads (it works in place and returns None) was dropped as dead
code: each rank returned its own partial sum, without a word. A rank that recompiles alone (a
guard failing on one rank only) then cannot leave the other waiting inside a graph: no graph
holds a collective. 2 ranks on gloo."""
from __future__ import annotations

import torch
import torch.distributed as dist
from gloo_ranks import on_two_ranks, requires_gloo

import torchweld

pytestmark = requires_gloo

SETTINGS = {"scale": 2.0}


def reduce_then_add(x):
    y = x * SETTINGS["scale"]
    dist.all_reduce(y)
    return y + 1


def broadcast_mean(x):
    y = x.sin()
    dist.broadcast(y, src=0)
    dist.barrier()
    return y * dist.get_world_size() + dist.get_rank()


def _run(rank: int, backend: str) -> dict:
    torchweld.reset()
    differences, counts = [], {}
    for fn in (reduce_then_add, broadcast_mean):
        compiled = torchweld.compile(fn, backend=backend)
        for call, n in enumerate((4, 4, 4, 7)):
            if call == 2 and rank == 1:
                SETTINGS["scale"] = 3.0  # a guard fails on rank 1 alone: it recompiles, rank 0 does not
            x = torch.arange(n, dtype=torch.float32) * (rank + 1)
            got = compiled(x.clone())
            want = fn(x.clone())  # eager, on every rank in the same order
            differences.append((got - want).abs().max().item())
        SETTINGS["scale"] = 2.0
        report = torchweld.explain(fn)(torch.ones(4))
        counts[fn.__name__] = (report.graph_count, [str(r.kind) for r in report.break_reasons],
                               [r.reason for r in report.break_reasons])
    return {"differences": differences, "counts": counts}


def test_collectives_run_between_graphs_on_every_rank():
    for backend in ("eager", "weld"):
        for rank, result in enumerate(on_two_ranks(_run, backend)):
            assert max(result["differences"]) == 0, (backend, rank, result)
            graphs, kinds, reasons = result["counts"]["reduce_then_add"]
            assert graphs == 2 and len(reasons) == 1, result
            assert "all_reduce() communicates with other processes" in reasons[0]
            assert "DISTRIBUTED" in kinds[0]
            graphs, kinds, reasons = result["counts"]["broadcast_mean"]
            assert any("broadcast()" in r for r in reasons) and any("barrier()" in r for r in reasons), reasons


def scaled_by_rank(x):
    return x * (dist.get_rank() + 2)  # the rank is a constant of each rank's graph


def _divergence(rank: int) -> dict:
    import warnings

    torchweld.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = torchweld.compile(reduce_then_add, backend="eager")
        for _ in range(2):
            same(torch.ones(4))
        quiet = [str(w.message) for w in caught if "ranks compiled different graphs" in str(w.message)]
        dist.barrier()  # both ranks' compiles of reduce_then_add are written before either goes on
        apart = torchweld.compile(scaled_by_rank, backend="eager")
        got = apart(torch.ones(3))  # the rank that writes its compile later reads the other's: it warns
    warned = [str(w.message) for w in caught if "ranks compiled different graphs" in str(w.message)]
    return {"quiet": quiet, "warned": warned, "got": got.tolist()}


def test_ranks_that_compile_different_graphs_are_told_which():
    """Ranks whose n-th compiles differ (here a graph with the rank as a constant) are told,
    naming the function, its line and each rank's graph; ranks compiling alike are not."""
    results = on_two_ranks(_divergence)
    for rank, result in enumerate(results):
        assert result["quiet"] == [], result
        assert result["got"] == [float(rank + 2)] * 3
    warned = results[0]["warned"] + results[1]["warned"]
    assert len(warned) >= 1, results
    assert "scaled_by_rank at " in warned[0] and "test_collectives.py" in warned[0], warned
    assert "a graph of 1 ops" in warned[0], warned


def test_graphs_that_differ_only_in_their_rank_device_are_alike():
    """Each rank makes its tensors on its own GPU: graph code naming cuda:0 on one rank and
    cuda:1 on the other is the same compile (no warning on every multi-GPU job)."""
    from torchweld.capture.rank_compiles import describe
    from torchweld.capture.report import TranslationReport

    def on(device):
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        graph.output(graph.call_function(torch.add, (x, graph.call_function(torch.ones, (2,), {"device": device}))))
        gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        return describe(scaled_by_rank.__code__, TranslationReport("f", gm, 2, [], 0.0))

    assert on("cuda:0") == on("cuda:1") and on("cuda:0") != on("cpu")
    assert on(torch.device("cuda", 1)) == on(torch.device("cuda", 3))
