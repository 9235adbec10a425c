"""Pick the fastest of a few launch configurations by timing each on the real
shapes, and remember the choice on disk beside the kernel, so a second process
does not tune again.

    tuner = Autotuner()                      # times with triton.testing.do_bench
    best = tuner.choose(path + ".tune.json", "k3", [{"XBLOCK": 256, "num_warps": 4}, ...],
                        run=lambda cfg: launch(cfg))

The timer is any `timer(fn) -> milliseconds`; tests pass a fake one. A choice is
keyed by the device's name too, so another GPU model tunes afresh.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Callable

log = logging.getLogger("torchweld.autotune")

Timer = Callable[[Callable[[], object]], float]


def do_bench_timer(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40)


def device_name(device) -> str:
    import torch

    if getattr(device, "type", device) == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "_")
    return "cpu"


class Autotuner:
    """Times candidates (`timer`) and keeps choices in JSON files; counts what it timed."""

    def __init__(self, timer: Timer | None = None):
        self.timer = timer or do_bench_timer
        self.timed = 0  # candidates timed, for tests and logs

    def choose(self, cache_path: str, key: str, candidates: list[dict], run: Callable[[dict], object]) -> dict:
        """The fastest of `candidates` (run(config) launches one), from the cache at `cache_path` if there."""
        cached = load_choices(cache_path).get(key)
        if cached is not None and cached in candidates:
            return candidates[candidates.index(cached)]  # the candidate itself: its key order, not JSON's
        if len(candidates) == 1:
            return candidates[0]
        timings = []
        for config in candidates:
            try:
                ms = self.timer(lambda: run(config))
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit loses
                log.debug("%s: %s failed: %s: %s", key, config, type(e).__name__, e)
                ms = math.inf
            self.timed += 1
            timings.append(ms)
        best = min(range(len(candidates)), key=lambda i: timings[i])
        if math.isinf(timings[best]):
            raise RuntimeError(f"autotuning {key}: no candidate ran ({candidates})")
        log.info("%s: chose %s (%.4f ms) of %s", key, candidates[best], timings[best],
                 ", ".join(f"{c} {t:.4f}" for c, t in zip(candidates, timings)))
        save_choice(cache_path, key, candidates[best])
        return candidates[best]


def load_choices(path: str) -> dict:
    """The choices kept at `path`; none where it is missing, unreadable or not a JSON object
    (a damaged file is said once, and replaced by the next choice saved)."""
    try:
        with open(path) as f:
            choices = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _warn_once(path, "torchweld: ignoring the autotuning choices in %s, which cannot be read: %s", path, e)
        return {}
    if not isinstance(choices, dict):
        _warn_once(path, "torchweld: ignoring the autotuning choices in %s: not a JSON object", path)
        return {}
    return choices


def save_choice(path: str, key: str, config: dict) -> None:
    """Add one choice to the JSON file at `path`, atomically (other processes may write too).
    Where the folder refuses the write, the choice is not kept (said once): a later process tunes again."""
    from torchweld.disk_cache import replace_file

    choices = load_choices(path)
    choices[key] = config
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        replace_file(path, json.dumps(choices, indent=1, sort_keys=True).encode())
    except OSError as e:
        _warn_once(path, "torchweld: cannot keep autotuning choices in %s (%s); they are tuned again next time",
                   path, e.strerror or e)


_warned: set[str] = set()  # choice files already warned about


def _warn_once(path: str, message: str, *args: object) -> None:
    if path not in _warned:
        _warned.add(path)
        log.warning(message, *args)


def synthetic_tensor(dtype, layout, device):
    """A tensor with `layout` (shape, stride, offset) to time kernels on: random floats, zero integers
    (zeros are in bounds wherever a kernel uses the values as indices)."""
    import torch

    size = 0 if 0 in layout.shape else layout.offset + 1 + sum((s - 1) * st for s, st in zip(layout.shape, layout.stride))
    flat = torch.randn(size, device=device).to(dtype) if dtype.is_floating_point else \
        torch.zeros(size, dtype=dtype, device=device)
    return flat.as_strided(layout.shape, layout.stride, layout.offset)
