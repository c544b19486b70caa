"""objfs's own FUSE transport: the kernel's FUSE protocol spoken directly over ``/dev/fuse``.

Modules: ``protocol`` (fuse.h's numbers), ``requests`` (parsing), ``replies`` (building),
``negotiation`` (the INIT answer), ``mounting`` (the ``/dev/fuse`` fd: mount(2),
``fusermount3``, unmounting), ``session`` (:class:`~objfs.kernel.session.KernelSession`: the
reader thread and dispatch), ``writers`` (reply writes, READ writer threads), ``read_turns``
(READs enter the core in arrival order), ``passthrough`` (backing files per open inode).

What the README's "FUSE transports" says in short, in full (the user's view of each mode):

- **``kernel``** (the default): objfs's own implementation of the FUSE protocol
  (``objfs/kernel/``), without libfuse. It mounts with mount(2) as root, through ``fusermount3``
  otherwise, or serves a passed ``/dev/fd/N``, and answers every request with the same bytes and
  errnos as the pyfuse3 transport. What it adds: the INIT reply asks for what the kernel offers
  of ``ASYNC_READ``, ``PARALLEL_DIROPS``, READDIRPLUS and ``MAX_PAGES`` (requests up to 8 MiB;
  as root objfs first raises the ``fs.fuse.max_pages_limit`` sysctl to 2048 pages if it is
  lower, and logs it: the sysctl only caps what each FUSE file system may ask for) and carries
  ``max_background`` itself; READ replies are written by 4 threads outside the GIL (a reply
  across cached blocks is one ``writev`` of the blocks themselves), so the copy into the page
  cache no longer runs on the thread that serves every request. The log's ``FUSE transport
  kernel: protocol 7.N, ...`` line and ``objfs status`` (``fuse`` line; ``--json``: ``fuse``)
  show what was negotiated. ``make test`` runs the whole suite on it, and CI the vLLM end-to-end
  test.
- **``pyfuse3``** (the fallback): libfuse 3.14 through pyfuse3, the original binding. Every
  reply, and so every copy of served bytes into the page cache, runs on the one thread that also
  runs all of objfs's Python; no passthrough, 1 MiB requests. ``make test`` runs the mount,
  fault and CSI suites on it too, and CI the vLLM test.
- **Passthrough** (kernel transport, Linux 6.9+, ``--cache-dir``, CAP_SYS_ADMIN): an open of a
  file whose version is whole in the disk cache is answered with a backing file, and the kernel
  then serves ``read()`` and ``mmap()`` from the cache file itself: the daemon does no work per
  byte (a remount, a pod restarted on the same node, ``objfs warm --cache-only`` followed by a
  load, ``objfs.torch_io`` on such a file). The kernel checks no hash, so a version is offered
  only once every one of its blocks was checked against its hash: blocks a mount wrote were
  hashed before they went out, and blocks it read from the disk cache were checked as they were
  read; a version they cover whole is recorded as checked in its table file when the mount ends
  and after ``objfs warm`` (the data is synced first). A version not recorded (its writer was
  killed, or two processes wrote it) is read and verified before its first passthrough open (the
  log says ``checking ... before its first passthrough``); a damaged block is dropped, the file
  is served by normal reads, which repair it, and a later mount uses passthrough. The record is
  voided by a dropped block or a replaced file; damage to the disk after it is not seen by
  passthrough reads (as with any local file), while normal reads still check every block. An
  inode already served by normal reads on this mount stays so (its bytes are in the page cache).
  The kernel is handed the very descriptor that was checked, never a path opened again. A file
  never grows past its object's size and a listed block is never written again, so another
  mount sharing the cache directory cannot change the bytes under a passthrough reader. Opens
  of one version that arrive together wait for one check, which runs on threads of its own (not
  the disk-read limiter). A passthrough open is a use for eviction (least recently used goes
  first). A replaced object gets its own file; eviction unlinks a file, and open handles go on
  reading it. If the daemon dies, handles opened by passthrough go on reading their file; new
  opens fail with ``ENOTCONN``. A cache directory on overlayfs or ecryptfs (a container's root)
  makes INIT ask for ``max_stack_depth`` 2, so that the kernel takes its files (the mount itself
  then cannot sit under another stacking file system). Without CAP_SYS_ADMIN (the unprivileged
  CSI sidecar) or on an older kernel, one log line says why and reads are normal; a backing file
  the kernel refuses for a reason that holds for every file (a deeper stack: ELOOP) turns
  passthrough off for the mount with one warning. ``objfs status`` counts the opens served this
  way (``passthrough_opens``) and says why passthrough was turned off (``passthrough_refused``).
"""
