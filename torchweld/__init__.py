"""torchweld: a just-in-time compiler for PyTorch programs.

    fast = torchweld.compile(model)          # or @torchweld.compile on a function
    torchweld.explain(fn)(*args)             # what was captured, where it broke, why
"""
from torchweld import config, logs, timing, tuning
from torchweld.api import CompiledFunction, CompiledModule, compile, disable, reset
from torchweld.backends import list_backends, register_backend
from torchweld.capture.dynamic_dims import mark_dynamic, mark_static
from torchweld.errors import BackendCompilerFailed, InvalidArgument, Unsupported
from torchweld.tools.explain import ExplainOutput, explain
from torchweld.torch_controls import allow_in_graph, graph_break, set_stance

compile_times = timing.compile_times  # where compile time went, per phase: {phase: seconds}, or repr="str"

logs.configure()

__all__ = [
    "BackendCompilerFailed", "CompiledFunction", "CompiledModule", "ExplainOutput", "InvalidArgument",
    "Unsupported", "allow_in_graph", "compile", "compile_times", "config", "disable", "explain", "graph_break",
    "list_backends", "logs", "mark_dynamic", "mark_static", "register_backend", "reset", "set_stance", "tuning",
]
