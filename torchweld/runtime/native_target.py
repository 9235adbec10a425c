"""What `-march=native` means on this machine, asked of the C++ compiler once per
process. CPU kernels are built with `-march=native`, so their cache key holds the
CPU it resolved to (the -march, -mtune and each -m feature flag the compiler chose):
a cache shared between machines never hands one CPU's kernels to another (SIGILL)."""
from __future__ import annotations

import functools
import logging
import os
import platform
import shlex
import subprocess

log = logging.getLogger("torchweld.cache")


@functools.cache
def native_target(compiler: str) -> str:
    """The CPU target `compiler -march=native` resolves to here, with the compiler's version:
    gcc's `-march=znver3 -mavx2 -mno-avx512f ...`, clang's `-target-cpu znver3 -target-feature +avx2 ...`.
    Where the compiler cannot say, the machine and /proc/cpuinfo's model and flags (one warning)."""
    command = [compiler, "-march=native", "-E", "-v", "-x", "c++", os.devnull, "-o", os.devnull]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return _from_cpuinfo(f"{compiler} cannot be run ({e})", warn=False)  # building will say so
    flags = resolved_flags(proc.stderr)
    if proc.returncode != 0 or not flags:
        return _from_cpuinfo(f"`{' '.join(command)}` did not show what -march=native resolves to", warn=True)
    version = next((line.strip() for line in proc.stderr.splitlines() if " version " in line), "")
    return " ".join([platform.machine(), version, *flags])


def resolved_flags(verbose_output: str) -> list[str]:
    """The target flags in the compiler proper's command line of `cc -march=native -E -v`:
    gcc's `cc1plus ... -march=znver3 -mmmx ... -mtune=znver3`, clang's `-cc1 ... -target-cpu
    znver3 -target-feature +sse ...`. Empty where no such line is found."""
    for line in verbose_output.splitlines():
        if not (("cc1" in line and "-march=" in line) or "-target-cpu" in line):
            continue
        try:
            tokens = shlex.split(line)
        except ValueError:
            tokens = line.split()
        flags, keep_next = [], False
        for token in tokens:
            if keep_next:
                flags.append(token)
                keep_next = False
            elif token in ("-target-cpu", "-target-feature"):
                flags.append(token)
                keep_next = True
            elif token.startswith("-m") and not token.startswith("-mllvm"):
                flags.append(token)
        if flags:
            return flags
    return []


def _from_cpuinfo(why: str, warn: bool) -> str:
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "cpu model", "Processor") and not model:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    if warn:
        log.warning("torchweld: %s; CPU kernels are keyed by /proc/cpuinfo's model and flags instead", why)
    return " ".join(filter(None, [platform.machine(), model, flags]))
