"""Joining a Ray cluster: importing Ray on demand, checking the address, connecting.

``ray.init`` retries an address that does not answer for ever, and says little when something
else listens there; so the address is resolved and probed first (TCP, then gRPC) and every
failure becomes one ``RayConnectionError`` line saying what is wrong with it.
"""

from __future__ import annotations

import logging
import socket
import warnings

from reshard_job.errors import ConfigError
from reshard_job.job.config.ray_address import ADDRESS_AUTO, parse_address
from reshard_job.job.run.ray.errors import RayConnectionError, first_line

CONNECT_TIMEOUT = 10.0
_HEALTH_SERVING = b"\x08\x01"  # grpc.health.v1.HealthCheckResponse{status: SERVING}


def import_ray():
    """Ray, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError:
        ray = None
    # (a folder named "ray" on sys.path imports as an empty namespace package)
    if ray is None or not hasattr(ray, "remote"):
        raise ConfigError("the Ray executor needs the ray package: pip install -e '.[ray]'")
    return ray


def connect(address: str, timeout: float):
    """Join the cluster at `address`; return (ray, whether this call joined it itself).

    A connection this process already has is reused when it is to the same cluster; the address
    is checked first either way, so a wrong one always fails.
    """
    ray = import_ray()
    kind, host, port = parse_address(address)
    if kind == ADDRESS_AUTO:
        resolved = _resolve_auto(ray, address)
        if resolved is not None:
            kind, host, port = parse_address(resolved)
    if host is not None:
        _probe(address, kind, host, port, timeout)
    if ray.is_initialized():
        current = _connected_gcs(ray)
        if kind == "gcs" and current and not _same_endpoint(current, host, port):
            raise RayConnectionError(address, f"this process is already connected to the Ray cluster at {current}")
        return ray, False
    try:
        with warnings.catch_warnings():  # Ray warns, then raises; the error says it all
            warnings.simplefilter("ignore")
            ray.init(address=address, ignore_reinit_error=True, logging_level=logging.WARNING, log_to_driver=False)
    except Exception as e:  # Ray raises ConnectionError, RuntimeError, ValueError, grpc errors...
        if ray.is_initialized():
            ray.shutdown()
        raise RayConnectionError(address, first_line(e)) from None
    return ray, True


def _probe(address: str, kind: str, host: str, port: int, timeout: float) -> None:
    """Fail in seconds, with the reason, where ``ray.init`` would retry for ever.

    A refused or unresolvable address fails the TCP connect. Something listening that is not
    Ray (``ray.init`` waits for a GCS that never answers) fails the gRPC handshake, and for a
    GCS address the standard gRPC health check, which Ray's GCS serves. Without grpcio (Ray
    without its client extra) only the TCP check is made.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except socket.gaierror as e:
        raise RayConnectionError(address, f"unknown host {host!r} ({e.strerror})") from None
    except socket.timeout:
        raise RayConnectionError(address, f"no answer within {timeout:g} s") from None
    except OSError as e:
        raise RayConnectionError(address, (e.strerror or str(e)).lower()) from None
    try:
        import grpc
    except ImportError:
        return
    _probe_grpc(grpc, address, kind, host, port, timeout)


def _probe_grpc(grpc, address: str, kind: str, host: str, port: int, timeout: float) -> None:
    """The gRPC half of ``_probe``: a handshake, then the health check only a GCS answers."""
    what = "a Ray Client server (ray://, port 10001 by default)" if kind == "client" else \
        "a Ray head's GCS (port 6379 by default; use ray://host:port for a Ray Client server)"
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    channel = grpc.insecure_channel(target)
    try:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise RayConnectionError(address, f"something listens there but does not answer as {what}") from None
        # Ray's GCS serves the standard gRPC health check; its Ray Client server does not
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            answer, problem = check(b"", timeout=timeout), None
        except grpc.RpcError as e:
            answer, problem = None, e.code().name.lower()
        if kind == "client":
            if answer is not None:
                raise RayConnectionError(address, f"that is a Ray head's GCS port, not a Ray Client server; "
                                                  f"from a cluster node use {target} without ray://")
            return
        if answer is None:
            raise RayConnectionError(address, f"a gRPC server answers there but not as {what} ({problem})")
        if answer != _HEALTH_SERVING:
            raise RayConnectionError(address, "the Ray GCS there reports that it is not serving")
    finally:
        channel.close()


def _resolve_auto(ray, address: str) -> str | None:
    """The address ``auto`` stands for (``RAY_ADDRESS``, or the cluster this machine last joined),
    to probe it; None where this Ray version does not say (then ``ray.init`` reports)."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:
        return None
    try:
        resolved = canonicalize_bootstrap_address(address)
    except ConnectionError as e:
        raise RayConnectionError(address, first_line(e)) from None
    except Exception:
        return None
    return resolved if isinstance(resolved, str) and resolved else None


def _connected_gcs(ray) -> str | None:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:
        return None


def _same_endpoint(current: str, host: str | None, port: int | None) -> bool:
    try:
        _, h, p = parse_address(current)
    except ConfigError:
        return True  # cannot tell: do not refuse
    if p != port:
        return False
    if h == host:
        return True
    try:
        return socket.gethostbyname(h) == socket.gethostbyname(host)
    except OSError:
        return True
