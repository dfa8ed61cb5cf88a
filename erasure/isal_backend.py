"""ISA-L Reed-Solomon (``isa_l_rs_vand``) called directly through ctypes.

The pyeclib wheel bundles Intel's ISA-L (``pyeclib.libs/libisal*.so``). pyeclib's own
``ECDriver.encode`` copies the block into fresh aligned buffers, prepends an 80-byte fragment
header of its own and hands back new ``bytes`` for every fragment; each of those allocations
page-faults under glibc's default settings (see :mod:`erasure.allocator`). Calling
ISA-L's two kernels ourselves lets parity land straight in reused buffers and lets a decode
write the lost shards straight into the caller's output. The coding matrix is the one
liberasurecode's ``isa_l_rs_vand`` uses (``gf_gen_rs_matrix``), so our payloads are
byte-identical to pyeclib's fragment payloads; the tests check that.

The Vandermonde matrix is not MDS for every (k, m): some k-subsets of the shards cannot be
inverted. ISA-L documents where it is safe; :func:`check_vand_k_m` enforces that region
(5+6, 22+4 and 4+22 each have a singular subset; liberasurecode accepts them anyway).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path

from erasure.errors import CodecError

_TABLE_BYTES_PER_COEFFICIENT = 32  # ec_init_tables expands each GF(2^8) coefficient to 32 B


def check_vand_k_m(k: int, m: int) -> None:
    """Raise ValueError unless every k-subset of a k+m Vandermonde code is decodable."""
    n = k + m
    if k <= 3 or m <= 3 or (k == 4 and n <= 25) or (k == 5 and n <= 10) or (k <= 21 and m == 4):
        return
    raise ValueError(
        f"ISA-L's Vandermonde code cannot decode every {k}-subset of {n} shards "
        f"(k={k}, m={m}); it is safe for m <= 3, for m == 4 with k <= 21, for k <= 3, "
        "for k == 4 with k+m <= 25 and for k == 5 with k+m <= 10. Choose such k and m "
        "(the default is k=10, m=2) or backend 'zfec', which is MDS for any k+m <= 256"
    )


def _library_candidates() -> list[str]:
    spec = importlib.util.find_spec("pyeclib")
    found: list[str] = []
    if spec is not None and spec.origin is not None:
        package_dir = Path(spec.origin).parent
        for pattern in ("pyeclib.libs/libisal*.so*", "pyeclib/.dylibs/libisal*.dylib"):
            found += sorted(str(p) for p in package_dir.parent.glob(pattern))
    system = ctypes.util.find_library("isal")
    return [*found, system] if system else found


@functools.cache
def load_isal() -> ctypes.CDLL:
    """ISA-L from the pyeclib wheel (or the system); ValueError with advice if absent."""
    for path in _library_candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        _declare(lib)
        return lib
    raise ValueError(
        "ISA-L was not found (looked in the pyeclib wheel's pyeclib.libs and the system "
        "library path): `pip install pyeclib` from a binary wheel, or use codec backend 'zfec'"
    )


def _declare(lib: ctypes.CDLL) -> None:
    int_, ptr = ctypes.c_int, ctypes.c_void_p
    lib.gf_gen_rs_matrix.argtypes = [ptr, int_, int_]
    lib.gf_gen_rs_matrix.restype = None
    lib.gf_invert_matrix.argtypes = [ptr, ptr, int_]
    lib.gf_invert_matrix.restype = int_
    lib.ec_init_tables.argtypes = [int_, int_, ptr, ptr]
    lib.ec_init_tables.restype = None
    lib.ec_encode_data.argtypes = [int_, int_, int_, ptr, ptr, ptr]
    lib.ec_encode_data.restype = None


def isal_version() -> str:
    """ISA-L's version string ("unknown" for builds older than 2.31, which lack the call)."""
    get_version = getattr(load_isal(), "isal_get_version_str", None)
    if get_version is None:
        return "unknown"
    get_version.restype = ctypes.c_char_p
    return get_version().decode()


@functools.cache
def _encode_matrix(k: int, m: int) -> bytes:
    """(k+m) x k coefficients, row-major: identity on top, Vandermonde parity rows below."""
    matrix = (ctypes.c_ubyte * ((k + m) * k))()
    load_isal().gf_gen_rs_matrix(matrix, k + m, k)
    return bytes(matrix)


