"""Minimum s-t cut of a small directed graph with capacities (Dinic: one breadth-first
search per phase layers the residual graph by distance from the source, then paths
along the layers are augmented until none is left; the source side is what the
source still reaches in the final residual graph, the same set for every maximum
flow). A partition's graph has thousands of nodes and hundreds of augmenting
paths; Edmonds-Karp's search per path cost GPT-2's partition 0.9 s."""
from __future__ import annotations

import collections
import math
from typing import Hashable

INF = math.inf


class FlowGraph:
    """Directed edges with capacities; `min_cut(s, t)` returns (cut value, source-side nodes)."""

    def __init__(self) -> None:
        self.capacity: dict[Hashable, dict[Hashable, float]] = collections.defaultdict(dict)

    def add_edge(self, u: Hashable, v: Hashable, capacity: float) -> None:
        self.capacity[u][v] = self.capacity[u].get(v, 0) + capacity
        self.capacity[v].setdefault(u, 0)  # the residual (reverse) edge

    def min_cut(self, source: Hashable, sink: Hashable) -> tuple[float, set]:
        residual = {u: dict(vs) for u, vs in self.capacity.items()}
        total = 0.0
        while True:
            level = _levels(residual, source)
            if sink not in level:
                break
            arcs = {u: list(vs) for u, vs in residual.items()}
            next_arc = dict.fromkeys(residual, 0)
            while True:
                pushed = _augment(residual, level, arcs, next_arc, source, sink)
                if not pushed:
                    break
                total += pushed
        return total, set(_levels(residual, source))


def _levels(residual: dict, source: Hashable) -> dict:
    """Distance from `source` of every node it reaches through edges with capacity left."""
    level = {source: 0}
    queue = collections.deque([source])
    while queue:
        u = queue.popleft()
        for v, cap in residual.get(u, {}).items():
            if cap > 0 and v not in level:
                level[v] = level[u] + 1
                queue.append(v)
    return level


def _augment(residual: dict, level: dict, arcs: dict, next_arc: dict, source: Hashable, sink: Hashable) -> float:
    """Push flow along one source-sink path whose every edge goes one level deeper;
    0 when none is left this phase. `next_arc` skips the edges already found useless
    (a node with none left is dropped from `level`)."""
    path = [source]
    while path:
        u = path[-1]
        if u == sink:
            edges = list(zip(path, path[1:]))
            bottleneck = min(residual[a][b] for a, b in edges)
            if bottleneck == INF:
                raise ValueError("no finite cut separates the source from the sink")
            for a, b in edges:
                residual[a][b] -= bottleneck
                residual[b][a] += bottleneck
            return bottleneck
        neighbors, i, deeper = arcs[u], next_arc[u], level[u] + 1
        while i < len(neighbors) and not (residual[u][neighbors[i]] > 0 and level.get(neighbors[i]) == deeper):
            i += 1
        next_arc[u] = i
        if i < len(neighbors):
            path.append(neighbors[i])
        else:  # a dead end: no path goes through u this phase
            del level[u]
            path.pop()
            if path:
                next_arc[path[-1]] += 1
    return 0.0
