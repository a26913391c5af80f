"""Where the Ray cluster is: parsing ``job.ray.address`` without importing Ray.

Settling the config refuses a malformed address before anything runs, and the Ray executor
parses the same text when it connects; both use ``parse_address`` from here, so checking a
config never needs the ``ray`` package.
"""

from __future__ import annotations

import re

from reshard_job.errors import ConfigError

ADDRESS_AUTO = "auto"
CLIENT_SCHEME = "ray://"


def parse_address(address: str | None) -> tuple[str, str | None, int | None]:
    """``auto`` | ``ray://host:port`` | ``host:port`` -> (kind, host, port); kind is auto, client or gcs."""
    text = ADDRESS_AUTO if address is None else str(address).strip()
    if text == ADDRESS_AUTO:
        return ADDRESS_AUTO, None, None
    kind, rest = ("client", text[len(CLIENT_SCHEME):]) if text.startswith(CLIENT_SCHEME) else ("gcs", text)
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", rest)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ConfigError(f"Ray address {clip(text, 120)!r} is not 'auto', 'ray://host:port' or 'host:port'")
    return kind, m.group(1).strip("[]"), int(m.group(2))


def clip(text: str, limit: int) -> str:
    """`text` as one line (whitespace runs become one space), cut with an ellipsis at `limit` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
