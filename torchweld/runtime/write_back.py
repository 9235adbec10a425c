"""Write new values into tensors in place with few kernels: one multi-tensor copy
per dtype. torch._foreach_copy_ copies a list in one kernel only when the whole
list shares a dtype and device; a mixed list (batch norm's float running
statistics with its int64 batch counters) falls back to one copy per tensor."""
from __future__ import annotations

from typing import Sequence

import torch


def groups_by_dtype(dtypes: Sequence[torch.dtype]) -> list[list[int]]:
    """Positions of `dtypes`, grouped by dtype, in first-seen order."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        groups.setdefault(dtype, []).append(i)
    return list(groups.values())


class WriteBack:
    """`write(targets, values)`: targets[i].copy_(values[i]) for every i, one
    `_foreach_copy_` per dtype of the targets (fixed when the graph is compiled)."""

    def __init__(self, dtypes: Sequence[torch.dtype]):
        self.groups = groups_by_dtype(dtypes)

    def __call__(self, targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        for group in self.groups:
            if len(group) == 1:
                targets[group[0]].copy_(values[group[0]])
            else:
                torch._foreach_copy_([targets[i] for i in group], [values[i] for i in group])
