"""Persistent on-disk tier of blocks, kept across unmount and restart (format v4).

Invariant: a block is returned only if its table entry is intact, its length is the one the
caller expects and the data file's bytes at its offset have the entry's XXH3-64: a crash, a
torn write, a truncated file or a damaged table or data gives a miss (the block is fetched
again), never wrong bytes but for a chance of 2^-64. The versions' files in the directory
allocate at most the size cap, whichever processes share it. A failing disk is a miss, then
turns the tier off: objfs goes on without it.

Sharing: several objfs processes may share one directory, and fetch each block once between them
(``fetching.py``). Identical blocks written twice are harmless (the same bytes at the same
offsets, the same entry); eviction counts and evicts the others' versions too. The directory is
private (0700, files 0600).

Modules, each with its own contract:

* ``layout.py``: the on-disk format (file names, table header and entries, the hash).
* ``directory.py``: the private directory; table files created whole, versions removed.
* ``versions.py``: ``VersionStore``, the index of versions, the open files, the lock and the
  error policy.
* ``blockio.py``: ``BlockIO``, verified block reads and writes, O_DIRECT, and the table read
  without waiting (``listed_now``) that spares a cold load's fetches a thread each.
* ``ledger.py`` and ``space.py``: ``SpaceKeeper``, the size cap shared by processes, the
  free-space floor and eviction.
* ``stamp.py``: the record of a version verified whole, for FUSE passthrough.
* ``fetching.py``: ``FetchLocks``, which blocks the processes sharing the directory are
  fetching, so that each block is fetched once between them.
* ``cache.py``: ``DiskCache`` (``BlockIO`` and ``SpaceKeeper`` over one ``VersionStore``),
  the interface.
"""

from __future__ import annotations

from objfs.disk_cache.cache import DiskCache
from objfs.disk_cache.layout import BlockData, BlockLocation, cached_blocks

__all__ = ["BlockData", "BlockLocation", "DiskCache", "cached_blocks"]
