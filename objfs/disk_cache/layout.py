"""The disk tier's on-disk format (v4): where a version's two files live and what a block
table holds. Pure functions and constants; no state.

Contract:

* A version (namespace = endpoint and bucket, key, ETag, block size) is named by the SHA-256
  of those inputs, its ``digest`` (``version``). Its files are in ``DIR/v4/XY/`` (``XY``: the
  digest's first two hex digits, so no directory grows huge): the data file ``<digest>``,
  sparse, block ``i`` at offset ``i * block_size`` (a multiple of ``PAGE``, so every block
  starts page-aligned for O_DIRECT; an object's last block is never padded: the file ends
  where the object does, see ``blockio.py``), and the block table ``<digest>.idx``.
* The table: a header naming the digest's inputs (``HEADER``: magic ``OBJFSIX4``, format 4,
  block size, entry size, then namespace, key and ETag), padded to a page, then one 16-byte
  entry per block at ``table_offset + 16 * i`` (``ENTRY``): the data's length (u32), its
  XXH3-64 (u64) and a check (u32), the low 32 bits of the XXH3-64 of (index u64, length u32,
  data hash u64), all little-endian. The header page's last ``STAMP.size`` bytes may hold the
  record of a version verified whole (see ``stamp.py``); zeros there mean it was not.
* ``decode_entry`` is the one reading of an entry: all zeros (a hole) or cut short means "not
  present", tested before any check, so a zero entry is never taken for a block whatever its
  check would say (and ``encode_entry`` never writes all zeros: a length is at least 1). Any other
  entry whose check fails is garbled.

XXH3-64 (the ``xxhash`` package: any buffer as it is, the GIL released) misses a random
corruption with probability 2^-64. It is not a cryptographic hash: it catches damage, not
someone who can write the directory (which is why that is private, see ``directory.py``).

The table is a file of its own rather than a region of the data file: the data stays at
``i * block_size`` with no bound on the number of blocks; the table is written buffered, one
entry's 16 bytes at a time (two processes filling neighbouring entries both land), while the
data is written O_DIRECT (but for an object's last partial page), and the two modes never share
an inode's locks and page-cache invalidation; and the table (16 bytes per MiB) stays in the
page cache.
"""

from __future__ import annotations

import glob
import hashlib
import mmap
import os
import struct
from collections.abc import Sequence
from typing import NamedTuple

import xxhash

BlockData = bytes | bytearray | memoryview

FORMAT = "v4"  # the subdirectory of this on-disk format
OLD_FORMATS = ("v1", "v2", "v3")  # earlier formats' subdirectories, removed on start
MAGIC = b"OBJFSIX4"  # first bytes of a table file: tells it from a foreign file
FORMAT_NUMBER = 4  # in the header too, should the magic ever be kept across a change
# Table header: magic, format, block size, entry size, byte lengths of namespace, key and ETag
# (the digest's inputs follow, so a header names exactly one version).
HEADER = struct.Struct("<8sIIIIII")
# Table entry: data length, XXH3-64 of the data, check (the low 32 bits of the XXH3-64 of
# (index, length, data hash)). 16 bytes: a power of two, so an entry never straddles a page
# and is written in one piece.
ENTRY = struct.Struct("<IQI")
_ENTRY_CHECK = struct.Struct("<QIQ")  # what an entry's check covers: its block's index too
NO_ENTRY = bytes(ENTRY.size)  # a hole: "not present", tested before any check
# A version verified whole for passthrough (see stamp.py): the data file's inode and size and
# the XXH3-64 of its table, in the last bytes of the table file's header page.
STAMP = struct.Struct("<8sQQQ")
STAMP_MAGIC = b"OBJFSOK1"
# The page: the table starts on one (the header alone in its page), data blocks start on one,
# and O_DIRECT needs buffers, offsets and lengths in whole pages (4096 covers every device).
PAGE = 4096
DIGEST_LENGTH = 64  # hex digits of a SHA-256


class BlockLocation(NamedTuple):
    """Where a block lives (for tests and tools)."""

    data_path: str
    data_offset: int
    index_path: str
    entry_offset: int


