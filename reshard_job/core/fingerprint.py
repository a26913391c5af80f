"""Layout-independent fingerprints of parameters: one digest per global tensor, whatever its sharding.

A parameter stored whole, cut into boxes by any layout (uneven splits, several split axes, pipeline
stages), or read as byte runs of its flattened form must give the same fingerprint, and the parts
must be fed in any order without assembling the tensor. A linear function of the bytes in which
each byte is weighted by a key of its global position has exactly that property: the digest is a
sum over bytes, so any partition of the bytes sums to the same value, and the fingerprints of
disjoint parts combine by addition (``merge``). The caller feeds every global element exactly once
(replicas deduplicated); ``fed`` and ``complete`` count bytes to catch most mistakes there.

Algorithm ``poslin64x2-v1``
---------------------------
*Byte grid.* Trailing dims of extent 1 are dropped; the last remaining axis, in bytes, is a *row*:
grid ``(S_0, .., S_{k-2}, S_{k-1} * itemsize)``. A 0-d tensor is one row of one element; an opaque
dtype (none of MindSpore's now: Int4 is one byte per element) is one row of its ``nbytes``. Byte
``j`` of the row at leading index ``i`` lies in word ``c = j div 8`` of that row at place ``j mod 8`` (a row's last word is padded with zeros).

*Lanes.* Two 64-bit sums, arithmetic mod 2^64, over every byte ``b`` at grid position (i, j)::

    H1 = sum b * 2^(8*(j mod 8))       * K1(i, j div 8)      (words read little-endian)
    H2 = sum b * 2^(8*(7 - (j mod 8))) * K2(i, j div 8)      (words read big-endian)
    Kl(i, c) = Dl_0(i_0) * .. * Dl_{k-2}(i_{k-2}) * Al(c mod 2^13) * Gl(c div 2^13)

Every factor is an odd 64-bit value, the splitmix64 finaliser of ``index * gamma + seed`` with the
low bit set, seeded per lane and per purpose (dim d, column, segment) from sha256 of the algorithm
name; so every key is odd. Equivalently ``Hl = sum word_l(i, c) * Kl(i, c)``. The digest is the 16
bytes ``H1 | H2 << 64`` (little-endian) XOR the first 16 bytes of sha256 of "algorithm|dtype|shape";
``hexdigest()`` is its 32 hex characters. The dtype is MindSpore's name whatever the file format.

*Why this shape.* A box covers one contiguous range of each of its rows, and a key factors into
row and column parts, so a box of ``R`` rows of ``M`` words is one integer matrix-vector product
``X (R, M) @ A[c0:c0+M]`` (numpy's uint64 matmul: the only exact vectorised multiply-add it has)
followed by one contraction per leading dim with the ``D`` keys; a run crossing rows and dims is cut
into at most ``2 * ndim`` such boxes. Runs cut mid-word are padded with zeros, exact because the sum
is linear. Dropping trailing 1s keeps 1x1 convolution kernels from becoming one-element rows.

Guarantee
---------
*Deterministic.* If the stored bytes change only inside one word (8 aligned bytes of a grid row;
every element of itemsize <= 8 lies inside one word, because rows are word-padded and itemsizes
divide 8), the digest changes. Proof: the word changes by ``d`` with ``0 < |d| < 2^64``, so ``d !=
0 mod 2^64``; ``H1`` moves by ``d * K1`` with ``K1`` odd, a unit of Z/2^64, so ``d * K1 != 0``;
the XOR mask is the same on both sides. Hence every single-bit change, and every change of one
element, changes the fingerprint. A different dtype name or shape changes the mask (equal only if
two sha256 prefixes of 128 bits collide: a probability, not a proof).

*Probabilistic* (several words changed, swapped elements or blocks, shifted or zeroed ranges): for
an error pattern fixed independently of the keys, with keys modelled as independent uniform odd
values (a PRF assumption), let ``v1`` (``v2``) be the least 2-adic valuation of the changed words'
differences read little- (big-) endian, i.e. the lowest changed bit, and ``L`` the number of key
factors (the D's, A, G) that take several values over the changed words (at least 1). Summing
factor by factor, each of the first ``L - 1`` sums gains ``t >= 1`` more trailing zero bits with
probability at most ``2^(1-t)``, and a sum of valuation ``w`` times the last odd factor is zero with
probability ``2^(w-63)``; so a lane misses with probability at most ``p_L(v)`` (``p_1(v) =
2^(v-63)``; ``p_L(0)`` = 2^-57, 2^-52, 2^-48, 2^-44 for L = 2..5). The lanes' keys are independent:
``P(miss) <= p_L(v1) * p_L(v2)``, about 2^-104 for typical errors in a 2-D tensor (a changed value
whose lowest bit changes: v = 0; L <= 3). Reading each word both ways bounds the worst case: a
change confined to high bits (sign, exponent) has a large ``v1`` but a small ``v2``. In one changed
word, with ``b_lo <= b_hi`` its lowest and highest changed bytes, ``v1 <= 8 b_lo + 7`` and ``v2 <=
8 (7 - b_hi) + 7``, so ``v1 + v2 <= 70`` for every pattern, which is missed with probability at most
2^-56 (L = 1), 2^-46 (L = 2), 2^-38 (L = 3: any 2-D tensor), 2^-27 (L = 5: 4-D). These bounds are
loose. Any Z/2^64-linear hash of little-endian words alone misses every pair of flipped top bits
(``2^63 * (K + K') = 0`` for odd keys): two float64 sign flips, a swap of ``x`` and ``-x``.

*Not cryptographic.* The keys are public and the function is linear: colliding tensors are easy to
build on purpose. It detects corruption and resharding mistakes, not tampering (sha256 the files).

*Cost.* Two kernels give the same bits (``fingerprint_kernel``). The compiled one (a C extension
built at install time when a compiler is there) reads each word once for both lanes, pads rows cut
mid-word in registers, uses AVX-512 or AVX2 where the CPU has them, and runs without the GIL: about
0.13-0.18 CPU-s/GB on one core here, near one memory-bound pass (``numpy.sum``: 0.09).
numpy's runs two uint64 matmul passes (about 1 ns a word and lane, the big-endian lane paying
numpy's byteswap cast) in cache-sized steps: about 0.38-0.50. Rows cost some ns more each (row
keys, contraction; numpy's padding and calls), so tensors whose last axis is only a few bytes cost
more per byte. ``benchmarks/fingerprint_kernel.py``, ``benchmarks/results/fingerprint_kernel.md``.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from math import prod
from typing import Iterator, Sequence

import numpy as np

from reshard_job.core import dtypes
from reshard_job.core import fingerprint_kernel as kernel
from reshard_job.core.boxes import Box, split_rows

ALGORITHM = "poslin64x2-v1"
LANES = 2
SEGMENT = 1 << 13  # words of a column segment: the column table A (64 KiB a lane, stays in cache)
CHUNK = 1 << 20  # bytes handled by one vectorised step: cache-sized (bigger steps run slower)
_MASK = (1 << 64) - 1
_U64 = np.uint64
_GAMMA = _U64(0x9E3779B97F4A7C15)
_M1, _M2 = _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)
_READS = ("<u8", ">u8")  # lane 1 reads words little-endian, lane 2 big-endian


@lru_cache(maxsize=None)
def _seed(lane: int, purpose: str) -> np.uint64:
    return _U64(int.from_bytes(hashlib.sha256(f"{ALGORITHM}/{lane}/{purpose}".encode()).digest()[:8], "little"))


def _odd_keys(lo: int, hi: int, lane: int, purpose: str) -> np.ndarray:
    """Odd 64-bit keys of the indices lo..hi-1: splitmix64's finaliser of i*gamma + seed, low bit set.

    A keyed mixer rather than a table, so that any index costs O(1) and no state is kept.
    """
    if hi - lo > 64 and kernel.active() == "compiled":  # many keys (a tall tensor's rows): one C loop
        return kernel.compiled_odd_keys(lo, hi, int(_seed(lane, purpose)))
    out = np.arange(lo, hi, dtype=_U64)
    seed = _seed(lane, purpose)
    if out.size <= 64:  # few keys (segments): fewer numpy calls
        z = out * _GAMMA + seed
        z = (z ^ (z >> _U64(30))) * _M1
        z = (z ^ (z >> _U64(27))) * _M2
        return (z ^ (z >> _U64(31))) | _U64(1)
    for a in range(0, out.size, SEGMENT):  # in place, in cache-sized blocks: big dims are many rows
        z = out[a:a + SEGMENT]
        z *= _GAMMA
        z += seed
        for shift, mul in ((30, _M1), (27, _M2)):
            z ^= z >> _U64(shift)
            z *= mul
        z ^= z >> _U64(31)
        z |= _U64(1)
    return out


@lru_cache(maxsize=None)
def _table(lane: int, purpose: str) -> np.ndarray:
    """The keys of indices 0..SEGMENT-1, computed once: the column table A, and a cache of the
    per-dim row keys so that small tensors (the many biases and norms) do not pay for the mixer."""
    table = _odd_keys(0, SEGMENT, lane, purpose)
    table.setflags(write=False)
    return table


def _column_table(lane: int) -> np.ndarray:
    return _table(lane, "col")


def _dim_keys(lane: int, dim: int, lo: int, hi: int) -> np.ndarray:
    purpose = f"dim{dim}"
    return _table(lane, purpose)[lo:hi] if hi <= SEGMENT else _odd_keys(lo, hi, lane, purpose)


def _column_dot(words: np.ndarray, c0: int, lane: int) -> np.ndarray:
    """``y[i] = sum_t words[i, t] * A[(c0+t) mod S] * G((c0+t) div S)`` mod 2^64, for every row i.

    One matmul per column segment that the rows cross; a single long row (a 1-D tensor) is folded
    into a (segments, S) matrix so that it too is one matmul, not a Python loop over 64 KiB pieces.
    """
    table = _column_table(lane)
    rows, width = words.shape
    seg, i = divmod(c0, SEGMENT)
    if i + width <= SEGMENT:  # the usual case: the rows lie in one segment
        y = words @ table[i:i + width]
        y *= _segment_key(lane, seg)[0]
        return y
    y = np.zeros(rows, dtype=_U64)
    t = 0
    while t < width:
        seg, i = divmod(c0 + t, SEGMENT)
        if i == 0 and rows == 1 and width - t >= 2 * SEGMENT:
            k = (width - t) // SEGMENT
            per_segment = words[0, t:t + k * SEGMENT].reshape(k, SEGMENT) @ table
            y += per_segment @ _odd_keys(seg, seg + k, lane, "segment")
            t += k * SEGMENT
            continue
        n = min(SEGMENT - i, width - t)
        part = words[:, t:t + n] @ table[i:i + n]
        part *= _segment_key(lane, seg)[0]
        y += part
        t += n
    return y


@lru_cache(maxsize=256)
def _segment_key(lane: int, seg: int) -> np.ndarray:
    key = _odd_keys(seg, seg + 1, lane, "segment")
    key.setflags(write=False)
    return key


def _row_sums(u8: np.ndarray, start: int) -> list[np.ndarray]:
    """Each lane's column sums (``_column_dot``) of rows of bytes that begin at byte `start` of
    their grid rows: the compiled kernel (both lanes in one pass, no padding copy) or numpy."""
    if kernel.active() == "compiled":
        c0, words = start // 8, max(1, -(-(start % 8 + u8.shape[1]) // 8))
        seg0, seg1 = c0 // SEGMENT, (c0 + words - 1) // SEGMENT + 1
        segments = [_segment_key(lane, seg0) if seg1 == seg0 + 1 else _odd_keys(seg0, seg1, lane, "segment")
                    for lane in range(LANES)]
        return kernel.compiled_row_sums(u8, start, [_column_table(lane) for lane in range(LANES)], segments)
    words = _words(u8, start)
    return [_column_dot(words.view(_READS[lane]), start // 8, lane) for lane in range(LANES)]


def _words(u8: np.ndarray, start: int) -> np.ndarray:
    """Rows of bytes that begin at byte `start` of their grid rows, as whole little-endian words.

    Aligned rows are viewed in place; others are copied at their phase into zeroed words: zero
    bytes weigh nothing, so the padding is exact and a run may begin or end anywhere.
    """
    phase, (count, width) = start % 8, u8.shape
    if phase == 0 and width % 8 == 0 and u8.strides[1] == 1:
        return u8.view("<u8")
    size = -(-(phase + width) // 8) * 8
    padded = np.zeros((count, size), np.uint8) if width < 256 else np.empty((count, size), np.uint8)
    if width >= 256:  # wide rows: zero only the pads, not the whole buffer
        padded[:, :phase] = 0
        padded[:, phase + width:] = 0
    # copy in the largest units that fit: narrow rows cost per element copied, not per byte
    unit = next(g for g in (8, 4, 2, 1) if (phase | width | u8.strides[0]) % g == 0) if u8.strides[1] == 1 else 1
    padded.view(f"u{unit}")[:, phase // unit:(phase + width) // unit] = u8.view(f"u{unit}")
    return padded.view("<u8")


def _box_lanes(box: Box, u8: np.ndarray, dim_keys: Sequence[Sequence[np.ndarray]]) -> list[int]:
    """Both lanes of a box of the byte grid given as (rows, bytes), rows in C order.

    The column sums give one value per row; a row's key is a product of one key per leading dim
    (`dim_keys[lane]`, over the box's ranges), so the rows are folded away by contracting one axis
    at a time: one multiply-add per row.
    """
    lanes = []
    for y, keys in zip(_row_sums(u8, box[-1][0]), dim_keys):
        y = y.reshape([hi - lo for lo, hi in box[:-1]])
        for k in reversed(keys):
            y = y @ k
        lanes.append(int(y))
    return lanes


def _range_boxes(start: int, stop: int, shape: Sequence[int]) -> Iterator[Box]:
    """The boxes, in C order, that make up the flat index range [start, stop) of an array of `shape`."""
    if start >= stop:
        return
    if len(shape) == 1:
        yield ((start, stop),)
        return
    inner = prod(shape[1:])
    (i0, r0), (i1, r1) = divmod(start, inner), divmod(stop, inner)
    if i0 == i1:
        yield from (((i0, i0 + 1),) + sub for sub in _range_boxes(r0, r1, shape[1:]))
        return
    if r0:
        yield from (((i0, i0 + 1),) + sub for sub in _range_boxes(r0, inner, shape[1:]))
        i0 += 1
    if i1 > i0:
        yield ((i0, i1),) + tuple((0, n) for n in shape[1:])
    if r1:
        yield from (((i1, i1 + 1),) + sub for sub in _range_boxes(0, r1, shape[1:]))


def _as_bytes(data, nbytes: int, itemsize: int | None) -> np.ndarray:
    """The bytes of `data` (an ndarray, taken in C order, or any bytes-like) as a flat uint8 array.

    Arrays count by their bytes (bfloat16 as raw words, ml_dtypes included); a big-endian array is
    converted to the little-endian bytes that checkpoints store. Copies only when it must.
    """
    if isinstance(data, np.ndarray):
        if itemsize is not None and data.dtype.itemsize != itemsize:
            raise ValueError(f"array itemsize {data.dtype.itemsize} != {itemsize}")
        if data.dtype.byteorder == ">":
            data = data.astype(data.dtype.newbyteorder("<"))
        data = np.ascontiguousarray(data)  # a no-op for C-ordered data
        raw = data.reshape(-1).view(np.uint8) if data.size else np.zeros(0, np.uint8)
    else:
        raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    if raw.size != nbytes:
        raise ValueError(f"{raw.size} bytes given for a part of {nbytes}")
    return raw


class Fingerprint:
    """The running fingerprint of one parameter: feed boxes or byte runs, merge parts, read the hex.

    ``Fingerprint("BFloat16", (4096, 1024))``: a MindSpore dtype name, a safetensors code such as
    ``"BF16"`` or a ``dtypes.DType`` (the digest always uses the MindSpore name, so formats agree),
    and the global shape. Opaque dtypes (Int4) need ``nbytes`` and take byte runs only. Picklable,
    so that parts computed in other processes can be merged.
    """

    def __init__(self, dtype: str | dtypes.DType, shape: Sequence[int], *, nbytes: int | None = None):
        dt = dtype if isinstance(dtype, dtypes.DType) else _lookup(dtype)
        self.dtype, self.shape = dt.name, tuple(int(n) for n in shape)
        if any(n < 0 for n in self.shape):
            raise ValueError(f"negative dim in {self.shape}")
        self.itemsize = dt.itemsize if dt.sliceable else None
        if self.itemsize is None:
            if nbytes is None:
                raise ValueError(f"{self.dtype} is opaque: give nbytes")
            self.nbytes, self._grid = int(nbytes), (int(nbytes),)
        else:
            kept = len(self.shape)
            while kept and self.shape[kept - 1] == 1:  # trailing 1s carry no layout: fold them away
                kept -= 1
            self._grid = self.shape[:max(0, kept - 1)] + ((self.shape[kept - 1] if kept else 1) * self.itemsize,)
            self.nbytes = prod(self._grid)
            if nbytes is not None and nbytes != self.nbytes:
                raise ValueError(f"nbytes {nbytes} != {self.nbytes} for {self.dtype}{list(self.shape)}")
        self.fed = 0
        self._lanes = [0] * LANES

    @property
    def complete(self) -> bool:
        """Whether exactly as many bytes were fed as the tensor holds (a count, not a coverage map)."""
        return self.fed == self.nbytes

    def add_box(self, box: Box, data) -> Fingerprint:
        """Add a box ((start, stop) per dim, global element coordinates) given its data in C order.

        `data`: an ndarray of the box's shape (any shape with the same bytes will do) or bytes-like.
        """
        grid_box = self._grid_box(box)
        raw = _as_bytes(data, prod(hi - lo for lo, hi in grid_box), self.itemsize)
        if raw.size:
            self.fed += raw.size
            self._add(grid_box, raw)
        return self

    def add_box_run(self, box: Box, offset: int, data) -> Fingerprint:
        """Add bytes ``[offset, offset + len)`` of a box's C-order data: a shard read in byte ranges
        (a ranged GET of one rank's tensor), cut anywhere, mid-element too."""
        grid_box = self._grid_box(box)
        return self._add_flat(grid_box, offset, _as_bytes(data, _nbytes(data), None))

    def add_run(self, offset: int, data) -> Fingerprint:
        """Add contiguous bytes of the flattened tensor, starting at global byte `offset`.

        A run may start and stop anywhere (mid-element too) and cross rows and dims: it is cut into
        the few boxes of the byte grid that make it up.
        """
        return self._add_flat(tuple((0, n) for n in self._grid), offset, _as_bytes(data, _nbytes(data), None))

    def merge(self, other: Fingerprint) -> Fingerprint:
        """Add the fingerprint of a disjoint part of the same parameter (in place; returns self)."""
        if not isinstance(other, Fingerprint) or self._header() != other._header():
            raise ValueError("merge needs fingerprints of the same dtype and shape")
        self._lanes = [(a + b) & _MASK for a, b in zip(self._lanes, other._lanes)]
        self.fed += other.fed
        return self

    def copy(self) -> Fingerprint:
        twin = object.__new__(Fingerprint)
        twin.__dict__.update(self.__dict__, _lanes=list(self._lanes))
        return twin

    def digest(self, *, partial: bool = False) -> bytes:
        """16 bytes; raises unless exactly `nbytes` bytes were fed (``partial=True`` skips the check)."""
        if not partial and not self.complete:
            raise ValueError(f"{self!r}: fed {self.fed} of {self.nbytes} bytes")
        lanes = self._lanes[0] | self._lanes[1] << 64
        return (lanes ^ _mask(self._header())).to_bytes(16, "little")

    def hexdigest(self, *, partial: bool = False) -> str:
        return self.digest(partial=partial).hex()

    def __repr__(self) -> str:
        return f"Fingerprint({self.dtype!r}, {self.shape}, fed={self.fed}/{self.nbytes})"

    def _header(self) -> str:
        size = f"/{self.nbytes}" if self.itemsize is None else ""
        return f"{ALGORITHM}|{self.dtype}|{','.join(map(str, self.shape))}{size}"

    def _grid_box(self, box: Box) -> Box:
        """A box in element coordinates as a box of the byte grid (trailing 1s folded away)."""
        if self.itemsize is None:
            raise ValueError(f"{self.dtype} cannot be cut into boxes; use add_run")
        box = tuple((int(lo), int(hi)) for lo, hi in box)
        if len(box) != len(self.shape) or any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, self.shape)):
            raise ValueError(f"box {box} is not inside shape {self.shape}")
        if any(lo == hi for lo, hi in box):
            return tuple((0, 0) for _ in self._grid)
        lead = box[:len(self._grid) - 1]
        row = box[len(lead)] if len(box) > len(lead) else (0, 1)
        return lead + ((row[0] * self.itemsize, row[1] * self.itemsize),)

    def _add_flat(self, outer: Box, offset: int, raw: np.ndarray) -> Fingerprint:
        """Add bytes at `offset` of the C-order bytes of `outer`, a box of the byte grid."""
        offset, extents = int(offset), [hi - lo for lo, hi in outer]
        if offset < 0 or offset + raw.size > prod(extents):
            raise ValueError(f"run [{offset}, {offset + raw.size}) outside the {prod(extents)} bytes of {outer}")
        self.fed += raw.size
        pos = 0
        for box in _range_boxes(offset, offset + raw.size, extents):
            n = prod(hi - lo for lo, hi in box)
            self._add(tuple((lo + o, hi + o) for (lo, hi), (o, _) in zip(box, outer)), raw[pos:pos + n])
            pos += n
        return self

    def _add(self, box: Box, raw: np.ndarray) -> None:
        """Add a box of the byte grid whose bytes, in C order, are `raw`, in steps of a bounded size:
        CHUNK bytes for numpy (its copies stay in cache); the compiled kernel copies nothing, so its
        steps are longer (fewer calls): up to 16 * CHUNK bytes, but at most CHUNK // 8 rows unless
        CHUNK bytes hold more (its per-row sums take 16 bytes a row)."""
        keys = [[_dim_keys(lane, d, lo, hi) for d, (lo, hi) in enumerate(box[:-1])] for lane in range(LANES)]
        width = box[-1][1] - box[-1][0]
        step = CHUNK if kernel.active() == "numpy" else min(16 * CHUNK, max(CHUNK, CHUNK // 8 * width))
        if raw.size <= step:
            self._accumulate(_box_lanes(box, raw.reshape(-1, width), keys))
            return
        extents = [hi - lo for lo, hi in box]
        cube = raw.reshape(extents)
        for piece in split_rows(box, prod(extents[1:]), step):
            local = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(piece, box))
            rows = cube[local].reshape(-1, piece[-1][1] - piece[-1][0])
            self._accumulate(_box_lanes(piece, rows, [[k[s] for k, s in zip(lane, local)] for lane in keys]))

    def _accumulate(self, lanes: Sequence[int]) -> None:
        self._lanes = [(a + b) & _MASK for a, b in zip(self._lanes, lanes)]


@lru_cache(maxsize=4096)
def _mask(header: str) -> int:
    return int.from_bytes(hashlib.sha256(header.encode()).digest()[:16], "little")


def _lookup(name: str) -> dtypes.DType:
    for find in (dtypes.lookup, dtypes.from_safetensors):
        try:
            return find(name)
        except KeyError:
            pass
    raise ValueError(f"unknown dtype {name!r}")


def _nbytes(data) -> int:
    return data.nbytes if isinstance(data, np.ndarray) else memoryview(data).nbytes


def fingerprint_array(dtype: str | dtypes.DType, array: np.ndarray) -> str:
    """The hex fingerprint of a whole tensor held in memory (its shape is the global shape); a NumPy
    scalar is taken as the 0-d array it stands for (an ``ml_dtypes`` scalar exports no buffer)."""
    array = np.asarray(array)
    return Fingerprint(dtype, array.shape).add_box(tuple((0, n) for n in array.shape), array).hexdigest()

