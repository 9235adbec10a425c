"""Minimum s-t cut of a small directed graph with capacities (Edmonds-Karp:
augment along shortest residual paths until none is left; the source side is
what the last search still reaches)."""
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
            parent = self._shortest_path(residual, source, sink)
            if parent is None:
                break
            bottleneck, v = INF, sink
            while v != source:
                u = parent[v]
                bottleneck = min(bottleneck, residual[u][v])
                v = u
            if bottleneck == INF:
                raise ValueError("no finite cut separates the source from the sink")
            v = sink
            while v != source:
                u = parent[v]
                residual[u][v] -= bottleneck
                residual[v][u] += bottleneck
                v = u
            total += bottleneck
        return total, self._reachable(residual, source)

    @staticmethod
    def _shortest_path(residual, source, sink) -> dict | None:
        parent = {source: None}
        queue = collections.deque([source])
        while queue:
            u = queue.popleft()
            for v, cap in residual.get(u, {}).items():
                if cap > 0 and v not in parent:
                    parent[v] = u
                    if v == sink:
                        return parent
                    queue.append(v)
        return None

    @staticmethod
    def _reachable(residual, source) -> set:
        seen = {source}
        queue = collections.deque([source])
        while queue:
            u = queue.popleft()
            for v, cap in residual.get(u, {}).items():
                if cap > 0 and v not in seen:
                    seen.add(v)
                    queue.append(v)
        return seen
