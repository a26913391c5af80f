"""``python -m reshard_job`` on a terminal: run under a pseudo-terminal (stdin, stdout and stderr all a
tty, as in an interactive shell), where the progress bars are drawn and log lines go through tqdm."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

LOG_PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]\[reshard_job\]\[INFO\] - ")


def run_in_terminal(cwd: Path, *args: str, rows: int = 40, columns: int = 120, timeout: float = 120) -> tuple[int, str]:
    """Run the app with a pseudo-terminal of `rows` x `columns` as its stdin, stdout and stderr; return
    its exit status and everything it printed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR", "COLUMNS",
                                                             "LINES")}
    proc = subprocess.Popen([sys.executable, "-m", "reshard_job", *args], cwd=cwd, env=env, stdin=slave,
                            stdout=slave, stderr=slave, close_fds=True, start_new_session=True)
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        returncode = proc.wait(timeout=timeout)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return returncode, b"".join(chunks).decode("utf-8", errors="replace")


def test_each_log_line_is_printed_once_beside_the_progress_bars(tmp_path):
    returncode, output = run_in_terminal(tmp_path)
    assert returncode == 0, output
    assert "converting: 100%" in output  # the bar was drawn: log lines went through tqdm
    mentions = [line for line in output.replace("\r", "\n").split("\n") if "converting 4 target rank(s)" in line]
    assert len(mentions) == 1, output
    assert LOG_PREFIX.match(mentions[0]), mentions  # with Hydra's prefix, as every other log line
    assert "Traceback" not in output


def test_a_terminal_that_reports_no_size_still_gets_its_bars(tmp_path):
    """A bare pseudo-terminal (zero rows, zero columns: some CI runners, ``script``) drew blank lines."""
    returncode, output = run_in_terminal(tmp_path, "output.dir=out", rows=0, columns=0)
    assert returncode == 0, output
    assert re.search(r"converting: 100%\|█+\|", output), output
