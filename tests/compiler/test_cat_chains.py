"""Concatenations that extend an earlier one read it (compiler/cat_chains.py)."""
import pytest
import torch

import torchweld
from torchweld.compiler.aten_graph import to_aten_graph
from torchweld.compiler.cat_chains import chain_concatenations
from weld_helpers import check

aten = torch.ops.aten


def dense_block(x, w1, w2, w3):
    """A DenseNet block's concatenations: each layer reads all features so far."""
    feats = [x]
    for w in (w1, w2, w3):
        inp = torch.relu(torch.cat(feats, 1) * 0.5)
        feats.append(torch.nn.functional.conv2d(inp, w, padding=1))
    return torch.cat(feats, 1).sigmoid()


def block_inputs():
    return [torch.randn(2, 4, 6, 6), torch.randn(3, 4, 3, 3), torch.randn(3, 7, 3, 3), torch.randn(3, 10, 3, 3)]


def cat_inputs(gm):
    return [[a.name for a in n.args[0]] for n in gm.graph.nodes if n.target is aten.cat.default]


def test_each_concatenation_reads_the_one_before_it():
    aten_graph = to_aten_graph(torch.fx.symbolic_trace(dense_block), block_inputs())
    before = cat_inputs(aten_graph.gm)
    assert [len(c) for c in before] == [1, 2, 3, 4]
    assert chain_concatenations(aten_graph.gm) == 2
    _, first, second, last = [n for n in aten_graph.gm.graph.nodes if n.target is aten.cat.default]
    assert [len(c) for c in cat_inputs(aten_graph.gm)] == [1, 2, 2, 2]
    assert second.args[0][0] is first and last.args[0][0] is second


def test_chained_block_equals_eager_and_its_kernels_read_two_features():
    captured = []
    torchweld.compile(dense_block, backend=lambda gm, example_inputs: captured.append(gm) or gm.forward)(*block_inputs())
    (gm,) = captured
    assert chain_concatenations(gm) == 2  # on the captured graph, as the weld backend does
    c = check(gm, block_inputs())
    # each layer's kernel reads the previous concatenation and the newest feature, not all of them
    assert max(len(k.reads) for k in c.schedule.kernels()) <= 3


@pytest.mark.parametrize("case", ["dim", "dtype", "order", "axis"])
def test_concatenations_that_do_not_extend_one_are_left(case):
    def fn(a, b, c):
        first = torch.cat([a, b], 1)
        if case == "dim":
            second = torch.cat([a, b, c], 0)
        elif case == "dtype":
            second = torch.cat([a, b, c.double()], 1)
        elif case == "axis":  # numpy's spelling of dim, which the rewrite must not drop
            second = torch.cat([a, b, c], axis=1)
        else:
            second = torch.cat([b, a, c], 1)
        return first * 2, second * 3

    inputs = [torch.randn(3, 3) for _ in range(3)]
    captured = []
    torchweld.compile(fn, backend=lambda gm, example_inputs: captured.append(gm) or gm.forward)(*inputs)
    (gm,) = captured
    assert chain_concatenations(gm) == 0
    check(gm, inputs)


def test_the_weld_backend_chains_unless_told_not_to():
    from torchweld.backends.weld import prepare

    for option, lengths in ((True, [1, 2, 2, 2]), (False, [1, 2, 3, 4])):
        captured = []
        torchweld.compile(dense_block, backend=lambda gm, example_inputs: captured.append(gm) or gm.forward)(
            *block_inputs())
        gm = prepare(captured[0], {"chain_concatenations": option, "channels_last": False}, inference=True)
        cats = [n for n in gm.graph.nodes if n.target is torch.cat]
        assert [len(n.args[0]) for n in cats] == lengths
        torchweld.reset()
