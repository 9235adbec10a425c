"""Run a bench script with module constants of torchweld changed, for an A/B of a tuning constant.

    python3 bench/with_constants.py torchweld.compiler.codegen.triton:ROW_BLOCK_ELEMENTS=4096 \
        -- bench/investigations/profile_train_gpu.py --model GPT-2 --skip-eager

Each `module:NAME=value` (an int, a float, or else a string) is set before the script runs, in
this process; the script then runs as `__main__` with the arguments after `--`.
"""
from __future__ import annotations

import importlib
import os
import runpy
import sys


def _value(text: str) -> object:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main() -> None:
    if "--" not in sys.argv:
        sys.exit(__doc__)
    split = sys.argv.index("--")
    settings, script_argv = sys.argv[1:split], sys.argv[split + 1:]
    for setting in settings:
        target, _, text = setting.partition("=")
        module, _, name = target.partition(":")
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            sys.exit(f"{module} has no {name}")
        setattr(mod, name, _value(text))
        print(f"{module}.{name} = {getattr(mod, name)!r}", flush=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script_argv[0])))
    sys.argv = script_argv
    runpy.run_path(script_argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
