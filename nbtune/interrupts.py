"""Ctrl-C held back while a piece of work must not be cut in two.

Python raises KeyboardInterrupt at whatever bytecode runs when SIGINT arrives (a cell's
interrupt in a kernel, Ctrl-C in a terminal). Where that would leave a half-written state
(weights written in place; the ranks' steps taken but not yet recorded), the owner holds
Ctrl-C for the block, is told it came, and acts on it once the state is whole.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable


@contextlib.contextmanager
def ctrl_c_held(came: Callable[[], None]):
    """Until the block ends, Ctrl-C calls ``came()`` instead of raising. Main thread only:
    no other thread is sent SIGINT, so elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came())
    try:
        yield
    finally:  # (a handler set outside Python reads as None: Python's own is put back)
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
