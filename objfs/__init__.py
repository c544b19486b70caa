"""objfs: mount an object-store bucket/prefix as a read-only POSIX directory.

How objfs is built
==================

Layers, from the kernel down:

1. **FUSE transports** turn kernel requests into calls on the core: ``kernel/`` (objfs's own:
   ``protocol.py`` the wire codec, ``session.py`` one reader thread, writer threads for READ
   replies, passthrough) and ``fuse_ops.py`` (the pyfuse3 fallback, the only place that raises
   ``FUSEError``).
2. **The core** (``fs.py``, no FUSE): lookups and listings, read assembly, random reads and
   the stale-but-available policy over the version model of ``inodes.py`` (nodes, versions
   pinned by ETag, handles). ``readahead.py`` decides what each
   stream wants next, ``scheduler.py`` fetches it and writes it behind to disk,
   ``block_cache.py`` owns the memory tier (its byte budget and block buffers), ``disk_cache/``
   the disk tier, ``singleflight.py`` shares concurrent misses.
3. **Backends** (``backends/``: ``base.py`` the interface, ``s3.py``, ``azure.py``, ``account.py``
   for a whole account, ``memory.py`` for tests): metadata through the SDKs, data GETs through
   ``rawhttp.py`` straight into block buffers, retries in ``retry.py``, a shared cache engine in
   ``cache_engine.py``.
4. **Around them**: ``cli.py`` and ``config.py`` (options, exit codes), ``mount.py`` (lifecycle),
   ``metrics.py`` and ``status.py``, ``warm.py``, ``torch_io.py``, and the deployment glue
   (``mount_helper.py`` for fstab, ``sidecar.py``, ``sidecar_fd.py``, ``fdpass.py``, ``csi/``).

Who owns what: the core's state (inodes, handles, streams, the block cache's index and budget)
lives on the trio thread and is changed only there; a check and the reply that depends on it
happen with no ``await`` between them. Worker threads do blocking work only: a backend request
(received into buffers the trio thread reserved for it), a disk-cache read or write, a FUSE
reply's ``writev``. Every byte of the memory budget has one owner at a time (a fetch's
reservation, a live block, or a reply being assembled) and is given back exactly once.

Tests: ``tests/test_*_core.py``, ``test_core_properties.py`` and the other FUSE-free tests run
the core against the in-memory backend (stateful property tests for caches and schedulers);
``test_backend_contract.py`` runs every backend against real servers on 127.0.0.1 (moto and
Azurite; ``test_seaweedfs.py`` reruns the mount and fault tests on SeaweedFS); the mount tests
run real FUSE mounts served by child processes; the fleet test runs nodes in network namespaces;
``tests/benchmarks/`` measures (never asserts) speed.

Read-ahead and memory, in more detail
-------------------------------------

Read-ahead follows each sequential stream of each open file, up to 16 per file, and the handles
that have one file open share its streams: several processes reading one file (forked workers,
tensor-parallel ranks that each read their part of every tensor) continue each other's streams,
so ranks that together sweep a file are one stream with a growing window, not four that restart
at every tensor. A stream begun by a random read is continued only by the handle that began it,
so random readers side by side never look sequential together. A window starts at 1 MiB and
doubles with every sequential read, up to half the memory budget, shared among the open handles
and then among a file's streams. ``*.safetensors`` files, which every loader reads whole, are
fetched ahead from the moment they are opened. A block already served to the kernel is never
fetched ahead again (the page cache holds it), and a queued part its stream has overtaken is
trimmed. A random read that no tier holds fetches only the 64 KiB-aligned range around it and
leaves it to the kernel's page cache; a block on the disk tier is served from there. A reader
that needs a block whose read-ahead part is still queued takes that block out of the part and
fetches it at once. Concurrent misses of one block (or one random range), from any handle or
process, share one GET.

Memory has one owner at a time: every byte of the budget belongs to a fetch in flight (its
reservation, given back exactly once, whatever happens), to a live block (cached, or evicted
while the disk writer still holds it), or to a reply being assembled (a read across blocks whose
buffers are not adjacent, a random read fetched around the cache: these have a share of the
budget, a sixteenth of it between 1 and 16 MiB, and wait when it is full). Block buffers are
slots of one arena, and a fetch takes adjacent slots for its part, so most reads across two
blocks (88% of a load's reads: the kernel's requests are not block-aligned) are answered with
one view of both, without a copy (``served.spanned`` and ``served.assembled`` in ``objfs status
--json``). The arena asks the kernel for transparent huge pages (``MADV_HUGEPAGE``; it gets them
where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``): every byte
is pinned by the kernel page by page twice, by the socket receive or the disk cache's
``O_DIRECT`` read and by the FUSE reply, and with 2 MiB pages a cold load took about 1,000 page
faults in the daemon instead of 66,000 (measured below). Read-ahead waits for memory instead of
evicting a block a reader has not read to its end, so the daemon stays within its budget; a
reader's own fetch never waits on read-ahead. When the last handle of a file closes, its queued
read-ahead is cancelled and its unread blocks are evicted before anything else (a loader that
opens a shard for its header and again for its data still finds them). Blocks already read are
kept only up to a quarter of the budget: the kernel's page cache holds them. They go least
recently used first, but one the disk-cache writer still holds stays (evicting it would free no
memory, and another reader that needs it before it is on disk would fetch it from the store
again), and one already on disk goes before an older one that is not.

"""

__version__ = "0.1.0"
