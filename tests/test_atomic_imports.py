"""A Ctrl-C during a compile never cuts an import in half (torchweld/atomic_imports.py), so
the calls after an interrupted first compile work. Each scenario sends real SIGINTs to a
process of its own (tests/reliability.py), never to pytest's."""
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import torchweld
from tests.reliability import INTERRUPTED_TRAINING_PROGRAM, environment, run_interrupted
from torchweld.atomic_imports import HeldInterrupt, imports_finish_first

# A module whose body is interrupted (once, or twice) while it is being imported.
MODULE = textwrap.dedent("""
    import signal, time
    STARTED = True
    for _ in range({interrupts}):
        signal.raise_signal(signal.SIGINT)
    time.sleep(0.2)
    DONE = True
""")

# The import, then a wait on a lock (which a held interrupt must cut short, as a real one would).
# The held interrupt is re-sent by a watcher thread, so it may land on any line after the
# import: the script prints only in the handler (a print cut in two failed CI once).
SCRIPT = textwrap.dedent("""
    import importlib, signal, sys, threading, time
    from torchweld.atomic_imports import imports_finish_first

    sys.path.insert(0, sys.argv[1])
    imported = None
    try:
        with imports_finish_first():
            importlib.import_module("interrupted_module")
            imported = time.monotonic()
            threading.Event().wait(20)
        print("never interrupted")
    except KeyboardInterrupt:
        module = sys.modules.get("interrupted_module")
        print("interrupted;", "whole" if getattr(module, "DONE", False) else "half" if module else "absent", end="")
        print("" if imported is None or time.monotonic() - imported < 5 else " (late)")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
""")


def run_script(tmp_path, interrupts: int) -> str:
    (tmp_path / "interrupted_module.py").write_text(MODULE.format(interrupts=interrupts))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=environment(tmp_path / "cache"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_an_interrupt_during_an_import_is_raised_once_the_import_is_done(tmp_path):
    assert run_script(tmp_path, interrupts=1) == "interrupted; whole"


def test_a_second_interrupt_during_the_import_is_raised_at_once(tmp_path):
    """Someone pressing Ctrl-C again does not want to wait."""
    assert run_script(tmp_path, interrupts=2) == "interrupted; absent"


def test_outside_an_import_an_interrupt_is_raised_at_once():
    handler = HeldInterrupt()
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, sys._getframe())
    assert not handler.close()


def test_a_handler_of_the_programs_own_is_left_alone():
    def own(signum, frame):
        pass

    previous = signal.signal(signal.SIGINT, own)
    try:
        with imports_finish_first():
            assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_default_handler_is_back_after_the_block():
    with imports_finish_first():
        assert isinstance(signal.getsignal(signal.SIGINT), HeldInterrupt)
        with imports_finish_first():  # nested: the outer block's hold goes on
            assert isinstance(signal.getsignal(signal.SIGINT), HeldInterrupt)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_capture_compiles_under_the_hold():
    """translate_frame runs under imports_finish_first: a backend sees its handler."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(signal.getsignal(signal.SIGINT))
        return gm.forward

    torchweld.compile(lambda x: x + 1, backend=backend)(torch.ones(1))
    assert isinstance(seen[0], HeldInterrupt)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("delay", [0.1, 0.3, 0.7])
def test_calls_after_an_interrupted_first_compile_work(tmp_path, delay):
    """SIGINT at a few moments of a process's first compile (its lazy imports: torch's fake
    tensors pull in sympy, torch's compiler packages, triton), then the same call and a new
    compile, which must both work."""
    outcome = run_interrupted(tmp_path / "cache", delay)
    assert outcome.ok, outcome.describe()
    assert "interrupted" in outcome.stdout or "compiled before the interrupt" in outcome.stdout


@pytest.mark.parametrize("delay", [0.4, 1.0])
def test_a_training_step_interrupted_while_it_compiles_then_trains_as_eager(tmp_path, delay):
    """SIGINT during a compiled training step's first call (its joint trace, partition, or the
    backward compiled in a thread), then steps from the state it left, against eager's."""
    outcome = run_interrupted(tmp_path / "cache", delay, program=INTERRUPTED_TRAINING_PROGRAM)
    assert outcome.ok, outcome.describe()
