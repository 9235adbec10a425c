"""Imports a Ctrl-C cannot cut in half: while torchweld compiles in the main thread, a
SIGINT that arrives during an import is held until that import is done, then raised.

    with imports_finish_first():   # around a compile (capture/convert_frame.translate_frame)
        ...                        # Ctrl-C raises KeyboardInterrupt as ever, but never inside an import

Why: the first compile of a process imports a great deal lazily (torch's fake tensors
pull in sympy, torch's own compiler packages, triton). A KeyboardInterrupt raised in the
middle of such an import leaves its finished submodules in `sys.modules` and their
package half-run and removed; the next import of the package runs it again without
binding those submodules to it, and every later compile fails (`module 'sympy' has no
attribute 'core'`). Holding the interrupt until the import is done leaves every module
whole, and the program is interrupted a moment later, where it would have been.

How: for the duration of the block (and only in the main thread, where Python handles
signals, and only where the SIGINT handler is Python's default) the handler is one that
looks at the interrupted stack: outside importlib it raises KeyboardInterrupt as the
default does; inside, it notes the interrupt, and a watcher thread sends the main thread
a SIGINT again once it has left importlib. A second Ctrl-C while one is held raises at
once. An interrupt still held when the block ends is raised there.
"""
from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
import time
import types
from typing import Iterator

_IMPORT_MACHINERY = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")
_POLL_S = 0.005  # how often the watcher looks whether the held import is done


def importing(frame: types.FrameType | None) -> bool:
    """Whether `frame` or a frame below it runs Python's import machinery."""
    while frame is not None:
        if frame.f_code.co_filename in _IMPORT_MACHINERY:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def imports_finish_first() -> Iterator[None]:
    """Within the block, a SIGINT during an import is raised when the import is done."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield  # another thread (signals reach the main one), a handler of the program's own, or nested
        return
    handler = HeldInterrupt()
    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        still_held = handler.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if still_held:
            raise KeyboardInterrupt


class HeldInterrupt:
    """The SIGINT handler within `imports_finish_first`: KeyboardInterrupt now, or, inside an
    import, once it is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = False  # a SIGINT came during an import and has not been raised yet
        self._resent = False  # the watcher has re-sent it
        self._closed = False  # the block has ended: the watcher sends nothing more

    def __call__(self, signum: int, frame: types.FrameType | None) -> None:
        with self._lock:
            hold = not self._held and importing(frame)
            self._held = hold
        if not hold:  # outside an import, the watcher's re-send, or a second Ctrl-C
            raise KeyboardInterrupt
        threading.Thread(target=self._resend_after_import, daemon=True, name="torchweld-held-interrupt").start()

    def close(self) -> bool:
        """End the hold; whether an interrupt is held that nobody has raised (the caller raises it)."""
        with self._lock:
            self._closed = True
            return self._held and not self._resent

    def _resend_after_import(self) -> None:
        main = threading.main_thread().ident
        while True:
            time.sleep(_POLL_S)
            frame = sys._current_frames().get(main)
            with self._lock:
                if self._closed or not self._held:
                    return
                if not importing(frame):
                    self._resent = True
                    _send_sigint_to(main)
                    return


def _send_sigint_to(thread_id: int) -> None:
    """A SIGINT for the main thread: a real signal where the system has pthread_kill, so that a
    call blocked there (a lock, a wait) is interrupted too; else Python's simulated one."""
    if hasattr(signal, "pthread_kill"):
        signal.pthread_kill(thread_id, signal.SIGINT)
    else:
        _thread.interrupt_main()
