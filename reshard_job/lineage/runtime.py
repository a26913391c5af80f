"""Who and where a run executes: host name, process id, user, and whether a process lives.

A run's (host, pid) pair is what lets a later job decide that a run still marked "started" was
killed: on the same host, a pid that no longer exists cannot finish its run. Runs of other hosts
are never judged, since their processes cannot be seen from here. A recycled pid makes a dead
run look alive, which errs on the safe side (it stays "started", it is never wrongly abandoned).
"""

from __future__ import annotations

import getpass
import os
import socket


def current_host() -> str:
    return socket.gethostname()


def current_pid() -> int:
    return os.getpid()


def current_user() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no LOGNAME/USER (some containers)
        return None


def pid_is_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (signal 0 probes without sending)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but belongs to someone else
        return True
    except OSError:
        return False
    return _not_a_zombie(pid)


def _not_a_zombie(pid: int) -> bool:
    # A killed child that its parent has not reaped yet still answers signal 0; it will never
    # finish its run either.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state != b"Z"
