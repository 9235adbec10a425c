"""The max-flow/min-cut under the recompute partitioner."""
import pytest

from torchweld.autograd.mincut import INF, FlowGraph


def test_classic_cut():
    g = FlowGraph()
    for u, v, c in [("s", "a", 10), ("s", "b", 5), ("a", "b", 15), ("a", "t", 4), ("b", "t", 10), ("b", "a", 3)]:
        g.add_edge(u, v, c)
    value, source_side = g.min_cut("s", "t")
    assert value == 14
    assert source_side == {"s", "a", "b"}


def test_chain_cuts_the_cheapest_edge():
    g = FlowGraph()
    g.add_edge("s", "x", INF)
    g.add_edge("x", "y", 8)
    g.add_edge("y", "z", 2)
    g.add_edge("z", "t", INF)
    value, source_side = g.min_cut("s", "t")
    assert value == 2 and source_side == {"s", "x", "y"}


def test_no_finite_cut_raises():
    g = FlowGraph()
    g.add_edge("s", "t", INF)
    with pytest.raises(ValueError):
        g.min_cut("s", "t")
