"""JSON documents read piece by piece with bounds (``JsonStream``, ``loads_bounded``); the mirror of
``jsonchunks``, which writes them in pieces.

``json.loads`` of a document holds its bytes, its text and every object of it at once: a 200 MB
``metadata.json`` of 600,000 parameters peaked at 2.2 GB, and a document padded with a gigabyte of
spaces costs its size twice before a byte of it is looked at.
``JsonStream`` reads a document in windows of ``CHUNK`` bytes from a ``read(n)`` function, walks
the outer objects itself (``members``) and hands each value below them to ``json``'s C scanner
(``value``), so no more than one such value (one parameter's entry) is held as text or as objects
besides what the caller keeps of it; a value larger than ``max_value`` is refused. Integers of more
than ``MAX_INT_DIGITS`` digits are refused as what they are (``json.loads`` would fail on 4,300
digits with a bare ValueError, and build a 4,000-digit int below that), and so is nesting deeper
than the interpreter's recursion limit. Problems are ``JsonProblem`` (a ValueError) in words,
without the file: callers name it.
"""

from __future__ import annotations

import codecs
import functools
import io
import json
import re
from collections import deque
from collections.abc import Mapping
from json.decoder import scanstring
from typing import Callable, Iterator

MAX_INT_DIGITS = 20  # an int64 or a uint64 has at most 20 digits: more is no count, size, rank or offset
CHUNK = 1 << 20  # bytes read at a time
MAX_VALUE = 16 << 20  # characters of one value handed to the scanner (one parameter's entry): its
# objects take some 30 times that at worst (a list of ints), so this bounds what one value can cost
_WS = re.compile(r"[ \t\n\r]*")
_TO_ZERO = str.maketrans("123456789", "0" * 9)  # every digit a 0: runs of digits found by str.find
_RUN = "0" * (MAX_INT_DIGITS + 1)
_ZEROS = re.compile("0*")
_KEY = re.compile(r'"((?:[^"\\]|\\.){0,200})"\s*:')


RECENT = 4  # recent distinct values ``JsonStream.items`` compares the next one with
REUSED = object()  # ``JsonStream.items``: the value is the caller's, known by its text
MATCHED = object()  # ``JsonStream.items``: the member matched the caller's pattern (the match is the third)
RUN = object()  # ``JsonStream.items(runs=True)``: the keys (a list) of consecutive members of one known value
MATCHED_RUN = object()  # ``JsonStream.items(runs=True, pattern=…)``: the groups of consecutive members it matched
_PLAIN_KEYS = re.compile(r'(?:"[^"\\\x00-\x1f]*"\x00)*')  # keys without escapes (others: the careful way)
RUN_FIRST = 4  # members a run is first looked for in (their value's length each): doubled while it lasts


@functools.lru_cache(maxsize=8)
def _pattern_runs(pattern: re.Pattern) -> tuple[re.Pattern, re.Pattern]:
    """(a run of members `pattern` matches, each followed by a comma; one such member)."""
    return re.compile(f"(?:{pattern.pattern},)+", pattern.flags), re.compile(f"{pattern.pattern},", pattern.flags)


class JsonProblem(ValueError):
    """What is wrong with a JSON document, in words (the caller names the file)."""


def strict_int(text: str) -> int:
    """``parse_int`` that refuses integers of absurd length (more than ``MAX_INT_DIGITS`` digits)."""
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise JsonProblem(f"an integer of more than {MAX_INT_DIGITS} digits ({text[:12]}…): integers of absurd "
                          f"length are refused")
    return int(text)


_PLAIN = json.JSONDecoder()
_STRICT = json.JSONDecoder(parse_int=strict_int)


def file_reader(f, start: int = 0, length: int | None = None) -> Callable[[int], bytes]:
    """``read(n)`` over `length` bytes from `start` of an open file with ``size`` and
    ``pread_into(offset, view) -> int`` (``storage.RandomAccess``): what ``JsonStream`` reads from."""
    end = f.size if length is None else start + length
    pos = start

    def read(n: int) -> bytes:
        nonlocal pos
        buf = bytearray(max(0, min(n, end - pos)))
        got = f.pread_into(pos, memoryview(buf)) if buf else 0
        pos += got
        return bytes(buf) if got == len(buf) else bytes(buf[:got])
    return read


