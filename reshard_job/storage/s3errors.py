"""What went wrong talking to an object store, as one line a user can act on.

botocore reports failures as a zoo of exception types and error codes, some of which (a HEAD
request's bare ``403``) do not even say which problem they are. This module turns each into a
``StorageError`` whose message names the URL (as displayed: never a credential), the operation,
and the likely fix, in one line of bounded length. "The key is not there" is not an error: it
maps to ``FileNotFoundError`` so callers can treat absence as an ordinary answer.

Retrying is botocore's job (its ``standard`` mode backs off on throttling, 5xx answers and lost
connections); by the time an exception reaches this module the retries are spent, and the
message says how many were made.
"""

from __future__ import annotations

import re

from reshard_job.storage.base import SourceChangedError, StorageError

MAX_URL_CHARS = 120
MAX_DETAIL_CHARS = 100

# Codes that mean "slow down": S3's own, and those of S3-compatible stores and proxies.
THROTTLING_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestLimitExceeded", "TooManyRequests", "TooManyRequestsException", "ServiceUnavailable",
    "503", "429", "RequestThrottledException", "ProvisionedThroughputExceededException",
    "ErrTooManyRequest",  # SeaweedFS's circuit breaker
})
THROTTLING_STATUS = frozenset({429, 503})
# The request reached the store but it did not accept who we claim to be.
CREDENTIAL_CODES = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "TokenRefreshRequired",
    "AuthorizationHeaderMalformed", "InvalidSecurity", "InvalidClientTokenId", "UnrecognizedClientException",
})
# We are who we claim to be, but may not do this.
PERMISSION_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem", "Forbidden"})
ABSENT_CODES = frozenset({"NoSuchKey", "404", "NotFound", "NoSuchVersion"})
CHANGED_CODES = frozenset({"PreconditionFailed", "412"})

class StoreTimeout(Exception):
    """An operation on the object store got no answer within its time limit (``s3client.Watchdog``);
    `earlier`: refused at once, since the store did not answer another operation moments ago.
    Deliberately not a TimeoutError (an OSError): no handler of file errors may swallow it."""

    def __init__(self, seconds: float, earlier: bool = False):
        self.seconds = seconds
        self.earlier = earlier
        super().__init__(f"no answer within {seconds:g} s")


class StoreUnresponsiveError(StorageError):
    """The object store did not answer in time: the job cannot go on (see ``StoreTimeout``)."""


_USERINFO = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@")


def strip_userinfo(url: str) -> str:
    """``s3://key:secret@bucket/x`` -> ``s3://bucket/x``: what a URL may show of itself."""
    return _USERINFO.sub(r"\1", url)


def shorten(text: str, limit: int = MAX_URL_CHARS) -> str:
    """Long names keep their head and tail (the tail names the file) around an ellipsis."""
    if len(text) <= limit:
        return text
    keep = limit - 1
    head = keep // 3
    return text[:head] + "…" + text[len(text) - (keep - head):]


