"""The key/value section of a GGUF file, read without ``gguf.GGUFReader`` (model identity
needs only this, spec §5).

Why not ``gguf.GGUFReader``: it parses every metadata array element into its own numpy view,
so a Qwen-sized vocabulary (152k tokens + 150k merges + scores + types) takes ~8 s before the
first key can be read. This module walks that section itself (memory-mapped, with the
``gguf`` package's type codes and enums): scalar arrays are skipped in O(1), string arrays
with one length read per element, and tensor data is never touched.
``tests/model/test_identity.py`` cross-checks the parsed values against ``GGUFReader``.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import xxhash

from ..wire.hashing import format_tag

_VT = gguf.GGUFValueType
_SCALAR_FORMATS: dict[int, str] = {
    _VT.UINT8: "B",
    _VT.INT8: "b",
    _VT.UINT16: "H",
    _VT.INT16: "h",
    _VT.UINT32: "I",
    _VT.INT32: "i",
    _VT.FLOAT32: "f",
    _VT.BOOL: "?",
    _VT.UINT64: "Q",
    _VT.INT64: "q",
    _VT.FLOAT64: "d",
}
_INT_TYPES = frozenset(
    {_VT.UINT8, _VT.INT8, _VT.UINT16, _VT.INT16, _VT.UINT32, _VT.INT32, _VT.UINT64, _VT.INT64}
)
_SUPPORTED_VERSIONS = (2, 3)  # what gguf.GGUFReader reads


@dataclass(frozen=True, slots=True)
class MetaArray:
    """An array value left in the file: element type, count and byte range of the elements."""

    elem_type: int
    count: int
    start: int
    end: int


class GgufMeta:
    """Key/value section of a memory-mapped GGUF file (no tensor data is read)."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        self.size = len(mm)
        if self.size < 24 or struct.unpack_from("<I", mm, 0)[0] != gguf.GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        # Files written on a big-endian host have every number swapped, the magic excepted.
        for bo in ("<", ">"):
            if struct.unpack_from(bo + "I", mm, 4)[0] in _SUPPORTED_VERSIONS:
                break
        else:
            raise ValueError(f"unsupported GGUF version {struct.unpack_from('<I', mm, 4)[0]}")
        self.bo = bo
        self._u32 = struct.Struct(bo + "I")
        self._u64 = struct.Struct(bo + "Q")
        self.tensor_count, kv_count = struct.unpack_from(bo + "QQ", mm, 8)
        self.scalars: dict[str, Any] = {}  # scalars and strings decoded; arrays as MetaArray
        off = 24
        for _ in range(kv_count):
            key_bytes, off = self._read_bytes(off)
            key = key_bytes.decode("utf-8", "replace")
            vtype = self._u32.unpack_from(mm, off)[0]
            value, off = self._read_value(vtype, off + 4)
            if key in self.scalars:
                raise ValueError(f"duplicate key {key!r}")  # as GGUFReader and llama.cpp
            self.scalars[key] = value
        self.tensor_info_offset = off

    def _read_bytes(self, off: int) -> tuple[bytes, int]:
        n = self._u64.unpack_from(self.mm, off)[0]
        end = off + 8 + n
        if end > self.size:
            raise ValueError("truncated string")
        return self.mm[off + 8 : end], end

    def _read_value(self, vtype: int, off: int) -> tuple[Any, int]:
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is not None:
            size = struct.calcsize(fmt)
            return struct.unpack_from(self.bo + fmt, self.mm, off)[0], off + size
        if vtype == _VT.STRING:
            raw, off = self._read_bytes(off)
            return raw.decode("utf-8", "replace"), off
        if vtype == _VT.ARRAY:
            elem_type = self._u32.unpack_from(self.mm, off)[0]
            count = self._u64.unpack_from(self.mm, off + 4)[0]
            start = off + 12
            end = self._skip_elements(elem_type, count, start)
            return MetaArray(elem_type, count, start, end), end
        raise ValueError(f"unknown GGUF value type {vtype}")

    def _skip_elements(self, elem_type: int, count: int, off: int) -> int:
        """Offset just past ``count`` elements of ``elem_type`` starting at ``off``."""
        fmt = _SCALAR_FORMATS.get(elem_type)
        if fmt is not None:
            end = off + count * struct.calcsize(fmt)
        elif elem_type == _VT.STRING:
            # The one per-element loop: a length read per string (tokens, merges).
            unpack, mm, size = self._u64.unpack_from, self.mm, self.size
            for _ in range(count):
                off += 8 + unpack(mm, off)[0]
                if off > size:
                    break
            end = off
        elif elem_type == _VT.ARRAY:
            for _ in range(count):
                sub_type = self._u32.unpack_from(self.mm, off)[0]
                sub_count = self._u64.unpack_from(self.mm, off + 4)[0]
                off = self._skip_elements(sub_type, sub_count, off + 12)
            end = off
        else:
            raise ValueError(f"unknown GGUF array element type {elem_type}")
        if end > self.size:
            raise ValueError("truncated array")
        return end

    # Typed accessors: a key holding another type reads as absent.

    def get_str(self, key: str) -> str | None:
        value = self.scalars.get(key)
        return value if isinstance(value, str) else None

    def get_int(self, key: str) -> int | None:
        value = self.scalars.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def get_array(self, key: str, elem_types: Iterable[int]) -> MetaArray | None:
        value = self.scalars.get(key)
        if isinstance(value, MetaArray) and value.elem_type in set(elem_types):
            return value
        return None

    def iter_raw_strings(self, arr: MetaArray) -> Iterable[bytes]:
        off = arr.start
        for _ in range(arr.count):
            raw, off = self._read_bytes(off)
            yield raw

    def get_str_list(self, key: str) -> list[str] | None:
        arr = self.get_array(key, (_VT.STRING,))
        if arr is None:
            return None
        return [raw.decode("utf-8", "replace") for raw in self.iter_raw_strings(arr)]

    def canonical_strings(self, arr: MetaArray) -> bytes:
        """Elements as u64-LE-length-prefixed UTF-8: for a little-endian file, the raw bytes."""
        if self.bo == "<":
            return self.mm[arr.start : arr.end]
        return b"".join(len(s).to_bytes(8, "little") + s for s in self.iter_raw_strings(arr))

    def int_array(self, arr: MetaArray) -> np.ndarray:
        dtype = np.dtype(_SCALAR_FORMATS[arr.elem_type]).newbyteorder(self.bo)
        # Slice copies out of the mmap, so no buffer export outlives the map.
        return np.frombuffer(self.mm[arr.start : arr.end], dtype=dtype, count=arr.count)

    def tensor_types(self) -> list[tuple[int, int, int]]:
        """(ggml type, n_dims, n_elements) of every tensor, from the tensor info section."""
        out: list[tuple[int, int, int]] = []
        off = self.tensor_info_offset
        for _ in range(self.tensor_count):
            _name, off = self._read_bytes(off)
            n_dims = self._u32.unpack_from(self.mm, off)[0]
            if n_dims > 8:
                raise ValueError(f"tensor with {n_dims} dimensions")
            dims = struct.unpack_from(f"{self.bo}{n_dims}Q", self.mm, off + 4)
            off += 4 + 8 * n_dims
            ggml_type = self._u32.unpack_from(self.mm, off)[0]
            off += 4 + 8  # type, data offset
            out.append((ggml_type, n_dims, math.prod(dims)))
        return out


