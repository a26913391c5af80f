"""The exit status of ``python -m reshard_job``, one meaning each.

0 done; 2 the job refused or failed (bad configuration, bad input, unusable output location, an
I/O or database failure) with one line on stderr naming what is at fault; 1 an internal error (a
bug: the traceback is printed); 130 / 143 interrupted by SIGINT / SIGTERM (rerunning the same
command resumes; ``job.run.signals.Interrupted`` carries that status); 141 stdout closed early
(``| head``), as Unix tools do.
"""

EXIT_ERROR = 2
EXIT_BUG = 1
EXIT_PIPE = 141
EXIT_INTERRUPTED = 130  # by SIGINT (``Interrupted.exit_code`` gives each signal's)
