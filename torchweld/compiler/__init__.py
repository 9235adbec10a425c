"""The weld compiler: aten graph -> loop IR -> fused kernels -> a Python wrapper.

    compile_graph(gm, example_inputs) -> CompiledGraph (callable)
"""
from torchweld.compiler.driver import CompiledGraph, compile_graph

__all__ = ["CompiledGraph", "compile_graph"]