def tokenizer_digest(meta: GgufMeta) -> str:
    """``xxh3:<16 hex>`` over token list, merges and token types (spec §5, ours).

    Encoding (stable, unambiguous): a version tag; then per section its name, NUL, and either
    0x00 (absent, or not an array of the right type) or 0x01 + u64-LE count + elements.
    Strings are u64-LE byte length + UTF-8 bytes; token types are little-endian i32.
    """
    h = xxhash.xxh3_64()
    h.update(b"hydra-trio/tokenizer-hash/v1\x00")
    for label, key in (("tokens", "tokenizer.ggml.tokens"), ("merges", "tokenizer.ggml.merges")):
        h.update(label.encode() + b"\x00")
        arr = meta.get_array(key, (_VT.STRING,))
        if arr is None:
            h.update(b"\x00")
            continue
        h.update(b"\x01" + arr.count.to_bytes(8, "little"))
        h.update(meta.canonical_strings(arr))
    h.update(b"token_type\x00")
    types = meta.get_array("tokenizer.ggml.token_type", _INT_TYPES)
    if types is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + types.count.to_bytes(8, "little"))
        h.update(meta.int_array(types).astype("<i4").tobytes())
    return format_tag(h.intdigest())


def _file_type_name(value: int) -> str:
    try:
        name = gguf.LlamaFileType(value).name
    except ValueError:
        return f"unknown({value})"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def model_quant(meta: GgufMeta) -> str:
    """Name of ``general.file_type``; without one (or GUESSED), the dominant weight type."""
    file_type = meta.get_int("general.file_type")
    if file_type is not None and file_type != gguf.LlamaFileType.GUESSED:
        return _file_type_name(file_type)
    # Most elements among ≥2-D tensors: 1-D norms stay F32 whatever the quantisation.
    totals: dict[int, int] = {}
    for ggml_type, n_dims, n_elements in meta.tensor_types():
        if n_dims >= 2:
            totals[ggml_type] = totals.get(ggml_type, 0) + n_elements
    if not totals:
        return "unknown"
    dominant = max(totals, key=lambda t: (totals[t], -t))
    try:
        return gguf.GGMLQuantizationType(dominant).name
    except ValueError:
        return f"unknown(type {dominant})"
