"""Safetensors headers and files, without torch: validation, and which files a path names.

:func:`read_header` parses and validates one file's header here, not with the ``safetensors``
package: a malformed file raises ``ValueError`` naming the file and the problem before any
large allocation happens; a valid one is a :class:`SafetensorsHeader` whose guarantees (every
tensor inside the data region, no overlaps, sizes matching dtype and shape, file order) the
readers of :mod:`objfs.torch_pipeline` rely on. :func:`resolve_safetensors_files` turns a file,
a folder, an index json or a list of those into the ordered list of shards.
"""

from __future__ import annotations

import errno
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

PathArg = str | os.PathLike[str]
PathsArg = PathArg | Iterable[PathArg]

# The safetensors format caps its JSON header at 100 MB; anything larger is corrupt or hostile
# and must not make us allocate that much before we notice.
MAX_HEADER_BYTES: Final = 100_000_000

# The 8-byte little-endian unsigned header length that starts every safetensors file.
_LEN_PREFIX: Final = 8

# Index file written by transformers' save_pretrained next to the shards of a sharded model.
INDEX_NAME: Final = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class _DType:
    """A safetensors dtype code: the torch attribute that holds it and its size in bits."""

    torch_name: str | None  # None: valid safetensors dtype with no torch equivalent
    bits: int


# Every dtype of the safetensors format.  F4 stores two 4-bit values per byte; torch represents
# it as float4_e2m1fn_x2, whose last dimension is half the safetensors one.  The F6 formats have
# no torch dtype at all and are rejected with a clear message.
DTYPES: Final[dict[str, _DType]] = {
    "BOOL": _DType("bool", 8),
    "U8": _DType("uint8", 8),
    "I8": _DType("int8", 8),
    "U16": _DType("uint16", 16),
    "I16": _DType("int16", 16),
    "U32": _DType("uint32", 32),
    "I32": _DType("int32", 32),
    "U64": _DType("uint64", 64),
    "I64": _DType("int64", 64),
    "F16": _DType("float16", 16),
    "BF16": _DType("bfloat16", 16),
    "F32": _DType("float32", 32),
    "F64": _DType("float64", 64),
    "C64": _DType("complex64", 64),
    "F8_E4M3": _DType("float8_e4m3fn", 8),
    "F8_E4M3FNUZ": _DType("float8_e4m3fnuz", 8),
    "F8_E5M2": _DType("float8_e5m2", 8),
    "F8_E5M2FNUZ": _DType("float8_e5m2fnuz", 8),
    "F8_E8M0": _DType("float8_e8m0fnu", 8),
    "F4": _DType("float4_e2m1fn_x2", 4),
    "F6_E2M3": _DType(None, 6),
    "F6_E3M2": _DType(None, 6),
}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a validated header.

    ``shape`` is the shape as stored in the file (for ``F4`` it counts 4-bit values);
    ``start`` is the absolute file offset of its first byte and ``nbytes`` its byte length.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """A validated safetensors header.

    Guarantees: every tensor's bytes lie inside ``[data_start, file_size)``, no two non-empty
    tensors overlap, ``nbytes`` matches dtype and shape, and ``tensors`` is sorted by ``start``
    (file order).  ``metadata`` is the optional ``__metadata__`` string map.
    """

    path: str
    file_size: int
    data_start: int
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str] | None


def _bad(path: str, problem: str) -> ValueError:
    return ValueError(f"{path}: not a valid safetensors file: {problem}")


def _short(value: object) -> str:
    """repr() cut to a readable length for error messages about hostile input."""
    text = repr(value)
    # 80 characters show the offending value without flooding a log line.
    return text if len(text) <= 80 else text[:77] + "..."


def _pread_exact(fd: int, length: int, offset: int, path: str) -> bytes:
    """Read exactly ``length`` bytes at ``offset``; a short file is a ``ValueError``."""
    chunks: list[bytes] = []
    while length > 0:
        chunk = os.pread(fd, length, offset)
        if not chunk:
            raise _bad(path, f"unexpected end of file at offset {offset}")
        chunks.append(chunk)
        length -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {_short(key)}")
        result[key] = value
    return result


def _is_int(value: object) -> bool:
    # bool is an int subclass; JSON true/false must not pass as a dimension or offset.
    return type(value) is int


