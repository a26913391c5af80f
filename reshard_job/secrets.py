"""Keeping credentials off disk and out of logs.

A password can reach the job in a URL (``lineage.url=postgresql://user:pw@host/db``, an endpoint
with user info) or in ``storage.options`` (``key``, ``secret``, ``token``). The job needs them to
connect, but everything it writes or records (``manifest.json``, ``result.json``, the lineage
database's copy of the configuration, log lines, Hydra's saved configuration) gets the masked
form. The run stays reproducible: the same command with the credentials supplied again (best
through the environment) reruns it.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
# scheme://user:password@host -> scheme://user:***@host (also scheme://:password@host)
# (a scheme begins where no scheme character precedes it: tried from inside a long run of letters it
# would rescan the run from every position, which took minutes on a 100,000-character path)
# (the separator may come percent-encoded: user%3Apassword@)
_URL_PASSWORD = re.compile(r"(?P<head>(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://[^/@:\s]*?)(?P<sep>:|%3[Aa])"
                           r"(?P<pw>[^/@\s]*)@")
# an object store's URL has no user: whatever stands before its '@' (a bare token) is a credential
_STORE_USERINFO = re.compile(r"(?P<head>(?<![A-Za-z0-9+.\-])(?:s3[an]?|obs|oss|gs|gcs|az|abfss?|cos|r2)://)"
                             r"(?P<info>[^/@\s]+)@", re.I)
_SECRET_KEY = re.compile(r"(pass(word|wd)?|secret|token|credential|api[_-]?key|access[_-]?key|private[_-]?key|"
                         r"^key$|session)", re.I)


_QUERY_SECRET = re.compile(r"(?P<head>[?&](?:password|passwd|pwd|secret|token|sslpassword|"
                           r"x-amz-security-token|x-amz-signature)=)(?P<value>[^&#\s'\",]+)", re.I)


def mask_url(text: str) -> str:
    """`text` with the password of every ``scheme://user:password@`` (or ``user%3Apassword@``), all
    of an object store URL's user info (``s3://TOKEN@bucket``), and secret query values masked."""
    text = _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{m.group('sep')}{MASK}@", text)
    text = _STORE_USERINFO.sub(lambda m: f"{m.group('head')}{MASK}@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m.group('head')}{MASK}", text)


def is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.search(str(key)))


# `name=value` items of a command line or of Hydra's comma-joined ``override_dirname``
_OVERRIDE_ITEM = re.compile(r"(?P<head>(?:^|(?<=[\s,\[\]'\"]))[+~]{0,2}(?P<name>[A-Za-z_][\w\-]*(?:\.[\w\-]+)*)=)"
                            r"(?P<value>'[^'\n]*'|\"[^\"\n]*\"|[^,\s\]]*)", re.M)


def mask_overrides(text: str) -> str:
    """`text` with the value of every ``name=value`` item whose name is secret-looking masked
    (``+storage.options.secret=SK`` on a command line, or inside ``a=1,b.secret=SK``)."""
    def item(m: re.Match) -> str:
        secret = is_secret_key(m.group("name").rsplit(".", 1)[-1])
        empty = m.group("value") in ("", "null", "''", '""')
        return m.group("head") + MASK if secret and not empty else m.group(0)

    return _OVERRIDE_ITEM.sub(item, text)


def mask_config(value: Any, key: str = "") -> Any:
    """A copy of a configuration tree with secret-looking keys' values and URL passwords masked."""
    if isinstance(value, dict):
        return {k: (MASK if is_secret_key(k) and v not in (None, "") and not isinstance(v, (dict, list))
                    else mask_config(v, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_config(v, key) for v in value]
    if isinstance(value, str):
        return mask_overrides(mask_url(value))
    return value


_YAML_OR_OVERRIDE = re.compile(r"^(?P<head>[ \t]*-?[ \t]*\+?(?P<name>[\w.\-]+)[ \t]*(?::[ \t]|=)[ \t]*)(?P<value>\S.*)$",
                               re.M)



def mask_text(text: str) -> str:
    """Credentials masked in free text such as a saved YAML configuration or a command line."""
    def secret(name: str, value: str) -> bool:
        return is_secret_key(name.lstrip("+~").rsplit(".", 1)[-1]) and value.strip() not in ("null", "''", '""', "{}")

    def line(m: re.Match) -> str:
        return m.group("head") + MASK if secret(m.group("name"), m.group("value")) else m.group(0)

    return mask_overrides(_YAML_OR_OVERRIDE.sub(line, mask_url(text)))
