"""A development aid: ``RIVULET_CPROFILE=DIR`` runs an engine process under cProfile and writes
``DIR/NAME-PID.prof`` (``python -m pstats`` reads it) when the process stops.

Off (nothing imported, no handler) unless the variable is set. Times are the thread's CPU time
(``time.thread_time``), not the wall clock: on a shared machine a process waiting for a core, or
preempted inside a send that woke its peer, would otherwise charge that wait to whatever it was
doing. cProfile slows every Python call: the file says where a process's CPU goes, not how much.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

PROFILE_DIR_ENV = "RIVULET_CPROFILE"


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


@contextlib.contextmanager
def cprofiled(name: str) -> Iterator[None]:
    """The block under cProfile when ``RIVULET_CPROFILE`` names a directory. A process that would die
    of SIGTERM (none of its own handler) leaves by SystemExit instead, so the file is written."""
    out_dir = os.environ.get(PROFILE_DIR_ENV)
    if not out_dir:
        yield
        return
    import cProfile

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    profile = cProfile.Profile(time.thread_time)
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        with contextlib.suppress(OSError):
            os.makedirs(out_dir, exist_ok=True)
            profile.dump_stats(os.path.join(out_dir, f"{name}-{os.getpid()}.prof"))