class Version(NamedTuple):
    digest: str
    header: bytes  # the table file's expected header, exactly
    table_offset: int
    data_path: str
    index_path: str


class TableEntry(NamedTuple):
    """A table entry that is not a hole (see ``decode_entry``)."""

    length: int
    data_hash: int
    intact: bool  # its check matches: else garbled, never a block


def version(root: str, namespace: str, key: str, etag: str, block_size: int) -> Version:
    """The digest, expected table header and file paths of a version under ``root``
    (``DIR/v4``)."""
    ident = "\0".join((namespace, key, etag, str(block_size)))
    digest = hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()
    parts = [s.encode("utf-8", "surrogateescape") for s in (namespace, key, etag)]
    header = HEADER.pack(
        MAGIC, FORMAT_NUMBER, block_size, ENTRY.size, *(len(p) for p in parts)
    ) + b"".join(parts)
    data_path = os.path.join(root, digest[:2], digest)
    return Version(digest, header, round_up(len(header), PAGE), data_path, data_path + ".idx")


def entry_check(index: int, length: int, data_hash: int) -> int:
    """An entry's check: the low 32 bits of the XXH3-64 of (index, length, data hash). Only
    for entries that are not all zeros (a hole is tested for first, never checked)."""
    return xxhash.xxh3_64_intdigest(_ENTRY_CHECK.pack(index, length, data_hash)) & 0xFFFF_FFFF


def encode_entry(index: int, length: int, data_hash: int) -> bytes:
    return ENTRY.pack(length, data_hash, entry_check(index, length, data_hash))


def decode_entry(raw: bytes, index: int) -> TableEntry | None:
    """Entry ``index``, from its bytes ``raw`` as read from the table: None when it is a hole
    (all zeros) or cut off (the table ends before it), tested before any check; else its
    length and data hash and whether its check matches."""
    if len(raw) < ENTRY.size or raw == NO_ENTRY:
        return None
    length, data_hash, check = ENTRY.unpack(raw)
    return TableEntry(length, data_hash, check == entry_check(index, length, data_hash))


def listed(entries: bytes, first: int, lengths: Sequence[int]) -> list[bool]:
    """For blocks ``first``, ``first + 1``, ... whose entries ``entries`` holds as read from
    the table (cut short where the table ends), whether each is listed present, intact and
    of its length in ``lengths``."""
    out = []
    for n, length in enumerate(lengths):
        found = decode_entry(entries[n * ENTRY.size : (n + 1) * ENTRY.size], first + n)
        out.append(found is not None and found.intact and found.length == length)
    return out


def block_hash(data: BlockData | mmap.mmap) -> int:
    """XXH3-64 of ``data``'s bytes: bytes, bytearray, mmap or memoryview, read-only or
    writable, hashed in place (xxhash takes the buffer as it is, and releases the GIL). A
    view of any format or shape hashes as its bytes in order; only a non-contiguous view
    (which no block is) is copied first."""
    if isinstance(data, bytes):
        return xxhash.xxh3_64_intdigest(data)
    view = memoryview(data)
    if not view.c_contiguous:
        return xxhash.xxh3_64_intdigest(view.tobytes())
    return xxhash.xxh3_64_intdigest(byte_view(view))


def byte_view(data: BlockData) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cached_blocks(directory: str) -> int:
    """How many blocks the tables under ``directory`` (a --cache-dir) list as present, for
    tests and tools. Not checked against the data: a block counted may still turn out
    damaged when read."""
    count = 0
    for path in glob.glob(os.path.join(directory, FORMAT, "??", "*.idx")):
        with open(path, "rb") as f:
            raw = f.read()
        if len(raw) < HEADER.size or raw[:8] != MAGIC:
            continue
        *_, ns, key, etag = HEADER.unpack_from(raw)
        offset = round_up(HEADER.size + ns + key + etag, PAGE)
        for at in range(offset, len(raw) - ENTRY.size + 1, ENTRY.size):
            found = decode_entry(raw[at : at + ENTRY.size], (at - offset) // ENTRY.size)
            count += found is not None and found.intact
    return count