def parse_header(fd: int, path: str, file_size: int) -> SafetensorsHeader:
    """The validated header of the open file ``fd`` (``path`` names it in errors)."""
    if file_size < _LEN_PREFIX:
        raise _bad(path, f"file is {file_size} bytes, shorter than the 8-byte header length")
    header_len = int.from_bytes(_pread_exact(fd, _LEN_PREFIX, 0, path), "little")
    if header_len > MAX_HEADER_BYTES:
        raise _bad(path, f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
    data_start = _LEN_PREFIX + header_len
    if data_start > file_size:
        raise _bad(
            path,
            f"header length {header_len} runs past the end of the file ({file_size} bytes)",
        )
    raw = _pread_exact(fd, header_len, _LEN_PREFIX, path)
    try:
        parsed = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeError are ValueErrors
        raise _bad(path, f"header is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise _bad(path, f"header is a JSON {type(parsed).__name__}, not an object")

    data_len = file_size - data_start
    metadata: dict[str, str] | None = None
    tensors: list[TensorEntry] = []
    for name, info in parsed.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise _bad(path, f"__metadata__ must map strings to strings, got {_short(info)}")
            metadata = dict(info)
            continue
        tensors.append(_parse_entry(path, name, info, data_start, data_len))

    tensors.sort(key=lambda t: (t.start, t.nbytes))
    previous: TensorEntry | None = None
    for entry in tensors:
        if entry.nbytes == 0:
            continue  # occupies no bytes, overlaps nothing
        if previous is not None and entry.start < previous.start + previous.nbytes:
            a, b = previous.start - data_start, entry.start - data_start
            raise _bad(
                path,
                f"tensors {previous.name!r} (data_offsets [{a}, {a + previous.nbytes}]) and "
                f"{entry.name!r} (data_offsets [{b}, {b + entry.nbytes}]) overlap",
            )
        previous = entry
    return SafetensorsHeader(path, file_size, data_start, tuple(tensors), metadata)


def _parse_entry(path: str, name: str, info: object, data_start: int, data_len: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise _bad(path, f"entry {name!r} is {_short(info)}, not an object")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _bad(path, f"tensor {name!r} has unknown dtype {_short(dtype)}")
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _bad(
            path, f"tensor {name!r} shape must be a list of non-negative integers: {_short(shape)}"
        )
    offsets = info.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise _bad(
            path, f"tensor {name!r} data_offsets must be [begin, end] integers: {_short(offsets)}"
        )
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise _bad(
            path,
            f"tensor {name!r} data_offsets [{begin}, {end}] are outside the "
            f"{data_len}-byte data region",
        )
    bits = math.prod(shape) * DTYPES[dtype].bits
    if bits % 8 or bits // 8 != end - begin:
        needs = f"{bits // 8} bytes" if bits % 8 == 0 else f"{bits} bits (not whole bytes)"
        raise _bad(
            path,
            f"tensor {name!r} of dtype {dtype} and shape {_short(shape)} needs {needs} "
            f"but data_offsets [{begin}, {end}] hold {end - begin} bytes",
        )
    if DTYPES[dtype].bits == 4 and (not shape or shape[-1] % 2):
        raise _bad(
            path, f"tensor {name!r}: F4 needs an even last dimension to pack 2 values per byte"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, end - begin)


def read_header(path: PathArg) -> SafetensorsHeader:
    """Read and validate the header of one safetensors file (no torch needed).

    Raises ``ValueError`` (message starts with the path) for any malformed header and
    ``OSError`` if the file cannot be opened or read.
    """
    name = os.fspath(path)
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return parse_header(fd, name, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _files_from_index(index_path: str) -> list[str]:
    try:
        with open(index_path, "rb") as f:
            index = json.load(f)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{index_path}: index is not valid JSON: {exc}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path}: index has no weight_map of tensor name -> shard file")
    folder = os.path.dirname(index_path)
    shards: list[str] = []
    for shard in sorted(set(weight_map.values())):
        parts = shard.replace("\\", "/").split("/")
        if os.path.isabs(shard) or ".." in parts or not shard:
            raise ValueError(f"{index_path}: shard {shard!r} is not a path inside the model folder")
        shards.append(os.path.join(folder, shard))
    if not shards:
        raise ValueError(f"{index_path}: weight_map is empty")
    return shards


def _expand_one(path: str) -> list[str]:
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if os.path.isfile(index):
            return _files_from_index(index)
        found = sorted(
            os.path.join(path, n)
            for n in os.listdir(path)
            if n.endswith(".safetensors") and os.path.isfile(os.path.join(path, n))
        )
        if not found:
            raise FileNotFoundError(f"{path}: no *.safetensors files and no {INDEX_NAME}")
        return found
    if path.endswith(".json"):
        return _files_from_index(path)
    return [path]


def resolve_safetensors_files(paths: PathsArg) -> list[str]:
    """Turn the ``paths`` argument of the loaders into an ordered list of safetensors files.

    ``paths`` is a file, a directory, an index json (``model.safetensors.index.json``), or an
    iterable of those.  A directory with an index yields the shards its ``weight_map`` names
    (sorted); without one, its ``*.safetensors`` files (sorted).  Duplicates are dropped, order
    is otherwise kept.  A listed file (or index shard) that does not exist raises
    ``FileNotFoundError``.
    """
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    result: list[str] = []
    seen: set[str] = set()
    for item in items:
        name = os.fspath(item)
        for file in _expand_one(name):
            if not os.path.isfile(file):
                raise FileNotFoundError(
                    errno.ENOENT,
                    "no such safetensors file" + (f" (listed by {name})" if file != name else ""),
                    file,
                )
            key = os.path.abspath(file)
            if key not in seen:
                seen.add(key)
                result.append(file)
    return result
