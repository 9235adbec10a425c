"""Run a bench script with fields of torchweld's tuning changed, for an A/B of a tuning constant.

    python3 bench/with_constants.py row_block_elements=4096 \
        -- bench/investigations/profile_train_gpu.py --model GPT-2 --skip-eager

Each `name=value` sets that field of `torchweld.tuning.tuning` (torchweld/tuning.py lists them,
with what each means) before the script runs, in this process and in the benchmark workers it
starts (bench/runner.py hands the changes to them in TORCHWELD_BENCH_TUNING); the value is
parsed as the field's type. The script then runs as `__main__` with the
arguments after `--`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import runpy
import sys


def tuning_changes(settings: list[str]) -> dict[str, object]:
    """{field: value} from `name=value` arguments; a name that is not a field, or a value that
    is not of its field's type, exits with an error saying which."""
    from torchweld.tuning import tuning

    known = [f.name for f in dataclasses.fields(tuning)]
    changes = {}
    for setting in settings:
        name, equals, text = setting.partition("=")
        if not equals:
            sys.exit(f"{setting!r}: expected name=value")
        if name not in known:
            sys.exit(f"tuning has no field {name!r}; its fields: {', '.join(known)}")
        kind = type(getattr(tuning, name))
        if kind is bool:  # bool("0") is True
            if text.lower() not in ("0", "1", "false", "true"):
                sys.exit(f"{name}={text}: {name} is bool (0, 1, false, true)")
            changes[name] = text.lower() in ("1", "true")
            continue
        try:
            changes[name] = kind(text)
        except ValueError:
            sys.exit(f"{name}={text}: {name} is {kind.__name__}")
    return changes


def main() -> None:
    if "--" not in sys.argv:
        sys.exit(__doc__)
    split = sys.argv.index("--")
    settings, script_argv = sys.argv[1:split], sys.argv[split + 1:]
    if not script_argv:
        sys.exit(__doc__)
    from torchweld.tuning import tuning

    changes = tuning_changes(settings)
    for name, value in changes.items():
        setattr(tuning, name, value)
        print(f"tuning.{name} = {value!r}", flush=True)
    os.environ["TORCHWELD_BENCH_TUNING"] = json.dumps(changes)  # bench/runner.py's TUNING_VARIABLE
    sys.path.insert(0, os.path.dirname(os.path.abspath(script_argv[0])))
    sys.argv = script_argv
    runpy.run_path(script_argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
