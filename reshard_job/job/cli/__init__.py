"""The Hydra entry point (``python -m reshard_job``): the app (``app``), its task function (``task``),
exit statuses, result.json, one-line errors, the sweep summary."""