def _tables(k: int, coefficient_rows: bytes) -> ctypes.Array[ctypes.c_ubyte]:
    num_rows = len(coefficient_rows) // k
    tables = (ctypes.c_ubyte * (_TABLE_BYTES_PER_COEFFICIENT * k * num_rows))()
    load_isal().ec_init_tables(k, num_rows, coefficient_rows, tables)
    return tables


@functools.lru_cache(maxsize=4096)
def _decode_tables(
    k: int, m: int, source_ids: tuple[int, ...], wanted_ids: tuple[int, ...]
) -> ctypes.Array[ctypes.c_ubyte]:
    """Tables that turn the k payloads ``source_ids`` into the data payloads ``wanted_ids``."""
    encode = _encode_matrix(k, m)
    square = ctypes.c_ubyte * (k * k)
    sub = square.from_buffer_copy(b"".join(encode[i * k : (i + 1) * k] for i in source_ids))
    inverse = square()
    if load_isal().gf_invert_matrix(sub, inverse, k) != 0:
        raise CodecError(f"shards {list(source_ids)} of a {k}+{m} code form a singular matrix")
    rows = bytes(inverse)
    return _tables(k, b"".join(rows[i * k : (i + 1) * k] for i in wanted_ids))


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (stable ABI since 3.11)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_PyBUF_SIMPLE = 0
# Indexing gives private function objects: attribute access would share (and let other code
# re-declare) the ones cached on ctypes.pythonapi.
_get_buffer = ctypes.pythonapi["PyObject_GetBuffer"]
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi["PyBuffer_Release"]
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def buffer_address(view: memoryview) -> int:
    """Where a memoryview's bytes start.

    The view itself keeps its exporter from being resized or freed while it lives, and the
    callers hold their views across the ISA-L call (which runs without the GIL), so the
    export taken here to read the address can be released at once. ctypes reads writable
    buffers directly; the buffer protocol covers read-only ones such as ``bytes``.
    """
    if not view.nbytes:
        return 0  # nothing is read or written through it
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    exported = _PyBuffer()
    _get_buffer(view, exported, _PyBUF_SIMPLE)
    address: int = exported.buf
    _release_buffer(exported)
    return address


def _row_addresses(regions: Sequence[memoryview], row_bytes: int) -> ctypes.Array[ctypes.c_void_p]:
    """Addresses of the consecutive ``row_bytes``-byte rows of every region, in order."""
    rows = []
    for region in regions:
        start = buffer_address(region)
        rows += range(start, start + region.nbytes, row_bytes)
    return (ctypes.c_void_p * len(rows))(*rows)


class IsalBackend:
    """Parity and reconstruction with ISA-L; every output goes into a caller's buffer."""

    def __init__(self, k: int, m: int) -> None:
        check_vand_k_m(k, m)
        self.k, self.m = k, m
        self._lib = load_isal()
        self._encode_tables = _tables(k, _encode_matrix(k, m)[k * k :]) if m else None

    def encode_parity(
        self, data: Sequence[memoryview], parity: memoryview, payload_len: int
    ) -> None:
        """Write the m parity payloads after each other into ``parity``.

        The k data payloads are the consecutive ``payload_len``-byte rows of the ``data``
        regions, in order (a few regions cost less to address than k payloads).
        """
        srcs = _row_addresses(data, payload_len)
        dests = _row_addresses([parity], payload_len)
        self._lib.ec_encode_data(payload_len, self.k, self.m, self._encode_tables, srcs, dests)

    def reconstruct(
        self,
        sources: Mapping[int, memoryview],
        wanted_ids: Sequence[int],
        out: Sequence[memoryview],
    ) -> None:
        """Write data payloads ``wanted_ids`` into ``out`` from exactly k ``sources``."""
        source_ids = tuple(sorted(sources))
        tables = _decode_tables(self.k, self.m, source_ids, tuple(wanted_ids))
        payload_len = sources[source_ids[0]].nbytes
        srcs = _row_addresses([sources[i] for i in source_ids], payload_len)
        dests = _row_addresses(out, payload_len)
        self._lib.ec_encode_data(payload_len, self.k, len(out), tables, srcs, dests)
