"""What the object-storage helpers (ranged reads, multipart uploads, the lease lock) need from
``remote.S3Storage``: named here so they depend on this small interface, not on the class that
uses them (which keeps the storage package free of import circles)."""

from __future__ import annotations

import concurrent.futures
from typing import Any, Protocol


class S3Calls(Protocol):
    @property
    def endpoint(self) -> str | None: ...

    async def client(self) -> Any: ...

    def run(self, coroutine_function, *args, transfer: int = 0) -> Any: ...

    def submit(self, coroutine_function, *args, transfer: int = 0) -> concurrent.futures.Future: ...

    def call_raw(self, operation: str, *, transfer: int | None = None, **params) -> dict: ...

    def call(self, operation: str, url: str, doing: str, *, transfer: int | None = None, **params) -> dict: ...

    def conditional_put(self, bucket: str, folder_key: str, folder_url: str) -> bool: ...
