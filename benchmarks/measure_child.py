"""Run a command and write its wall time and rusage (from ``os.wait4`` on it) as JSON.

    python -S benchmarks/measure_child.py RESULT.json -- CMD [ARGS...]

Why a separate small process: a child's ``ru_maxrss`` counts the memory of the process it was
forked from until it calls exec (Linux keeps the high-water mark across exec). Forked from the
runner, which holds numpy and verification buffers, every child would report at least the
runner's size. Forked from this interpreter started with ``-S`` and importing only built-in
modules, the floor is a few MiB, below any Python child's own footprint.
"""

import json
import os
import sys
import time


def main(argv):
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write(__doc__)
        return 2
    result_path, cmd = argv[0], argv[2:]
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(cmd[0], cmd)
        finally:
            os._exit(127)
    _, status, ru = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    with open(result_path, "w") as f:
        json.dump({"wall_s": wall, "rc": rc, "maxrss_kib": ru.ru_maxrss, "user_s": ru.ru_utime,
                   "sys_s": ru.ru_stime, "majflt": ru.ru_majflt, "inblock": ru.ru_inblock,
                   "oublock": ru.ru_oublock}, f)
    return 0 if rc == 0 else (rc if rc > 0 else 128 - rc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
