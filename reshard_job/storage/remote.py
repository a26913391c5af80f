"""Object stores (``s3://`` and other fsspec URLs) as a ``Storage``."""

from __future__ import annotations

from .base import StorageError


def remote_storage(url: str, options):
    scheme = url.split("://", 1)[0]
    raise StorageError(f"{url}: {scheme}:// paths are not supported yet")
