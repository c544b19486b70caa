"""KernelSession: one FUSE connection served by objfs itself over ``/dev/fuse``, without libfuse.

A sibling of :mod:`objfs.fuse_ops` (the pyfuse3 transport) over the same FUSE-free
:class:`~objfs.fs.FileSystem`, selected with ``--fuse-transport kernel``. The fd is a passed
one (``/dev/fd/N``, mounted by another process: the CSI sidecar) or one
:mod:`objfs.kernel.mounting` mounted. The kernel's INIT is answered before anything else
(:mod:`objfs.kernel.negotiation`, :mod:`objfs.kernel.passthrough`); what it settled is logged
and kept in :attr:`KernelSession.negotiated` (``objfs status`` shows it).

Threads: one reader thread waits in ``poll`` on the fd and a wake-up pipe (so :meth:`stop`
ends it at once, even while files stay open on a detached mount) and hands every request to
the trio thread (``run_sync_soon``, which never blocks it) in the order the kernel queued
them. The trio thread runs each handler as a task against the core, and stays the only owner
of the core's state. A READ's reply goes to :class:`~objfs.kernel.writers.ReplyWriters`
(written outside the GIL; the core keeps its bytes valid until then through
``FileSystem.read(holds=...)``); other replies are small and written by the trio thread.
Every reply goes to the fd its request was read from.

Invariants (tested against recorded request bytes and real mounts):

* every request that expects a reply gets exactly one, on its own fd: FORGET, BATCH_FORGET and
  INTERRUPT get none; a handler's error becomes its errno (objfs errors their own, anything
  unexpected EIO with its traceback in the log), and a request that cannot be parsed gets EIO
  (or nothing if not even its header can be read): a bad request never ends the mount;
* mutations answer EROFS, what libfuse answers ENOSYS for (no handler) answers ENOSYS, as with
  the pyfuse3 transport;
* RELEASE, RELEASEDIR, FORGET and BATCH_FORGET are answered on arrival, in arrival order
  (:meth:`KernelSession._arrived`), so an OPEN after a close sees its release; READs enter the
  core in arrival order (:class:`~objfs.kernel.read_turns.ReadTurns`);
* INTERRUPT cancels the request it names while it runs, which then answers EINTR: a request's
  cancel scope is registered when it arrives (:meth:`KernelSession._arrived`), before its task
  starts, and an INTERRUPT is handled on arrival too, so one that arrives right behind its
  request always finds it. An INTERRUPT that names no request in flight gets no reply: the
  kernel sends one only for a request already read, and with one reader the request arrives
  first, so the request has been answered already;
* the loop ends cleanly on unmount (ENODEV), DESTROY or :meth:`stop`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import struct
import threading
from collections.abc import Callable, Sequence

import trio

from objfs.config import MountConfig
from objfs.errors import ObjectNotFoundError, ObjfsError
from objfs.fs import FileSystem
from objfs.inodes import Attributes
from objfs.kernel import mounting
from objfs.kernel import protocol as p
from objfs.kernel import replies as rp
from objfs.kernel import requests as rq
from objfs.kernel.memory_reads import MemoryReads
from objfs.kernel.negotiation import MAX_WRITE, Negotiated, log_negotiated, negotiate
from objfs.kernel.passthrough import (
    BrokerRegistrar,
    OpenInodes,
    backing_stack_depth,
    passthrough_refusal,
)
from objfs.kernel.read_turns import ReadTurns
from objfs.kernel.writers import Holds, ReplyWriters, give_back, write_reply
from objfs.nursery import open_nursery

log = logging.getLogger(__name__)

# The size every read buffer must have (80 + max_write, at least 8 KiB).
_READ_BUFFER = max(p.MIN_READ_BUFFER, 80 + MAX_WRITE)
# Requests that modify the tree: EROFS.
_MUTATIONS = frozenset(
    {
        p.Opcode.SETATTR,
        p.Opcode.SYMLINK,
        p.Opcode.MKNOD,
        p.Opcode.MKDIR,
        p.Opcode.UNLINK,
        p.Opcode.RMDIR,
        p.Opcode.RENAME,
        p.Opcode.RENAME2,
        p.Opcode.LINK,
        p.Opcode.WRITE,
        p.Opcode.CREATE,
        p.Opcode.SETXATTR,
        p.Opcode.REMOVEXATTR,
        p.Opcode.FALLOCATE,
        p.Opcode.TMPFILE,
        p.Opcode.COPY_FILE_RANGE,
    }
)
# Requests that get no reply.
_NO_REPLY = frozenset({p.Opcode.FORGET, p.Opcode.BATCH_FORGET, p.Opcode.INTERRUPT})
# Requests answered as they arrive, without a task (see KernelSession._arrived).
_AT_ONCE = frozenset(
    {
        p.Opcode.RELEASE,
        p.Opcode.RELEASEDIR,
        p.Opcode.FORGET,
        p.Opcode.BATCH_FORGET,
        p.Opcode.INTERRUPT,
    }
)


class KernelSession:
    """One FUSE connection served by objfs itself. ``mount()``, then ``await serve()`` until
    unmounted or :meth:`stop`; ``close()`` at the end. Same attributes as the pyfuse3
    adapter for metrics: ``initialized``, ``bytes_served``, ``reads``."""

    def __init__(self, fs: FileSystem, config: MountConfig, passed_fd: int | None) -> None:
        self.fs = fs
        self.config = config
        self.timeout_s = fs.config.kernel_timeout_s()
        self.initialized = trio.Event()
        self._bytes_served = 0
        self._reads = 0
        self.negotiated = Negotiated()
        self._passed_fd = passed_fd
        self._fd = -1
        # The kernel's cap on pages per request, as this connection was made with (a passed
        # fd's mount was made by another process: the cap as it stands now).
        self._pages_limit = mounting.max_pages_limit()
        self._mounted_here = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._writers = ReplyWriters()
        self._inflight: dict[int, trio.CancelScope] = {}
        self._done = trio.Event()
        # An `objfs sidecar` child registers backing files through the node plugin's broker.
        self._broker = BrokerRegistrar.from_environment()
        self._inodes = OpenInodes(self._broker)
        self.passthrough = False  # negotiated (see _answer_init)
        self.passthrough_opens = 0
        self._turns = ReadTurns()  # READs enter the core in arrival order
        # READs answered from memory with no task (the reader thread's, on arrival).
        self.memory = MemoryReads(fs, self._writers, self._turns)

    @property
    def bytes_served(self) -> int:
        return self._bytes_served + self.memory.bytes_served

    @property
    def reads(self) -> int:
        return self._reads + self.memory.reads_in_reader + self.memory.reads_on_arrival

    @property
    def reads_in_reader(self) -> int:
        return self.memory.reads_in_reader

    @property
    def reads_on_arrival(self) -> int:
        return self.memory.reads_on_arrival

    @property
    def passthrough_refused(self) -> str | None:
        """Why the kernel refused a backing file for good (passthrough off since), or None."""
        return self._inodes.refused

    # -- mounting ------------------------------------------------------------------------

    def mount(self) -> None:
        """Mount (or take the passed fd). Raises MountFailedError with a one-line reason."""
        if self._passed_fd is not None:
            self._fd = self._passed_fd
            return
        self._pages_limit = mounting.raise_max_pages_limit()
        self._fd = mounting.mount(self.config)
        self._mounted_here = True

    # -- serving -------------------------------------------------------------------------

    async def serve(self) -> None:
        """Answer INIT, then serve until the mount goes away, DESTROY or :meth:`stop`."""
        token = trio.lowlevel.current_trio_token()
        if not await trio.to_thread.run_sync(self._init, abandon_on_cancel=True):
            return
        self.initialized.set()
        core = self.memory.core
        trio.lowlevel.add_instrument(core)
        core.lock.acquire()  # this very step's end releases it
        try:
            async with open_nursery() as nursery:

                def spawn(fd: int, data: bytes) -> None:
                    self._arrived(nursery, fd, data)

                self._writers.start(token)
                t = threading.Thread(
                    target=self._reader,
                    args=(self._fd, token, spawn),
                    name="objfs-fuse",
                    daemon=True,
                )
                t.start()
                self._threads.append(t)
                await self._done.wait()
                nursery.cancel_scope.cancel()
        finally:
            self.memory.closed = True  # under the lock: this step holds it
            trio.lowlevel.remove_instrument(core)
            core.lock.release()  # this step's start took it; its end no longer will

    def _arrived(self, nursery: trio.Nursery, fd: int, data: bytes) -> None:
        """(trio thread) Where every request read goes, in arrival order: callbacks of
        run_sync_soon run in order, so requests are seen here in the order they arrived.
        Releases and forgets are answered at once: they never wait, and an OPEN that follows
        a close must see its release (passthrough needs an inode with no cached-mode open;
        trio may start tasks spawned together in either order), and an INTERRUPT must find
        the request it names. READs are numbered: see ReadTurns. Every other request becomes
        a task, its cancel scope registered here, before the task starts (an INTERRUPT read
        right behind it would otherwise find nothing to cancel)."""
        opcode = struct.unpack_from("<I", data, 4)[0] if len(data) >= 8 else -1
        if opcode in _AT_ONCE:
            self._answer_at_once(fd, data)
            return
        if opcode == p.Opcode.READ:
            self.memory.arrived += 1
            if self._turns.idle() and self.memory.on_arrival(fd, data):
                return
        seq = self._turns.number() if opcode == p.Opcode.READ else None
        scope = None
        if len(data) >= p.IN_HEADER_SIZE and opcode not in _NO_REPLY:
            scope = self._inflight[struct.unpack_from("<Q", data, 8)[0]] = trio.CancelScope()
        nursery.start_soon(self._handle, fd, data, seq, scope)

    def _poller(self, fd: int) -> select.poll:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        return poller

    def _read_one(self, fd: int, buf: bytearray, poller: select.poll) -> bytes | None:
        """(Thread) One request from ``fd``; None when the connection is gone or on stop.
        A read is tried first (the fd does not block): under load a request is waiting, and
        the poll is needed only when none is."""
        ready = True
        while not self._stopping.is_set():
            if not ready:
                events = dict(poller.poll())
                if self._wake_r in events:
                    return None
                if events.get(fd, 0) & (select.POLLERR | select.POLLHUP):
                    return None
            ready = False
            try:
                n = os.readv(fd, [buf])
            except BlockingIOError:
                continue  # none yet, or another reader took it
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    continue  # the request was interrupted before it was read
                if exc.errno != errno.ENODEV:
                    log.error("FUSE: reading /dev/fuse failed (%s); stopping", exc)
                return None
            return bytes(buf[:n])
        return None

    def _init(self) -> bool:
        """(Thread) Read and answer the kernel's INIT; False if the connection ended first."""
        os.set_blocking(self._fd, False)
        buf = bytearray(_READ_BUFFER)
        poller = self._poller(self._fd)
        while True:
            data = self._read_one(self._fd, buf, poller)
            if data is None:
                return False
            try:
                request = rq.parse(data)
            except rq.ProtocolError as exc:
                log.error("FUSE: a malformed request before INIT (%s)", exc)
                continue
            if request.header.opcode != p.Opcode.INIT or not isinstance(request.args, rq.Init):
                write_reply(self._fd, [rp.reply_error(request.header.unique, errno.EIO)])
                continue
            init = request.args
            if init.major > p.KERNEL_VERSION:
                # A newer major: answer ours only; the kernel sends INIT again.
                ours = rp.reply(request.header.unique, struct.pack("<II", 7, 0))
                write_reply(self._fd, [ours])
                continue
            if init.major < p.KERNEL_VERSION:
                write_reply(self._fd, [rp.reply_error(request.header.unique, errno.EPROTO)])
                return False
            self._answer_init(request.header.unique, init)
            return True

    def _answer_init(self, unique: int, init: rq.Init) -> None:
        why_not = passthrough_refusal(
            init, has_disk_cache=self.fs.disk is not None, brokered=self._broker is not None
        )
        if why_not is not None:
            log.info("FUSE passthrough off: %s", why_not)
        self.passthrough = why_not is None
        depth = 0
        if self.passthrough and self.fs.disk is not None:
            depth = backing_stack_depth(self.fs.disk.root)
            if depth:
                log.info(
                    "FUSE passthrough: the disk cache is on a stacking file system "
                    "(overlayfs or ecryptfs): backing files one level deeper "
                    "(max_stack_depth %d)",
                    depth + 1,
                )
        payload, negotiated = negotiate(
            init,
            pages_limit=self._pages_limit,
            max_background=self.config.max_background,
            passthrough=self.passthrough,
            backing_depth=depth,
        )
        write_reply(self._fd, [rp.reply(unique, payload)])
        self.negotiated = negotiated
        log_negotiated(negotiated)

    def _reader(self, fd: int, token: trio.lowlevel.TrioToken, spawn: Callable[..., None]) -> None:
        """(Thread) Move requests from ``fd`` to the trio thread until the connection ends."""
        buf = bytearray(_READ_BUFFER)
        try:
            with contextlib.suppress(OSError):
                os.set_blocking(fd, False)
            poller = self._poller(fd)
            while True:
                data = self._read_one(fd, buf, poller)
                if data is None:
                    break
                is_read = len(data) >= 8 and struct.unpack_from("<I", data, 4)[0] == p.Opcode.READ
                if is_read and self.memory.in_reader(fd, data, token):
                    continue
                try:
                    if is_read:
                        self.memory.handed += 1
                    token.run_sync_soon(spawn, fd, data)
                except trio.RunFinishedError:
                    break
        finally:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._done.set)

    def stop(self) -> None:
        """End the readers (thread-safe; the mount is removed by :meth:`close`)."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    async def _handle(
        self,
        fd: int,
        data: bytes,
        seq: int | None = None,
        scope: trio.CancelScope | None = None,
    ) -> None:
        """Parse one request, run its handler, write its reply (see the invariants). ``seq``:
        the number of a READ (see ReadTurns), given up if the READ never takes its turn.
        ``scope``: the request's cancel scope, registered in ``_inflight`` on arrival (None:
        registered here, for a request that did not come through ``_arrived``)."""
        unique = struct.unpack_from("<Q", data, 8)[0] if len(data) >= p.IN_HEADER_SIZE else None
        if scope is None and unique is not None:
            scope = self._inflight.setdefault(unique, trio.CancelScope())
        try:
            await self._handle_request(fd, data, seq, scope or trio.CancelScope())
        finally:
            if seq is not None:
                self._turns.give_up(seq)
            if unique is not None and self._inflight.get(unique) is scope:
                del self._inflight[unique]

    async def _handle_request(
        self, fd: int, data: bytes, seq: int | None, scope: trio.CancelScope
    ) -> None:
        try:
            request = rq.parse(data)
        except rq.ProtocolError as exc:
            log.error("FUSE: a malformed request (%s): answering EIO", exc)
            if len(data) >= p.IN_HEADER_SIZE:
                unique = struct.unpack_from("<Q", data, 8)[0]
                write_reply(fd, [rp.reply_error(unique, errno.EIO)])
            return
        header = request.header
        op = header.opcode
        if op in _NO_REPLY:
            self._no_reply(request)
            return
        reply: Sequence[bytes | bytearray | memoryview]
        with scope:
            try:
                if op == p.Opcode.READ and isinstance(request.args, rq.Read):
                    await self._read(fd, header.unique, request.args, seq)
                    return
                reply = await self._dispatch(request)
            except ObjfsError as exc:
                log.log(exc.log_level, "%s: %s", _name(op), exc)
                reply = [rp.reply_error(header.unique, exc.errno)]
            except Exception:
                log.exception("unexpected error in %s; answering EIO", _name(op))
                reply = [rp.reply_error(header.unique, errno.EIO)]
        if scope.cancelled_caught:
            if self._stopping.is_set():
                return
            reply = [rp.reply_error(header.unique, errno.EINTR)]
        write_reply(fd, reply)
        if op == p.Opcode.DESTROY:
            self._done.set()

    async def _read(self, fd: int, unique: int, args: rq.Read, seq: int | None) -> None:
        """A READ: the bytes from the core, held until a writer thread wrote the reply."""
        holds: Holds = []
        if seq is not None:
            await self._turns.take(seq)
        reading = self.fs.read(args.fh, args.offset, args.size, holds=holds)
        if seq is not None:
            # The next READ may run once this one suspends: by then it has entered the core
            # (awaiting the coroutine runs it up to its first suspension).
            self._turns.done(seq)
        try:
            data = await reading
        except BaseException:
            give_back(holds)
            raise
        reply, nbytes = rp.data_reply(unique, data)
        self._bytes_served += nbytes
        self._reads += 1
        self._writers.submit(fd, reply, holds)

    def _answer_at_once(self, fd: int, data: bytes) -> None:
        """(trio thread, in arrival order) RELEASE, RELEASEDIR, FORGET, BATCH_FORGET,
        INTERRUPT: no await in them, so they are answered here rather than in a task."""
        try:
            request = rq.parse(data)
        except rq.ProtocolError as exc:
            log.error("FUSE: a malformed request (%s): answering EIO", exc)
            if len(data) >= p.IN_HEADER_SIZE:
                write_reply(fd, [rp.reply_error(struct.unpack_from("<Q", data, 8)[0], errno.EIO)])
            return
        op, args, unique = request.header.opcode, request.args, request.header.unique
        if op in _NO_REPLY:
            self._no_reply(request)
            return
        try:
            if isinstance(args, rq.Release):
                self._release(op, args)
            reply = rp.reply(unique)
        except ObjfsError as exc:
            log.log(exc.log_level, "%s: %s", _name(op), exc)
            reply = rp.reply_error(unique, exc.errno)
        except Exception:
            log.exception("unexpected error in %s; answering EIO", _name(op))
            reply = rp.reply_error(unique, errno.EIO)
        write_reply(fd, [reply])

    def _release(self, op: int, args: rq.Release) -> None:
        """RELEASE or RELEASEDIR, wherever it is answered: the handle goes, and after an
        inode's last release its backing id (see OpenInodes)."""
        if op == p.Opcode.RELEASE:
            inode = self.fs.handle_inode(args.fh)
            self.fs.release(args.fh)
            self._inodes.released(self._fd, inode)
        elif op == p.Opcode.RELEASEDIR:
            self.fs.releasedir(args.fh)

    def _no_reply(self, request: rq.Request) -> None:
        args = request.args
        try:
            if isinstance(args, rq.Forget):
                self.fs.forget(request.header.nodeid, args.nlookup)
            elif isinstance(args, rq.BatchForget):
                for nodeid, nlookup in args.items:
                    self.fs.forget(nodeid, nlookup)
            elif isinstance(args, rq.Interrupt):
                scope = self._inflight.get(args.unique)
                if scope is not None:
                    scope.cancel()
        except Exception:
            log.exception("%s failed", _name(request.header.opcode))

    async def _dispatch(self, request: rq.Request) -> Sequence[bytes | bytearray | memoryview]:
        h, args = request.header, request.args
        op, unique, fs = h.opcode, h.unique, self.fs
        if op == p.Opcode.LOOKUP and isinstance(args, rq.Lookup):
            try:
                node = await fs.lookup(h.nodeid, args.name)
            except ObjectNotFoundError:
                # nodeid 0: the kernel caches the miss for entry_valid (loaders probe many
                # missing files, again and again).
                return [rp.reply(unique, rp.entry_out(0, None, self.timeout_s, self.timeout_s))]
            entry = self._entry(fs.attributes(node))
            fs.remember(node)
            return [rp.reply(unique, entry)]
        if op == p.Opcode.GETATTR:
            attrs = await fs.getattr(h.nodeid)
            return [rp.reply(unique, rp.attr_out(_attr(attrs), self.timeout_s))]
        if op == p.Opcode.OPEN and isinstance(args, rq.Open):
            return [rp.reply(unique, await self._open(h.nodeid, args.flags))]
        if op in (p.Opcode.RELEASE, p.Opcode.RELEASEDIR) and isinstance(args, rq.Release):
            self._release(op, args)
            return [rp.reply(unique)]
        if op == p.Opcode.OPENDIR:
            return [rp.reply(unique, rp.open_out(await fs.opendir(h.nodeid), 0))]
        if op in (p.Opcode.READDIR, p.Opcode.READDIRPLUS) and isinstance(args, rq.Read):
            return [rp.reply(unique, self._readdir(args, plus=op == p.Opcode.READDIRPLUS))]
        if op in (p.Opcode.FLUSH, p.Opcode.FSYNCDIR):
            return [rp.reply(unique)]
        if op == p.Opcode.FSYNC and isinstance(args, rq.Fsync):
            # fsync makes the file's version whole in the disk cache (`objfs warm
            # --cache-only`); see objfs.fuse_ops.
            await fs.warm(fs.handle_inode(args.fh))
            return [rp.reply(unique)]
        if op == p.Opcode.STATFS:
            statfs = rp.statfs_out(
                blocks=0,
                bfree=0,
                bavail=0,
                files=fs.statistics()["inodes"],
                ffree=0,
                bsize=fs.block_size,
                namelen=255,
                frsize=4096,
            )
            return [rp.reply(unique, statfs)]
        if op == p.Opcode.DESTROY:
            return [rp.reply(unique)]
        if op in _MUTATIONS:
            return [rp.reply_error(unique, errno.EROFS)]
        if op == p.Opcode.INIT:
            return [rp.reply_error(unique, errno.EIO)]  # a second INIT
        return [rp.reply_error(unique, errno.ENOSYS)]

    async def _open(self, inode: int, flags: int) -> bytes:
        """OPEN: passthrough to the disk tier's file when the version is whole there and the
        inode is not open in cached mode; else cached (keep_cache). The kernel refuses to mix
        the two modes on one inode, and needs one backing file per inode while any
        passthrough open lasts: the first passthrough open registers it (the very file
        descriptor the disk tier verified), the last release closes it."""
        backing_fd = None
        if self.passthrough and self._inodes.refused is None and not self._inodes.cached(inode):
            backing_fd = await self.fs.whole_on_disk(inode)
        try:
            if backing_fd is not None and self._inodes.cached(inode):
                os.close(backing_fd)  # other opens ran meanwhile, in cached mode
                backing_fd = None
            # The kernel reads a passthrough inode's file itself: nothing to fetch ahead.
            prefetch = backing_fd is None and not self._inodes.by_passthrough(inode)
            fh, keep_cache = await self.fs.open(inode, flags, prefetch=prefetch)
        except BaseException:
            if backing_fd is not None:
                os.close(backing_fd)
            raise
        backing_id = self._inodes.opened(self._fd, inode, backing_fd)
        log.debug("open of inode %d: %s", inode, "cached" if backing_id is None else "passthrough")
        if backing_id is not None:
            self.passthrough_opens += 1
            return rp.open_out(fh, p.FOPEN_PASSTHROUGH, backing_id)
        if not prefetch:
            self.fs.served_after_all(fh)
        # Never DIRECT_IO: it would break mmap, which safetensors uses.
        return rp.open_out(fh, p.FOPEN_KEEP_CACHE if keep_cache else 0)

    def _readdir(self, args: rq.Read, *, plus: bool) -> bytes:
        """Entries from offset ``args.offset`` that fit ``args.size`` bytes; with ``plus``
        each entry carries its attributes and counts as a lookup."""
        out = bytearray()
        for next_id, node in self.fs.readdir(args.fh, args.offset):
            attrs = self.fs.attributes(node)
            dtype = (attrs.mode >> 12) & 0o17
            if plus:
                if len(out) + rp.dirent_size_plus(node.name) > args.size:
                    break
                rp.pack_direntplus(out, self._entry(attrs), attrs.inode, next_id, dtype, node.name)
                self.fs.remember(node)
            else:
                if len(out) + rp.dirent_size(node.name) > args.size:
                    break
                rp.pack_dirent(out, attrs.inode, next_id, dtype, node.name)
        return bytes(out)

    def _entry(self, attrs: Attributes) -> bytes:
        return rp.entry_out(attrs.inode, _attr(attrs), self.timeout_s, self.timeout_s)

    # -- the end -------------------------------------------------------------------------

    def close(self, *, unmount: bool) -> None:
        """Stop the readers, remove the mount if this session made it (``unmount``), close
        the fds (the kernel then fails what is left with ENOTCONN)."""
        self.stop()
        for t in self._threads:
            t.join(timeout=5)
        self._writers.close()
        if unmount and self._mounted_here:
            mounting.unmount(self.config.mountpoint)
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = -1
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _name(opcode: int) -> str:
    try:
        return p.Opcode(opcode).name.lower()
    except ValueError:
        return f"opcode {opcode}"


def _attr(a: Attributes) -> rp.Attr:
    return rp.Attr(
        ino=a.inode,
        size=a.size,
        blocks=(a.size + 511) // 512,  # st_blocks counts 512-byte units
        mtime_ns=a.mtime_ns,
        mode=a.mode,
        nlink=a.nlink,
        uid=a.uid,
        gid=a.gid,
        blksize=a.blksize,
    )
