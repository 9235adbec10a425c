"""Training through weld: a joint forward+backward graph at the aten level,
partitioned into a forward and a backward graph, run through one autograd.Function."""
from torchweld.autograd.functionalize import FunctionalizationError, functionalize
from torchweld.autograd.joint import JointGraph, module_state, trace_joint
from torchweld.autograd.partition import Partition, partition
from torchweld.autograd.runtime import CompiledGraphFunction, DoubleBackwardError
from torchweld.autograd.training import CompiledTrainingGraph, TrainingUnsupported, compile_training

__all__ = ["CompiledGraphFunction", "CompiledTrainingGraph", "DoubleBackwardError", "FunctionalizationError",
           "JointGraph", "Partition", "TrainingUnsupported", "compile_training", "functionalize",
           "module_state", "partition", "trace_joint"]
