"""torchweld's own decompositions, in place of torch._decomp's (aten_graph.DECOMPOSITIONS
takes these over them); each falls back to torch's outside the cases it covers.

`addmm`: torch's decomposition casts every operand to float32 for a half-precision addmm
(`pw_cast_for_opmath`), so a float16 or bfloat16 Linear's matrix product ran in float32 on
upcast copies of the activations and the weight. Here the product stays in the matrices'
dtype, as aten's addmm computes it; the bias add after it is a pointwise op (weld computes
it in float32 and rounds once more, where aten rounds once), and where the sum is stored
whole weld folds the two back into one aten.addmm (lowering.fold_addmm). It also leaves out
the two multiplications by 1 torch's traces for alpha and beta: a 12-layer GPT-2's aten graph
traced in 0.38-0.40 s instead of 0.46 on the development CPU.
"""
from __future__ import annotations

import torch
from torch._decomp import get_decompositions

aten = torch.ops.aten

_TORCH = get_decompositions([aten.addmm.default])


def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    if not (self.is_floating_point() and mat1.is_floating_point()) or self.dtype != mat1.dtype:
        return _TORCH[aten.addmm.default](self, mat1, mat2, beta=beta, alpha=alpha)
    out = aten.mm.default(mat1, mat2)
    if alpha != 1:
        out = aten.mul.Tensor(out, alpha)
    if beta == 0:
        return out  # aten ignores `self` then, NaNs included
    return aten.add.Tensor(out, self if beta == 1 else aten.mul.Tensor(self, beta))


OWN = {aten.addmm.default: addmm}
