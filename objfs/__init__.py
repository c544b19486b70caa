"""objfs: mount an object-store bucket/prefix as a read-only POSIX directory.

How objfs is built
==================

Layers, from the kernel down (each module's docstring states its contract):

1. **FUSE transports** turn kernel requests into calls on the core. ``kernel/`` is objfs's own:
   ``protocol.py`` (the numbers), ``requests.py`` and ``replies.py`` (the codec, no I/O),
   ``negotiation.py`` (INIT), ``mounting.py`` (the fd), ``session.py`` (one reader thread and
   dispatch), ``read_turns.py`` (READs in arrival order), ``writers.py`` (READ replies on writer
   threads), ``passthrough.py`` (backing ids). ``fuse_ops.py`` is the pyfuse3 fallback, the only
   place that raises ``FUSEError``.
2. **The core**, free of FUSE. ``fs.py`` (``FileSystem``, the facade: handles, open, read,
   warm) over ``inodes.py`` (the version model: nodes, versions pinned by ETag, handles),
   ``namespace.py`` (the inode table, listings, attributes), ``availability.py`` (the
   stale-but-available rule) and ``reads.py`` (a read turned into blocks and a reply).
   ``readahead.py`` decides what each stream wants next, ``scheduler.py`` fetches it,
   ``write_behind.py`` writes fetched blocks to disk and backfills, ``block_cache.py`` owns the
   memory tier (its byte budget; ``buffer_pool.py`` its block buffers), ``disk_cache/`` the
   disk tier,
   ``singleflight.py`` shares concurrent misses, ``wakeup.py`` is the one wake-up primitive.
3. **Backends** (``backends/``: ``base.py`` the interface; ``s3.py`` with ``s3_client.py``,
   ``s3_signing.py``, ``s3_errors.py``; ``azure.py`` with ``azure_auth.py`` (credentials and
   signing), ``azure_client.py``, ``azure_errors.py``; ``account.py`` for a whole account;
   ``memory.py`` for tests): metadata through the SDKs, data GETs through ``rawhttp.py``
   straight into block buffers, retries in ``retry.py``, a shared cache engine in
   ``cache_engine.py``.
4. **Around them**: ``options.py`` (every option, declared once, and the one translation of
   mount options for every front end) and ``config.py`` (the checked values); ``cli.py`` (the
   command, imported by nothing but ``__main__``); ``mount.py`` (serving) with
   ``mountpoint.py``, ``daemon.py``, ``logsetup.py``, ``kernel_setup.py``; ``metrics.py``,
   ``store_metrics.py``, ``status_files.py`` and ``status.py``; ``warm.py``; ``torch_io.py``
   with ``safetensors_header.py`` and ``torch_pipeline.py``; and the deployment glue
   (``mount_helper.py`` for fstab, ``sidecar.py``, ``sidecar_fd.py``, ``fdpass.py``, ``csi/``:
   ``node.py`` the gRPC side, ``publication.py`` the state machine, ``offers.py``,
   ``state.py``, ``volume.py``, ``fusemount.py``).

Who owns what: the core's state (inodes, handles, streams, the block cache's index and budget,
the write-behind queue) lives on the trio thread and is changed only there; a check and the
reply that depends on it happen with no ``await`` between them (``ReadPath._from_memory`` is
synchronous for that reason). Worker threads do blocking work only: a backend request (received
into buffers the trio thread reserved for it), a disk-cache read or write, a FUSE reply's
``writev``. Every byte of the memory budget has one owner at a time (a fetch's reservation, a
live block, or a reply being assembled) and is given back exactly once.

Tests: ``tests/test_*_core.py``, ``test_core_properties.py`` and the other FUSE-free tests run
the core against the in-memory backend (stateful property tests for caches and schedulers);
``test_backend_contract.py`` runs every backend against real servers on 127.0.0.1 (moto and
Azurite; ``test_seaweedfs.py`` reruns the mount and fault tests on SeaweedFS); the mount tests
run real FUSE mounts served by child processes; the fleet test runs nodes in network namespaces;
``test_structure.py`` keeps the package free of import circles and of modules over 700 lines;
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
budget, a sixteenth of it between 1 and 16 MiB, and wait when it is full). The default budget
grows while a large file is open several times (times the opens of large files, at most 4 times
and a quarter of memory), since tensor-parallel ranks each read their part of every tensor and
the parts fetched for the slower ranks wait in memory; it never steps down while two large
handles are open (ranks move from shard to shard), and back at its base, once one is left, it
evicts what no open handle will read and gives the grown slots' memory back after 2 s there
(a budget that dropped for an instant would fault it in again). Block buffers are slots of one
arena, and a fetch takes adjacent slots for its part, so most reads across two blocks (the
kernel's requests are not block-aligned) are answered with one view of both, without a copy
(``served.spanned`` and ``served.assembled`` in ``objfs status --json``). The arena asks the
kernel for transparent huge pages (``MADV_HUGEPAGE``; it gets them where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``): every byte is
pinned by the kernel page by page twice, by the socket receive or the disk cache's ``O_DIRECT``
read and by the FUSE reply, so 2 MiB pages save most of the daemon's page faults (figures in
tests/benchmarks/README.md). Read-ahead waits for memory instead of evicting a block a reader
has not read to its end, so the daemon stays within its budget; a reader's own fetch never waits
on read-ahead. When the last handle of a file closes, its queued read-ahead is cancelled and its
unread blocks are evicted before anything else (a loader that opens a shard for its header and
again for its data still finds them). Blocks already read are kept only up to a quarter of the
budget: the kernel's page cache holds them. They go least recently used first, but one the
disk-cache writer still holds stays (evicting it would free no memory, and another reader that
needs it before it is on disk would fetch it from the store again), and one already on disk goes
before an older one that is not.

"""

__version__ = "0.1.0"
