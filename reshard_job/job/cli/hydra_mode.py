"""Composing the configuration once instead of twice: a patch of Hydra's private ``Hydra.get_mode``.

Hydra 1.3 composes the whole configuration twice: once only to read ``hydra.mode`` (RUN or
MULTIRUN), then for the run. Our configuration never sets ``hydra.mode``, so unless the command
line does, the answer is known without composing (None: Hydra then picks RUN, or MULTIRUN for
``-m``) — a quarter of the start-up time of ``job.mode=plan``.

Hydra offers no public way to skip that first composition: ``hydra.main`` calls
``hydra._internal.utils._run_hydra``, which always calls ``Hydra.get_mode`` before ``_run_app``;
there is no option, callback (callbacks start after composing) or config key that short-cuts it,
and the public Compose API (``hydra.compose``) gives up the run directory, logging, sweeps and
``--help`` that the app is built on. So the private method is replaced, here and nowhere else, and
only where it exists in the form known (Hydra 1.3); any other Hydra layout composes twice, as
Hydra itself does.
"""

from __future__ import annotations


def skip_mode_composition() -> None:
    """Answer Hydra's ``get_mode`` without composing unless the command line mentions ``hydra.mode``."""
    try:
        from hydra._internal.hydra import Hydra
    except ImportError:  # another Hydra layout: compose twice, as Hydra does
        return
    original = getattr(Hydra, "get_mode", None)
    if original is None or getattr(original, "_reshard_job", False):
        return

    def get_mode(self, config_name, overrides):
        if config_name != "config" or any("hydra.mode" in o or o.lstrip("~+").startswith("hydra") and "mode" in o
                                          for o in overrides):
            return original(self, config_name=config_name, overrides=overrides)
        return None

    get_mode._reshard_job = True
    Hydra.get_mode = get_mode
