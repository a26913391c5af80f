"""The audit's subcommands, one module per family, each thin over the read side's answers (DVC's
``commands/`` over ``repo/``): a module adds its parsers (``add_parsers``) and maps parsed arguments
to a call of ``queries``, ``trace``, ``verify``, ``graph``, ``compare`` or ``lineage.uses``.

* ``base``     — exit codes, the one-line argument parser, answers, argument types
* ``output``   — printing (control characters shown, not obeyed), a closed pipe, saving a picture
* ``database`` — which database (``--db``, ``$RESHARD_JOB_LINEAGE_URL``, ``runs/lineage.db``), opened read-only
* ``inspect``  — ``runs``, ``show``, ``trace``, ``verify``, ``graph`` (answered in one read session)
* ``export``   — ``openlineage``: recorded runs as OpenLineage run events
* ``compare``  — ``compare`` (reads checkpoints; the database only for a run id)
* ``record``   — ``record``: another program's use of files (the one command that writes a run)
* ``schema``   — ``db current|upgrade``
"""
