"""Small text helpers shared by the job's reports, the audit CLI and error messages."""

from __future__ import annotations

import re
from json.encoder import encode_basestring, encode_basestring_ascii
from typing import Any, Callable, Iterable, Iterator, Sequence


def rank_ranges(ranks: Iterable[int | None], sep: str = ",") -> str:
    """[0, 1, 2, 5] -> '0-2,5' ('-' when empty)."""
    values = sorted({r for r in ranks if r is not None})
    parts, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return sep.join(parts) or "-"


def human_size(size: float | None) -> str:
    """Bytes in binary units: 1536 -> '1.5 KiB'."""
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, indent: str = "",
          align_right: Iterable[int] = ()) -> str:
    """Columns padded to their widest cell (right-aligned where asked, e.g. for sizes); the last
    column is not padded, since it usually holds a path."""
    right = set(align_right)
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        padded = [cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) if i < len(row) - 1 else cell
                  for i, cell in enumerate(row)]
        lines.append((indent + "  ".join(padded)).rstrip())
    return "\n".join(lines)


# C0 and C1 controls, DEL, and the line and paragraph separators: what could end a line or drive a terminal
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def one_line_of(text: str) -> str:
    """`text` as one line a terminal only shows: every control character (newline, tab and ESC
    included), written as ``\\xNN`` (a file named with ESC[2J must not clear the screen it is named on,
    nor a newline in a name split an error in two)."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}" if m.group() < "\u0100" else f"\\u{ord(m.group()):04x}",
                            text)


def undecodable_name(path: str) -> str | None:
    """`path` shown with its bytes that are not UTF-8 as ``\\xNN``, when it holds such, else None.
    A file name is bytes; Python keeps those it cannot decode as lone surrogates, which a manifest,
    the lineage database and a terminal cannot take."""
    try:
        path.encode("utf-8")
        return None
    except UnicodeEncodeError:
        return one_line_of(path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"))


def listed(items: Sequence[Any], shown: int = 5, show: Callable[[Any], str] = str) -> str:
    """The first `shown` of `items` as `show` writes each, comma-separated, with how many more
    there are (only those shown are written: a list may hold 600,000 names)."""
    more = len(items) - shown
    return ", ".join(map(show, items[:shown])) + (f" and {more} more" if more > 0 else "")


def shorten(text: object, limit: int = 96) -> str:
    """`text` cut in the middle with an ellipsis when longer than `limit` characters.

    Error messages name parameters and files; a name can be arbitrarily long (or hostile), and a
    message must stay one readable line. The start and the end of a name are what tell names
    apart (``layers.17.….weight``), so both are kept.
    """
    text = str(text)
    if len(text) <= limit:
        return text
    keep = max(2, limit - 1)
    head = (keep + 1) // 2
    return text[:head] + "…" + text[len(text) - (keep - head):]


def quoted(name: object, limit: int = 96) -> str:
    """A name for a one-line message: shortened, then quoted with escapes (so a newline in a
    name cannot break the line)."""
    return repr(shorten(name, limit))


def bounded_list(values: Sequence[Any], limit: int = 8) -> str:
    """A list for a one-line message, cut after `limit` items: ``[0, 1, 2, …]``."""
    values = list(values[:limit + 1]) if isinstance(values, (list, tuple)) else list(values)
    shown = ", ".join(shorten(v, 24) for v in values[:limit])
    return f"[{shown}{', …' if len(values) > limit else ''}]"


def json_object_pieces(columns, depth: int = 0, indent: int | None = None, separators=(", ", ": "),
                       ensure_ascii: bool = True) -> Iterator[str]:
    """A mapping of strings to strings given as chunks of (keys, values) lists (keys unique, in
    the order to write), as ``json.dumps`` writes the dict, a chunk a piece. ``json.dumps`` with an
    indent encodes in Python, a call or more per item: a million digests written three times
    (the manifest's digest and file, the journal) cost seconds that way."""
    quote = encode_basestring_ascii if ensure_ascii else encode_basestring
    item_sep, key_sep = separators
    if indent is None:
        head, close = "{", "}"
    else:
        head = "{\n" + " " * (indent * (depth + 1))
        item_sep += head[1:]
        close = "\n" + " " * (indent * depth) + "}"
    first = True
    for keys, values in columns:
        if not keys:
            continue
        if len(keys) != len(values):
            raise ValueError("columns of a mapping: as many values as keys")
        n = len(keys)
        parts = ['"' + item_sep + '"'] * (4 * n - 1)  # key, key_sep, value, item_sep, ...: one join
        parts[0::4] = _escaped(keys, quote, ensure_ascii)
        parts[1::4] = ['"' + key_sep + '"'] * n
        parts[2::4] = _escaped(values, quote, ensure_ascii)
        yield (head if first else item_sep) + '"' + "".join(parts) + '"'
        first = False
    yield "{}" if first else close


def _escaped(texts: list[str], quote, ensure_ascii: bool) -> list[str]:
    """Each text as it stands between the quotes of a JSON string: the texts themselves where none
    needs escaping (hex digests, most names: no quote, backslash or control character, and only
    ASCII where asked), found by a few scans of them all joined (TypeError for a text that is not one)."""
    joined = "".join(texts)
    if joined.isascii():
        clean = not joined.encode("ascii").translate(None, _AS_IS)  # what is left needs escaping
    else:
        clean = not ensure_ascii and joined.isprintable() and '"' not in joined and "\\" not in joined
    return texts if clean else [quote(t)[1:-1] for t in texts]


_AS_IS = bytes(c for c in range(0x20, 0x7F) if c not in b'"\\')  # ASCII a JSON string holds unescaped
