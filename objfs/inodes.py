"""The version model: the inodes, handles and attributes that objfs's core serves.

A file :class:`Node` is one version of one object: its key, ETag, size and mtime never change
once made; a newer version gets a new node (the old one is ``superseded``). A :class:`Handle`
is an open file pinned to one version, so its reads always return that version's bytes or an
error. Directories are nodes too; their entries come from :class:`Listing` s. Plain data:
:mod:`objfs.namespace` (nodes, listings, probes) and :mod:`objfs.fs` (handles) own and change
them, on the trio thread; the scheduler and the read path only name them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from objfs.readahead import Readahead

ROOT_INODE = 1  # FUSE's fixed root inode number
NAME_MAX = 255  # bytes, the Linux limit for one path component


@dataclass(slots=True, eq=False)
class Node:
    """A directory, or one version of a file (its attributes never change)."""

    inode: int
    parent: int
    name: bytes
    key: str  # the object key for a file; the prefix ("" or ending in "/") for a directory
    is_dir: bool
    size: int = 0
    etag: str = ""
    mtime_ns: int = 0
    # Monotonic time at which a request that saw this version current (or this directory
    # existing) started.
    checked_at: float = -float("inf")
    superseded: bool = False  # a newer version of the key is known (or the key is gone)
    big: bool = False  # a directory whose listing takes more than one page
    lookups: int = 0  # the kernel's references (entries answered, minus forgotten)
    opens: int = 0  # open handles
    # The read-ahead state its open handles share (None while none is open).
    readahead: Readahead | None = None
    # One byte per block: 1 once the block was served whole to the kernel (its page cache
    # holds it now, so read-ahead need not fetch it again). Allocated at the first open, not
    # when the node is listed: a listed key costs O(1) memory whatever its size.
    served: bytearray = field(default_factory=bytearray)


@dataclass(slots=True)
class Probe:
    """A name looked up without a fresh listing of its directory: its node, or None."""

    node: Node | None
    checked_at: float


@dataclass(slots=True)
class Listing:
    """One directory level: name -> node, in the store's (sorted) order."""

    entries: dict[bytes, Node]
    fetched_at: float


@dataclass
class Handle:
    """An open file, pinned to one object version."""

    fh: int
    node: Node
    key: str
    etag: str
    size: int
    readahead: Readahead
    served: bytearray  # the node's, for this version (see Node.served)
    fetches: bool = True  # False: the kernel reads the disk tier's file itself (passthrough)


@dataclass
class DirHandle:
    fh: int
    node: Node
    entries: list[Node] = field(default_factory=list)


@dataclass(frozen=True)
class Attributes:
    """What ``stat`` shows; the FUSE layer copies it into ``EntryAttributes``."""

    inode: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    blksize: int


def posix_name(name: str) -> bytes | None:
    """Return the file name for a key segment, or None if POSIX cannot hold it."""
    if name in ("", ".", "..") or "\0" in name or "/" in name:
        return None
    encoded = name.encode("utf-8", "surrogateescape")
    if len(encoded) > NAME_MAX:
        return None
    return encoded
