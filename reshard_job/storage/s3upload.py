"""Writing an object atomically: a streamed multipart upload, hashed while streaming.

An object store has no rename, but it has something as good: a multipart upload is invisible
under its key until ``CompleteMultipartUpload``, and then appears whole at once. So the writer
uploads straight to the final key, part by part, and only ``commit`` makes the object exist.
Whatever kills the job before that leaves no object at all, only an unfinished upload that
``S3Storage.remove_incomplete`` finds by listing the prefix's multipart uploads and aborts (it
also costs storage until then, which is why a rerun cleans up first).

Memory is bounded: one part being filled plus at most ``max_in_flight`` parts being sent on the
store's event loop while the caller fills the next (a part's buffer is handed over, not
copied, and filled again once its part is sent: fresh megabytes for every part would cost
zeroing and page faults). Parts start at 8 MiB and double every 1000 parts, so the 10,000-part
limit of S3 still allows objects of about 8 TiB while memory stays near 3 parts. A file smaller than one part is sent by one plain PUT at commit, which is atomic too.
The sha256 is computed from the bytes as the caller hands them over; no byte is read back.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
from typing import TYPE_CHECKING

from reshard_job.storage.s3errors import storage_error

if TYPE_CHECKING:
    from reshard_job.storage.s3calls import S3Calls

PART_SIZE = 8 * 1024 * 1024
PARTS_PER_DOUBLING = 1000
MAX_IN_FLIGHT = 2


class MultipartUpload:
    """``AtomicWriter`` for one object (see the module docstring)."""

    def __init__(self, store: "S3Calls", url: str, bucket: str, key: str, *, part_size: int = PART_SIZE,
                 max_in_flight: int = MAX_IN_FLIGHT):
        self.path = url
        self.size = 0
        self.upload_id: str | None = None
        self._store = store
        self._bucket = bucket
        self._key = key
        self._base_part_size = part_size
        self._max_in_flight = max(1, max_in_flight)
        self._hash = hashlib.sha256()
        self._buffer = bytearray()  # the part being filled: its first _fill bytes
        self._fill = 0
        self._spare: list[bytearray] = []  # buffers of parts sent, to be filled again
        self._parts: list[dict] = []
        self._in_flight: list[tuple[int, concurrent.futures.Future, bytearray | None]] = []
        self._done = False

    # -- AtomicWriter --------------------------------------------------------------------------
    @property
    def can_rewrite(self) -> bool:
        return False

    def rewrite_at(self, offset: int, data: bytes) -> None:
        raise RuntimeError(f"{self.path}: an object being uploaded cannot be rewritten (can_rewrite is False)")

    def write(self, data) -> None:
        if self._done:
            raise RuntimeError(f"{self.path}: already committed or aborted")
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self._hash.update(view)
        self.size += len(view)
        while len(view):
            size = self._part_size()
            if len(self._buffer) != size:  # the first part, or parts grew (only ever when empty)
                self._buffer = self._new_buffer(size)
            take = min(size - self._fill, len(view))
            self._buffer[self._fill:self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == size:
                self._send_part()

    def commit(self) -> tuple[int, str]:
        if self._done:
            raise RuntimeError(f"{self.path}: already committed or aborted")
        try:
            if self.upload_id is None:
                body = bytes(memoryview(self._buffer)[:self._fill])
                self._buffer, self._fill = bytearray(), 0
                self._store.call("put_object", self.path, "writing it", Bucket=self._bucket, Key=self._key,
                                 Body=body)
            else:
                if self._fill or not self._parts and not self._in_flight:
                    self._send_part()
                self._wait(0)
                self._parts.sort(key=lambda p: p["PartNumber"])
                # a store assembles the parts while it answers: its time limit grows with the object's size
                self._store.call("complete_multipart_upload", self.path, "completing its upload",
                                 Bucket=self._bucket, Key=self._key, UploadId=self.upload_id,
                                 MultipartUpload={"Parts": self._parts}, transfer=self.size)
        except BaseException:
            self.abort()
            raise
        self._done = True
        return self.size, self._hash.hexdigest()

    def abort(self) -> None:
        """Forget the parts sent so far; the key is left as it was (absent, or the old object)."""
        if self._done:
            return
        self._done = True
        self._buffer, self._fill, self._spare = bytearray(), 0, []
        for _, future, _ in self._in_flight:
            future.cancel()
        for _, future, _ in self._in_flight:
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - the upload is being thrown away
                pass
        self._in_flight = []
        if self.upload_id is not None:
            try:
                self._store.call("abort_multipart_upload", self.path, "aborting its upload", Bucket=self._bucket,
                                 Key=self._key, UploadId=self.upload_id)
            except Exception:  # noqa: BLE001 - remove_incomplete aborts it on the next run
                pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.result = self.commit()
        else:
            self.abort()
        return False

    # -- parts ---------------------------------------------------------------------------------
    def _part_size(self) -> int:
        number = len(self._parts) + len(self._in_flight)
        return self._base_part_size << (number // PARTS_PER_DOUBLING)

    def _send_part(self) -> None:
        try:
            if self.upload_id is None:
                created = self._store.call("create_multipart_upload", self.path, "starting its upload",
                                           Bucket=self._bucket, Key=self._key)
                self.upload_id = created["UploadId"]
            self._wait(self._max_in_flight - 1)
            number = len(self._parts) + len(self._in_flight) + 1
            if self._fill == len(self._buffer):  # handed over; filled again once it is sent
                body = reuse = self._buffer
                self._buffer = bytearray()
            else:  # the last part, shorter: a copy of its bytes, and the buffer stays
                body, reuse = self._buffer[:self._fill], None
            self._fill = 0
            future = self._store.submit(self._upload_part, number, body, transfer=len(body))
            self._in_flight.append((number, future, reuse))
        except BaseException:
            self.abort()
            raise

    async def _upload_part(self, number: int, body: bytearray) -> dict:
        client = await self._store.client()
        try:
            answer = await client.upload_part(Bucket=self._bucket, Key=self._key, UploadId=self.upload_id,
                                              PartNumber=number, Body=body)
        except Exception as e:  # noqa: BLE001 - mapped to one line below
            raise storage_error(e, self.path, f"uploading part {number}", endpoint=self._store.endpoint,
                                bucket=self._bucket) from None
        return {"PartNumber": number, "ETag": answer["ETag"]}

    def _wait(self, keep: int) -> None:
        """Wait until at most `keep` parts are still being sent."""
        while len(self._in_flight) > keep:
            _, future, buffer = self._in_flight.pop(0)
            self._parts.append(future.result())
            if buffer is not None and len(self._spare) < self._max_in_flight:
                self._spare.append(buffer)

    def _new_buffer(self, size: int) -> bytearray:
        """A buffer for the next part: a sent part's, while parts keep their size."""
        while self._spare:
            buffer = self._spare.pop()
            if len(buffer) == size:
                return buffer
        return bytearray(size)
