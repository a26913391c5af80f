"""How wide a line of text is drawn, so a box's lines can be cut to fit it. Pure: no I/O.

The pictures name DejaVu Sans first (Verdana, much the same width, next). Its advance widths, in
units of 1/2048 em, for the printable ASCII characters (space to '~'), regular and bold (which
weight 600 is drawn in); any other character counts as one em, as wide as a CJK character and
wider than most others, so a line is rather cut too soon than drawn past its box. A name is cut
from the front, keeping the tail that tells similar names apart (a rank, a step, a suffix).
"""

from __future__ import annotations

ELLIPSIS = "…"
_EM = 2048
_FIRST = 32
_REGULAR = (
    651, 821, 942, 1716, 1303, 1946, 1597, 563, 799, 799, 1024, 1716, 651, 739, 651, 690, 1303, 1303, 1303,
    1303, 1303, 1303, 1303, 1303, 1303, 1303, 690, 690, 1716, 1716, 1716, 1087, 2048, 1401, 1405, 1430, 1577,
    1294, 1178, 1587, 1540, 604, 604, 1343, 1141, 1767, 1532, 1612, 1235, 1612, 1423, 1300, 1251, 1499, 1401,
    2025, 1403, 1251, 1403, 799, 690, 799, 1716, 1024, 1024, 1255, 1300, 1126, 1300, 1260, 721, 1300, 1298,
    569, 569, 1186, 569, 1995, 1298, 1253, 1300, 1300, 842, 1067, 803, 1298, 1212, 1675, 1212, 1212, 1075,
    1303, 690, 1303, 1716,
)
_BOLD = (
    713, 934, 1067, 1716, 1425, 2052, 1786, 627, 936, 936, 1071, 1716, 778, 850, 778, 748, 1425, 1425, 1425,
    1425, 1425, 1425, 1425, 1425, 1425, 1425, 819, 819, 1716, 1716, 1716, 1188, 2048, 1585, 1561, 1503, 1700,
    1399, 1399, 1681, 1714, 762, 762, 1587, 1305, 2038, 1714, 1741, 1501, 1741, 1577, 1475, 1397, 1663, 1585,
    2259, 1579, 1483, 1485, 936, 748, 936, 1716, 1024, 1024, 1382, 1466, 1214, 1466, 1389, 891, 1466, 1458,
    702, 702, 1362, 702, 2134, 1458, 1407, 1466, 1466, 1010, 1219, 979, 1458, 1335, 1892, 1321, 1335, 1192,
    1458, 748, 1458, 1716,
)
_OTHER = 2048
_ELLIPSIS_WIDTH = 2048


def _advance(character: str, bold: bool) -> int:
    if character == ELLIPSIS:
        return _ELLIPSIS_WIDTH
    table = _BOLD if bold else _REGULAR
    code = ord(character) - _FIRST
    return table[code] if 0 <= code < len(table) else _OTHER


def text_width(text: str, size: float, *, bold: bool = False) -> float:
    """`text`'s width in pixels at font size `size`."""
    return sum(_advance(c, bold) for c in text) * size / _EM


def fit_from_front(text: str, width: float, size: float, *, bold: bool = False) -> str:
    """`text`, or its longest tail after an ellipsis, that is at most `width` pixels wide at `size`."""
    if text_width(text, size, bold=bold) <= width:
        return text
    room = width * _EM / size - _ELLIPSIS_WIDTH
    kept = len(text)
    for i in range(len(text) - 1, -1, -1):
        room -= _advance(text[i], bold)
        if room < 0:
            break
        kept = i
    return ELLIPSIS + text[kept:]