def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ``ClientError`` ('' for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    code = str(response.get("Error", {}).get("Code", "") or "")
    if not code:
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(status or "")
    return code


def _status(exc: BaseException) -> int:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


def _attempts(exc: BaseException) -> int:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return int(response.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0) + 1
    return 0


def _detail(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    message = ""
    if isinstance(response, dict):
        message = str(response.get("Error", {}).get("Message", "") or "")
    if not message:
        message = str(exc) or type(exc).__name__
    message = " ".join(message.split())
    return shorten(strip_userinfo(message), MAX_DETAIL_CHARS)


def _connection_reason(exc: BaseException) -> str:
    """'connection refused', 'timed out', ...: the root cause, without the request URL botocore adds."""
    import errno

    seen = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, TimeoutError) or "Timeout" in type(cause).__name__:
            return "timed out"
        if isinstance(cause, OSError) and cause.errno:
            if cause.errno == errno.ECONNREFUSED:
                return "connection refused"
            return cause.strerror or errno.errorcode.get(cause.errno, str(cause.errno))
        if "Name or service not known" in str(cause) or "nodename nor servname" in str(cause):
            return "host name not found"
        nested = getattr(cause, "kwargs", {}).get("error") if isinstance(getattr(cause, "kwargs", None), dict) else None
        cause = nested or cause.__cause__ or cause.__context__ or getattr(cause, "os_error", None)
    return type(exc).__name__


def is_absent(exc: BaseException) -> bool:
    return error_code(exc) in ABSENT_CODES


def is_precondition_failed(exc: BaseException) -> bool:
    return error_code(exc) in CHANGED_CODES


def is_connection_problem(exc: BaseException) -> bool:
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError

    return isinstance(exc, (BotoConnectionError, HTTPClientError, TimeoutError, ConnectionError, OSError)) \
        and not hasattr(exc, "response")


def storage_error(exc: BaseException, url: str, doing: str, *, endpoint: str | None = None,
                  bucket: str = "") -> Exception:
    """The exception to raise for `exc`, met while `doing` something to `url` (already displayable).

    Returns ``FileNotFoundError`` for a missing key, ``SourceChangedError`` for a failed
    ``If-Match`` precondition, and a one-line ``StorageError`` for everything else.
    """
    from botocore.exceptions import (CredentialRetrievalError, NoCredentialsError, NoRegionError,
                                     PartialCredentialsError)

    where = shorten(strip_userinfo(url))
    store = f" at {shorten(strip_userinfo(endpoint), 60)}" if endpoint else ""
    code = error_code(exc)
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, StoreTimeout):
        when = f"while {doing} or just before" if exc.earlier else f"while {doing}"
        return StoreUnresponsiveError(f"{where}: no answer from the object store{store} within {exc.seconds:g} s "
                                      f"{when} (connecting, retries and back-off included); check the endpoint, or "
                                      f"raise storage.options.config_kwargs.operation_timeout")
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)):
        return StorageError(f"{where}: no usable credentials for the object store while {doing} "
                            f"({_detail(exc)}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                            f"~/.aws/credentials, or storage.options")
    if isinstance(exc, NoRegionError):
        return StorageError(f"{where}: no region configured for the object store; set AWS_DEFAULT_REGION "
                            f"or storage.endpoint_url")
    if code in ABSENT_CODES:
        return FileNotFoundError(f"{where}: no such object")
    if code == "NoSuchBucket":
        name = f" '{bucket}'" if bucket else ""
        return StorageError(f"{where}: bucket{name} does not exist{store}")
    if code in CHANGED_CODES:
        return SourceChangedError(f"{where}: changed while the job was using it (its ETag differs from the one "
                                  f"seen when it was opened); rerun once the object is stable")
    if code in CREDENTIAL_CODES:
        return StorageError(f"{where}: the object store rejected the credentials ({code}) while {doing}; "
                            f"check the access key and secret (environment, ~/.aws or storage.options)")
    if code in PERMISSION_CODES or code == "403":
        return StorageError(f"{where}: access denied while {doing} ({code}); the credentials lack permission "
                            f"for this bucket or prefix")
    if code in THROTTLING_CODES or _status(exc) in THROTTLING_STATUS:
        return StorageError(f"{where}: the object store kept throttling requests ({code}) while {doing}, "
                            f"{_attempts(exc)} attempt(s) with back-off; try again later or use fewer workers")
    if code == "NoSuchUpload":
        return StorageError(f"{where}: the multipart upload was aborted by someone else while {doing}")
    if code:
        status = ""
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            http = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            status = f"HTTP {http}, " if http and str(http) != code else ""
        return StorageError(f"{where}: {doing} failed ({status}{code}: {_detail(exc)})")
    if is_connection_problem(exc):
        return StorageError(f"{where}: cannot reach the object store{store} while {doing} "
                            f"({_connection_reason(exc)}, after retries)")
    return StorageError(f"{where}: {doing} failed ({type(exc).__name__}: {_detail(exc)})")
