"""The caching allocator's rounding at Adam's peak in a training row of bench/investigations/compare.py.

    python3 bench/investigations/adam_rounding.py BERT weld      (then `... BERT tc`: one compiler per process)

Three steps, then a fourth in which the moment just before Adam's `_foreach_addcdiv_` (every
parameter's temporary alive: where BERT's step peaks) is captured with
`torch.cuda.memory_snapshot()`. It prints the bytes the live blocks hold beyond what their
tensors asked for, by requested size: a free block less than 1 MiB larger than a request is
handed out whole, so a 2.25 MiB tensor placed in a 3 MiB block holds 0.75 MiB more. Then the
free blocks and the segments at that moment.
"""
from __future__ import annotations

import argparse
import collections
import copy

import torch

import torchweld
from compare import training_cases

MiB = 2 ** 20


def snapshot_at_adams_peak(compiled, opt, loss_fn, x, y) -> tuple[list, dict[int, str]]:
    """The allocator's segments at that moment, and what each known tensor's address holds then
    (parameter, gradient, Adam's exp_avg or exp_avg_sq; anything else is a temporary)."""
    taken = []
    real = torch._foreach_addcdiv_

    def spy(*args, **kwargs):
        taken.append((torch.cuda.memory_snapshot(), _roles(opt)))
        return real(*args, **kwargs)

    for _ in range(3):
        _step(compiled, opt, loss_fn, x, y)
    torch._foreach_addcdiv_ = spy
    try:
        _step(compiled, opt, loss_fn, x, y)
    finally:
        torch._foreach_addcdiv_ = real
    return taken[0]


def _roles(opt) -> dict[int, str]:
    roles = {}
    for group in opt.param_groups:
        for p in group["params"]:
            roles[p.data_ptr()] = "parameter"
            if p.grad is not None:
                roles[p.grad.data_ptr()] = "gradient"
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    roles[value.data_ptr()] = key
    return roles


def _step(compiled, opt, loss_fn, x, y) -> None:
    opt.zero_grad(True)
    loss_fn(compiled(x), y).backward()
    opt.step()


def report(segments: list, roles: dict[int, str]) -> None:
    held = collections.Counter()
    count = collections.Counter()
    free = collections.Counter()
    rounded = collections.Counter()  # what the tensors that hold a block 0.5 MiB or more beyond their request are
    for segment in segments:
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                asked = block["requested_size"]
                key = f"{asked / MiB:.2f} MiB" if asked >= MiB else "under 1 MiB"
                held[key] += block["size"] - asked
                count[key] += 1
                if block["size"] - asked >= MiB // 2:
                    rounded[(key, roles.get(address, "a temporary (or the other copy's)"))] += 1
            elif block["state"] == "inactive":
                free[round(block["size"] / MiB, 2)] += 1
            address += block["size"]
    print(f"held beyond the requests: {sum(held.values()) / MiB:.1f} MiB")
    for key, extra in held.most_common(8):
        print(f"  tensors of {key} x{count[key]}: {extra / MiB:.1f} MiB")
    print("tensors holding 0.5 MiB or more beyond their request, by size and what they are:")
    for (key, role), n in rounded.most_common(12):
        print(f"  {key} {role}: {n}")
    print("free blocks, MiB x count (largest 12):", sorted(free.items(), reverse=True)[:12])
    sizes = collections.Counter(round(s["total_size"] / MiB) for s in segments)
    print(f"{len(segments)} segments, MiB x count:", sizes.most_common(8))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", help="first word of a compare.py training row, e.g. BERT")
    parser.add_argument("compiler", choices=["eager", "weld", "tc"])
    args = parser.parse_args()
    [(row, make_model, make_batch, loss_fn)] = [r for r in training_cases(False, "cuda")
                                                if r[0].split()[0] == args.case]
    torch.manual_seed(0)
    base = make_model().cuda().train()  # as compare.py: the variant trains a copy
    x, y = (t.cuda() for t in make_batch())
    model = copy.deepcopy(base)
    compiled = {"eager": lambda m: m, "weld": lambda m: torchweld.compile(m, backend="weld"),
                "tc": torch.compile}[args.compiler](model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.cuda.empty_cache()
    print(f"{row}, {args.compiler}: the caching allocator at Adam's peak of the fourth step")
    report(*snapshot_at_adams_peak(compiled, opt, loss_fn, x, y))


if __name__ == "__main__":
    main()
