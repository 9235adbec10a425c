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


def brute_force_min_cut(edges, nodes, s, t):
    """The smallest cut over every source side containing s and not t (small graphs)."""
    import itertools

    others = [n for n in nodes if n not in (s, t)]
    best = None
    for bits in itertools.product((0, 1), repeat=len(others)):
        side = {s} | {n for n, b in zip(others, bits) if b}
        value = sum(c for u, v, c in edges if u in side and v not in side)
        best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_random_graphs_match_brute_force_and_the_cut_separates(seed):
    import random

    rng = random.Random(seed)
    nodes = ["s", "t", *range(8)]
    edges = [(u, v, rng.choice([1, 2, 3, 5, 8, INF])) for u in nodes for v in nodes
             if u != v and u != "t" and v != "s" and rng.random() < 0.3]
    g = FlowGraph()
    for u, v, c in edges:
        g.add_edge(u, v, c)
    expected = brute_force_min_cut(edges, nodes, "s", "t")
    if expected == INF:
        with pytest.raises(ValueError):
            g.min_cut("s", "t")
        return
    value, side = g.min_cut("s", "t")
    assert value == expected
    assert "s" in side and "t" not in side
    assert sum(c for u, v, c in edges if u in side and v not in side) == expected  # the side is a min cut