def loads_bounded(text: str | bytes):
    """``json.loads`` of a small document with ``JsonStream``'s rules (integers of at most
    ``MAX_INT_DIGITS`` digits, nesting within the recursion limit); JsonProblem otherwise."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    stream = JsonStream(io.BytesIO(data).read, max_value=len(data) + 1)
    value = stream.value()
    stream.end()
    return value


class JsonStream:
    """A JSON document read from `read` (``read(n) -> bytes``, ``b""`` at the end) a window at a time.

    ``members()`` walks an object: it yields each key, and the caller reads that key's value
    (``value()``, or ``members()`` of an inner object) before asking for the next key; ``items()``
    walks an object of many members (a parameter each), value included. ``end()`` checks that
    nothing but whitespace follows the document. Keys are not checked for duplicates: callers that
    keep values by key see a repeated one (``json.loads`` keeps the last silently).

    Where runs of more than ``MAX_INT_DIGITS`` digits lie is noted as the text arrives (one
    ``str.translate`` pass); only the values holding one are scanned again with the strict
    ``parse_int``, so the common case costs no Python call per integer.
    """

    def __init__(self, read: Callable[[int], bytes], *, max_value: int = MAX_VALUE, chunk: int = CHUNK,
                 object_pairs_hook=None):
        self._read = read
        self._plain = _PLAIN if object_pairs_hook is None else json.JSONDecoder(object_pairs_hook=object_pairs_hook)
        self._strict = _STRICT if object_pairs_hook is None else json.JSONDecoder(
            object_pairs_hook=object_pairs_hook, parse_int=strict_int)
        self._decode = codecs.getincrementaldecoder("utf-8")().decode
        self.max_value = max_value
        self.chunk = chunk
        self.buf = ""
        self.pos = 0
        self.base = 0  # characters of the document before ``buf``
        self.bytes_read = 0
        self.eof = False
        self._long: deque[int] = deque()  # where runs of more than MAX_INT_DIGITS digits begin (absolute)

    # --- the window ---------------------------------------------------------------------------
    def _more(self, at_least: int = 0) -> bool:
        """Drop what was consumed and read on (at least `at_least` bytes more); False at the end."""
        if self.eof:
            return False
        if self.pos:
            self.base += self.pos
            self.buf = self.buf[self.pos:]
            self.pos = 0
        data = self._read(max(self.chunk, at_least))
        try:
            text = self._decode(data, final=not data)
        except UnicodeDecodeError as e:
            raise JsonProblem(f"not valid UTF-8 (byte {self.bytes_read + max(e.start, 0)})") from None
        self.bytes_read += len(data)
        self.eof = not data
        start = max(0, len(self.buf) - MAX_INT_DIGITS)
        self.buf += text
        self._note_long_runs(start)
        return True

    def _note_long_runs(self, start: int) -> None:
        """Note where runs of more than MAX_INT_DIGITS digits begin in ``buf[start:]``: the values
        the fast path must leave to the careful one (one pass over the text, a few ns a character)."""
        flat = self.buf[start:].translate(_TO_ZERO)
        i = flat.find(_RUN)
        while i >= 0:
            at = self.base + start + i
            if not self._long or self._long[-1] < at:
                self._long.append(at)
            i = flat.find(_RUN, _ZEROS.match(flat, i).end())

    def problem(self, what: str, at: int | None = None) -> JsonProblem:
        where = self.base + (self.pos if at is None else at)
        return JsonProblem(f"not valid JSON ({what}{'' if what.endswith(' at') else ' at'} character {where})")

    def peek(self) -> str:
        """The next character that is not whitespace ("" at the end), not consumed."""
        if self.pos < len(self.buf) and self.buf[self.pos] not in " \t\n\r":
            return self.buf[self.pos]
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self._more():
                return self.buf[self.pos] if self.pos < len(self.buf) else ""

    def take(self, allowed: str) -> str:
        """Consume the next character, one of `allowed`."""
        c = self.peek()
        if not c or c not in allowed:
            expected = " or ".join(repr(a) for a in allowed)
            raise self.problem(f"expecting {expected}, found {repr(c) if c else 'the end'}")
        self.pos += 1
        return c

    def end(self) -> None:
        if self.peek():
            raise self.problem("extra data after the document")

    # --- values -------------------------------------------------------------------------------
    def members(self) -> Iterator[str]:
        """The keys of the object that begins here, each yielded before its value is read."""
        self.take("{")
        if self.peek() == "}":
            self.pos += 1
            return
        while True:
            if self.peek() != '"':
                raise self.problem("expecting a key in double quotes")
            key = self._scan(lambda buf, pos: scanstring(buf, pos + 1, True), None)
            self.take(":")
            yield key
            if self.take(",}") == "}":
                return

    def items(self, known: Mapping[str, object] | None = None, max_value: Callable[[str], int] | None = None,
              pattern: re.Pattern | None = None, runs: bool = False) -> Iterator[tuple[str, object, str]]:
        """(key, value, the value's JSON text) of each member of the object that begins here.

        The text lets a caller reuse what it made of an equal value: in a large document most values
        repeat (every expert's weights have the same shape and layout). Where `known` (the caller's
        values by text) holds a text that recurs among the last few, its value is not scanned again:
        it is yielded as ``REUSED`` with that very text. `max_value(key)`: the bound on that key's value
        (``max_value`` of the stream otherwise). `pattern`: a member in the caller's most common compact
        form, its key (without escapes) in group 1: one it matches is yielded as (key, ``MATCHED``, the match).
        `runs`: consecutive compact members whose value is the text of the last one, known, are yielded
        together as (their keys, ``RUN``, the text), and consecutive members `pattern` matches as
        (``findall``'s groups of each, ``MATCHED_RUN``, None): found in C, not by a call each (a save of
        600,000 experts' weights repeats one entry: the loop per member was most of its cost)."""
        self.take("{")
        if self.peek() == "}":
            self.pos += 1
            return
        recent: list[str] = []  # texts of the last values that `known` holds, newest first
        last, span = None, 0  # the text of the last member's value if known; where a run is looked for
        pattern_span = RUN_FIRST * 256  # where a run of members `pattern` matches is looked for
        while True:
            if runs and pattern is not None and (rows := self._matched_run(pattern, pattern_span)):
                yield rows, MATCHED_RUN, None
                pattern_span = min(2 * pattern_span, self.chunk)
                continue
            pattern_span = RUN_FIRST * 256
            m = pattern.match(self.buf, self.pos) if pattern is not None else None
            if m is not None and m.end() < len(self.buf):  # the end of the window may cut a member
                self.pos = m.end()
                item = m[1], MATCHED, m
            elif last is not None and last in known and (keys := self._run(last, span)):
                yield keys, RUN, last
                span = min(2 * span, self.chunk)
                continue
            else:
                item = self._fast_item(recent, known) or self._item(max_value)
                if runs and item[1] is REUSED:
                    last, span = item[2], RUN_FIRST * (len(item[2]) + 80)
                else:
                    last = None
            yield item
            if known is not None and item[1] is not REUSED and item[2] in known:
                recent.insert(0, item[2])
                del recent[RECENT:]
            c = self.buf[self.pos] if self.pos < len(self.buf) else ""
            if c in (",", "}"):
                self.pos += 1
            else:
                c = self.take(",}")
            if c == "}":
                return

    def _run(self, text: str, span: int) -> list[str]:
        """The keys of the members in the next `span` characters whose value is exactly `text`, each
        followed by a comma (so wholly in the window, and not the object's last), all consumed.
        Those characters are split where `text` and its comma end a member: every piece but the last
        must be a key in quotes with no quote, escape or control character inside, checked all at once
        (such pieces can be read in only one way); the run ends before the first that is not."""
        sep = ":" + text + ","
        parts = self.buf[self.pos:self.pos + span].split(sep)[:-1]
        if not parts:
            return parts
        joined = "\0".join(parts) + "\0"
        valid = _PLAIN_KEYS.match(joined).end()
        count = joined.count("\0", 0, valid)
        self.pos += valid - count + count * len(sep)
        return [key[1:-1] for key in parts[:count]]

    def _matched_run(self, pattern: re.Pattern, span: int) -> list[tuple]:
        """The groups of each member in the next `span` characters that `pattern` matches (as
        ``Match.groups()`` gives them), each followed by a comma, all consumed; [] if none. One ``split`` finds them: where the pieces between the
        matches are all empty, the members run on; the first that is not ends the run."""
        whole, each = _pattern_runs(pattern)
        if each.match(self.buf, self.pos) is None:
            return []
        text = self.buf[self.pos:self.pos + span]
        parts = each.split(text)
        width = pattern.groups + 1
        gaps = parts[0::width]  # what lies before each match, then what follows the last
        if not "".join(gaps[:-1]):
            self.pos += len(text) - len(gaps[-1])
            count = len(gaps) - 1
        else:  # the members end before the window does: where, the run pattern says
            count = next(i for i, gap in enumerate(gaps) if gap)
            self.pos = whole.match(self.buf, self.pos).end()
        return list(zip(*(parts[k:count * width:width] for k in range(1, width))))

    def _fast_item(self, recent: list[str], known):
        """The next member, compact or indented as ``json.dumps`` indents, wholly in the window, or
        None (the careful way then: a manifest's million digests took 17 s to read past that way)."""
        buf, pos = self.buf, self.pos
        try:
            if buf[pos] != '"':
                pos = _WS.match(buf, pos).end()
                if buf[pos] != '"':
                    return None
            key, colon = scanstring(buf, pos + 1, True)
            if buf[colon] != ":":
                return None
            start = _WS.match(buf, colon + 1).end() if buf[colon + 1] in " \t\n\r" else colon + 1
            for text in recent:  # a self-delimited value followed by ',' or '}' is exactly `text`
                end = start + len(text)
                if buf.startswith(text, start) and end < len(buf) and buf[end] in ",}" and text in known:
                    self.pos = end
                    return key, REUSED, text
            value, end = self._plain.scan_once(buf, start)
        except (IndexError, ValueError, StopIteration, RecursionError):
            return None
        if not self._complete(value, end):
            return None
        if self._long_run(colon, end):  # an absurd integer, or a long run of digits in a text
            return None
        self.pos = end
        return key, value, buf[start:end]

    def _item(self, max_value: Callable[[str], int] | None = None):
        if self.peek() != '"':
            raise self.problem("expecting a key in double quotes")
        key = self._scan(lambda buf, pos: scanstring(buf, pos + 1, True), None)
        self.take(":")
        self.peek()
        start = self.base + self.pos  # the window only drops what lies before the position
        try:
            value = self.value(self.max_value if max_value is None else max_value(key))
        except JsonProblem as e:
            raise JsonProblem(f"at key {key[:80]!r}: {e}") from None
        return key, value, self.buf[start - self.base:self.pos]

    def value(self, max_value: int | None = None):
        """The value that begins here, as ``json.loads`` makes it (integers bounded)."""
        if not self.peek():
            raise self.problem("expecting a value, found the end")
        return self._scan(self._plain.scan_once, self._strict, max_value)

    def _scan(self, scan, decoder, max_value: int | None = None):
        """scan(buf, pos) -> (value, end), on a window grown until the value ends inside it."""
        limit = self.max_value if max_value is None else max_value
        while True:
            start = self.pos
            at = None
            try:
                value, end = scan(self.buf, start)
                if decoder is not None and self._long_run(start, end):  # a name's digits, or an absurd int
                    value, end = decoder.scan_once(self.buf, start)
                if self._complete(value, end):
                    if end - start > limit:
                        raise self._too_large(limit, start)
                    self.pos = end
                    return value
            except StopIteration as e:
                at, what = e.value, "expecting a value"
            except json.JSONDecodeError as e:
                at, what = e.pos, e.msg
            except JsonProblem as e:
                raise JsonProblem(f"{e}{self._key_before(start)}") from None
            except ValueError:  # Python's own limit on digits (4300) met by the plain scanner
                value, end = self._strict_scan(decoder or _STRICT, start)
                self.pos = end
                return value
            except RecursionError:
                raise JsonProblem(f"JSON nested too deeply (at character {self.base + start})") from None
            if decoder is not None and self._long_run(start, len(self.buf)):
                self._absurd_int_first(decoder, start)  # an absurd integer before the window's end: say so
            if at is not None and (self.eof or (at < len(self.buf) - 16 and not what.startswith("Unterminated"))):
                raise self.problem(what, at)
            if len(self.buf) - start > limit:
                raise self._too_large(limit, start)
            self._more(len(self.buf) - start)

    def _long_run(self, start: int, end: int) -> bool:
        """Whether a run of more than MAX_INT_DIGITS digits begins in ``buf[start:end]`` (runs before
        `start` are passed: forgotten)."""
        long = self._long
        while long and long[0] < self.base + start:
            long.popleft()
        return bool(long) and long[0] < self.base + end

    def _complete(self, value, end: int) -> bool:
        """Whether a value scanned up to `end` is the whole of it: a number that reaches near the
        window's end may go on in the next one ("0." "5", "1e-" "3": at most 3 characters decide)."""
        return self.eof or not isinstance(value, (int, float)) or len(self.buf) - end >= 3

    def _too_large(self, limit: int, start: int) -> JsonProblem:
        return JsonProblem(f"a value of more than {limit} characters at character {self.base + start}, "
                           f"larger than any this document should hold")

    def _absurd_int_first(self, decoder, start: int) -> None:
        try:
            decoder.scan_once(self.buf, start)
        except JsonProblem as e:
            raise JsonProblem(f"{e}{self._key_before(start)}") from None
        except (ValueError, StopIteration, RecursionError):
            pass  # what else is wrong is told the usual way

    def _strict_scan(self, decoder, start: int):
        try:
            return decoder.scan_once(self.buf, start)
        except JsonProblem as e:
            raise JsonProblem(f"{e}{self._key_before(start)}") from None

    def _key_before(self, start: int) -> str:
        """' (key '<k>')': the last key before the first absurd integer after `start`, for messages."""
        at = next((p - self.base for p in self._long if p >= self.base + start), None)
        if at is None:
            return ""
        keys = _KEY.findall(self.buf, max(0, at - 4096), at)
        return f" (under key {keys[-1][:80]!r})" if keys else ""
