"""Tools around the compiler: explain, the per-node profiler, TraceDiff.

TraceDiff loads on first use, so `import torchweld` needs neither pandas nor
matplotlib.
"""
from torchweld.tools.explain import ExplainOutput, explain
from torchweld.tools.node_profiler import ProfileResult, profile

_TRACE_DIFF_NAMES = ("TraceDiff", "compare_traces", "ops_diff", "visualize_counts_diff", "visualize_duration_diff")


def __getattr__(name: str):
    if name in _TRACE_DIFF_NAMES:
        from torchweld.tools import trace_diff

        return getattr(trace_diff, name)
    raise AttributeError(f"module 'torchweld.tools' has no attribute {name!r}")


__all__ = ["ExplainOutput", "ProfileResult", "explain", "profile", *_TRACE_DIFF_NAMES]
