"""objfs's own FUSE transport: the kernel protocol over ``/dev/fuse``, without libfuse.

A sibling of :mod:`objfs.fuse_ops` (the pyfuse3 transport) over the same FUSE-free
:class:`~objfs.fs.FileSystem`, selected with ``--fuse-transport kernel``.

Mounting: a passed fd (``/dev/fd/N``, mounted by another process: the CSI sidecar) is served
as it is; as root objfs opens ``/dev/fuse`` and calls mount(2) with ``fd=N`` itself; otherwise
``fusermount3`` mounts and hands the fd back over a socket (its ``_FUSE_COMMFD`` protocol).

INIT: the session answers the kernel's INIT before anything else, asking for what the kernel
offers of ``ASYNC_READ``, ``PARALLEL_DIROPS``, ``DO_READDIRPLUS``, ``MAX_PAGES`` (requests up
to 4 MiB, within ``fs.fuse.max_pages_limit``, which objfs raises to that when root) and
``INIT_EXT``, with ``max_background`` and ``congestion_threshold`` in the reply itself, and
never ``WRITEBACK_CACHE``. What was
negotiated is logged and kept in :attr:`KernelSession.negotiated` (``objfs status`` shows it).

Threads: one reader thread waits on the session fd and hands every request to the trio
thread (``run_sync_soon``, which never blocks it) in the order the kernel queued them;
reading a request and handing it over costs microseconds. The trio thread runs the handler as
a task against the core. A READ's reply goes to one of ``WRITERS`` threads, which write it
with one ``writev`` outside the GIL: the copy into the page cache, most of a cold load's CPU,
leaves the trio thread. The core keeps the reply's bytes valid and charged to the budget
until the write is done (``FileSystem.read(holds=...)``: cached blocks pinned, pooled buffers
kept), and the writer hands the holds back to the trio thread (``run_sync_soon``). Other
replies are small and written by the trio thread. Every reply goes to the fd its request was
read from (several threads may write to one fd). trio stays the only owner of the core's
state. The reader waits in ``poll`` on the fd and a wake-up pipe, so :meth:`stop` ends it at
once, even while files stay open on a detached mount.

Invariants (tested against recorded request bytes and real mounts):

* every request that expects a reply gets exactly one, on its own fd: FORGET, BATCH_FORGET and
  INTERRUPT get none; a handler's error becomes its errno (objfs errors their own, anything
  unexpected EIO with its traceback in the log), and a request that cannot be parsed gets EIO
  (or nothing if not even its header can be read): a bad request never ends the mount;
* mutations answer EROFS, what libfuse answers ENOSYS for (no handler) answers ENOSYS, as with
  the pyfuse3 transport;
* INTERRUPT cancels the request it names while it runs, which then answers EINTR;
* the loop ends cleanly on unmount (ENODEV), DESTROY or :meth:`stop`.

"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import queue
import select
import socket
import stat
import struct
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from objfs.config import MountConfig
from objfs.errors import MountFailedError, ObjectNotFoundError, ObjfsError
from objfs.fs import FileSystem
from objfs.inodes import Attributes
from objfs.kernel import protocol as p
from objfs.nursery import open_nursery

log = logging.getLogger(__name__)

# Threads that write READ replies: the copy into the page cache runs there, in parallel.
WRITERS = 4
# The largest write the kernel may send (none arrive: the mount is read-only); it sets the
# size every read buffer must have (80 + max_write, at least 8 KiB).
_MAX_WRITE = 4096
_READ_BUFFER = max(p.MIN_READ_BUFFER, 80 + _MAX_WRITE)
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
# Requests answered as they arrive, without a task (see KernelSession.serve).
_AT_ONCE = frozenset(
    {p.Opcode.RELEASE, p.Opcode.RELEASEDIR, p.Opcode.FORGET, p.Opcode.BATCH_FORGET}
)
# What objfs asks for when the kernel offers it.
_WANTED = (
    p.ASYNC_READ
    | p.PARALLEL_DIROPS
    | p.DO_READDIRPLUS
    | p.READDIRPLUS_AUTO
    | p.MAX_PAGES
    | p.INIT_EXT
)
_MAX_PAGES_LIMIT = "/proc/sys/fs/fuse/max_pages_limit"
_PAGE = 4096
# The largest request objfs asks for: 4 MiB (the kernel's own cap was 256 pages before 6.13
# and is fs.fuse.max_pages_limit since; objfs raises that sysctl to this when root).
MAX_PAGES = 1024

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong]
_libc.mount.argtypes += [ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOATIME = 1, 2, 4, 1024
_MNT_DETACH = 2


@dataclass
class Negotiated:
    """What the INIT exchange settled (logged; ``objfs status`` shows it)."""

    major: int = 0
    minor: int = 0
    flags: int = 0
    max_pages: int = 0
    max_readahead: int = 0
    max_background: int = 0
    names: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "transport": "kernel",
            "protocol": f"{self.major}.{self.minor}",
            "flags": self.names,
            "max_request_bytes": self.max_pages * _PAGE,
            "max_readahead_bytes": self.max_readahead,
            "max_background": self.max_background,
            "reply_threads": WRITERS,
        }


def _flag_names(flags: int) -> list[str]:
    names = (
        "ASYNC_READ",
        "PARALLEL_DIROPS",
        "DO_READDIRPLUS",
        "READDIRPLUS_AUTO",
        "MAX_PAGES",
        "INIT_EXT",
        "PASSTHROUGH",
    )
    return [name for name in names if flags & getattr(p, name)]


def _max_pages_limit() -> int:
    """The kernel's cap on pages per request (``fs.fuse.max_pages_limit``, 6.13+; 256 before)."""
    try:
        with open(_MAX_PAGES_LIMIT, encoding="ascii") as f:
            return max(1, int(f.read().strip()))
    except (OSError, ValueError):
        return 256


def _raise_max_pages_limit() -> int:
    """Raise ``fs.fuse.max_pages_limit`` to ``MAX_PAGES`` where it is lower, this process is
    root and the sysctl exists (it only caps what each FUSE file system may ask for; the
    kernel reads it when a connection is created, so this runs before mounting). Returns the
    cap, logged when raised."""
    limit = _max_pages_limit()
    if limit < MAX_PAGES and os.geteuid() == 0 and os.path.exists(_MAX_PAGES_LIMIT):
        try:
            with open(_MAX_PAGES_LIMIT, "w", encoding="ascii") as f:
                f.write(str(MAX_PAGES))
        except OSError as exc:
            log.info("fs.fuse.max_pages_limit stays %d (raising it failed: %s)", limit, exc)
        else:
            log.info("raised fs.fuse.max_pages_limit from %d to %d", limit, MAX_PAGES)
            limit = _max_pages_limit()
    return limit


class KernelSession:
    """One FUSE connection served by objfs itself. ``mount()``, then ``await serve()`` until
    unmounted or :meth:`stop`; ``close()`` at the end. Same attributes as the pyfuse3
    adapter for metrics: ``initialized``, ``bytes_served``, ``reads``."""

    def __init__(self, fs: FileSystem, config: MountConfig, passed_fd: int | None) -> None:
        self.fs = fs
        self.config = config
        self.timeout_s = fs.config.kernel_timeout_s()
        self.initialized = trio.Event()
        self.bytes_served = 0
        self.reads = 0
        self.negotiated = Negotiated()
        self._passed_fd = passed_fd
        self._fd = -1
        # The kernel's cap on pages per request, as this connection was made with (a passed
        # fd's mount was made by another process: the cap as it stands now).
        self._pages_limit = _max_pages_limit()
        self._mounted_here = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._writers: list[threading.Thread] = []
        self._inflight: dict[int, trio.CancelScope] = {}
        self._done = trio.Event()
        # Open inodes: their I/O mode and, in passthrough, their backing id.
        self._io: dict[int, _InodeIO] = {}
        self.passthrough = False  # negotiated (see _answer_init)
        self.passthrough_opens = 0
        # READs enter the core in arrival order (see _take_turn).
        self._read_seq = 0
        self._read_turn = 0
        self._skipped: set[int] = set()
        self._turn_changed = trio.Event()
        # READ replies for the writer threads: (fd, reply parts, holds), None to stop.
        self._replies: queue.SimpleQueue[
            tuple[int, list[bytes | bytearray | memoryview], list[Callable[[], None]]] | None
        ] = queue.SimpleQueue()

    # -- mounting ------------------------------------------------------------------------

    def mount(self) -> None:
        """Mount (or take the passed fd). Raises MountFailedError with a one-line reason."""
        if self._passed_fd is not None:
            self._fd = self._passed_fd
            return
        self._pages_limit = _raise_max_pages_limit()
        target = self.config.mountpoint
        fsname = self.config.source.url().replace(",", "%2C").replace(" ", "%20")
        if os.geteuid() == 0:
            fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
            # user_id/group_id: who may use the mount without allow_other (its owner, this
            # process; --uid/--gid only set the files' owner).
            data = (
                f"fd={fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()},"
                "default_permissions"
            )
            if self.config.allow_other:
                data += ",allow_other"
            flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOATIME
            if _libc.mount(
                fsname.encode(), os.fsencode(target), b"fuse.objfs", flags, data.encode()
            ):
                code = ctypes.get_errno()
                os.close(fd)
                raise MountFailedError(f"mounting {target} failed ({os.strerror(code)})")
            self._fd = fd
        else:
            self._fd = self._fusermount(target, fsname)
        self._mounted_here = True

    def _fusermount(self, target: str, fsname: str) -> int:
        """Mount through fusermount3, which sends the fd back over a socket."""
        options = f"ro,nosuid,nodev,noatime,default_permissions,fsname={fsname},subtype=objfs"
        if self.config.allow_other:
            options += ",allow_other"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours, theirs:
            env = {**os.environ, "_FUSE_COMMFD": str(theirs.fileno())}
            done = subprocess.run(
                ["fusermount3", "-o", options, "--", target],
                env=env,
                pass_fds=(theirs.fileno(),),
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                reason = (done.stderr.strip().splitlines() or ["no reason given"])[-1]
                hint = ""
                if self.config.allow_other:
                    hint = ": --allow-other needs `user_allow_other` in /etc/fuse.conf"
                raise MountFailedError(f"mounting {target} failed ({reason}){hint}")
            theirs.close()
            _, fds, _, _ = socket.recv_fds(ours, 1, 1)
        if not fds:
            raise MountFailedError(f"mounting {target} failed (fusermount3 sent no fd)")
        os.set_inheritable(fds[0], False)
        log.info("mounted %s through fusermount3", target)
        return fds[0]

    # -- serving -------------------------------------------------------------------------

    async def serve(self) -> None:
        """Answer INIT, then serve until the mount goes away, DESTROY or :meth:`stop`."""
        token = trio.lowlevel.current_trio_token()
        if not await trio.to_thread.run_sync(self._init, abandon_on_cancel=True):
            return
        self.initialized.set()
        async with open_nursery() as nursery:

            def spawn(fd: int, data: bytes) -> None:
                # Callbacks of run_sync_soon run in order, so requests are seen here in the
                # order they arrived. Releases and forgets are answered at once: they never
                # wait, and an OPEN that follows a close must see its release (passthrough
                # needs an inode with no cached-mode open; trio may start tasks spawned
                # together in either order). READs are numbered: see _take_turn.
                opcode = struct.unpack_from("<I", data, 4)[0] if len(data) >= 8 else -1
                if opcode in _AT_ONCE:
                    self._answer_at_once(fd, data)
                    return
                seq = None
                if opcode == p.Opcode.READ:
                    seq, self._read_seq = self._read_seq, self._read_seq + 1
                nursery.start_soon(self._handle, fd, data, seq)

            for i in range(WRITERS):
                t = threading.Thread(
                    target=self._writer, args=(token,), name=f"objfs-reply-{i}", daemon=True
                )
                t.start()
                self._writers.append(t)
            t = threading.Thread(
                target=self._reader, args=(self._fd, token, spawn), name="objfs-fuse", daemon=True
            )
            t.start()
            self._threads.append(t)
            await self._done.wait()
            nursery.cancel_scope.cancel()

    def _poller(self, fd: int) -> select.poll:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        return poller

    def _read_one(self, fd: int, buf: bytearray, poller: select.poll) -> bytes | None:
        """(Thread) One request from ``fd``; None when the connection is gone or on stop."""
        while not self._stopping.is_set():
            events = dict(poller.poll())
            if self._wake_r in events:
                return None
            if events.get(fd, 0) & (select.POLLERR | select.POLLHUP):
                return None
            try:
                n = os.readv(fd, [buf])
            except BlockingIOError:
                continue  # another reader took it
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
                request = p.parse(data)
            except p.ProtocolError as exc:
                log.error("FUSE: a malformed request before INIT (%s)", exc)
                continue
            if request.header.opcode != p.Opcode.INIT or not isinstance(request.args, p.Init):
                self._write(self._fd, [p.reply_error(request.header.unique, errno.EIO)])
                continue
            init = request.args
            if init.major > p.KERNEL_VERSION:
                # A newer major: answer ours only; the kernel sends INIT again.
                self._write(self._fd, [p.reply(request.header.unique, struct.pack("<II", 7, 0))])
                continue
            if init.major < p.KERNEL_VERSION:
                self._write(self._fd, [p.reply_error(request.header.unique, errno.EPROTO)])
                return False
            self._answer_init(request.header.unique, init)
            return True

    def _answer_init(self, unique: int, init: p.Init) -> None:
        flags = init.flags & _WANTED
        why_not = self._passthrough_refusal(init)
        if why_not is None:
            flags |= p.PASSTHROUGH
        else:
            log.info("FUSE passthrough off: %s", why_not)
        self.passthrough = why_not is None
        minor = min(init.minor, p.KERNEL_MINOR_VERSION)
        max_pages = min(self._pages_limit, MAX_PAGES) if flags & p.MAX_PAGES else 0
        background = self.config.max_background
        reply = p.init_out(
            minor=minor,
            max_readahead=init.max_readahead,
            flags=flags,
            max_background=background,
            congestion_threshold=background * 3 // 4,
            max_write=_MAX_WRITE,
            max_pages=max_pages,
            max_stack_depth=1 if self.passthrough else 0,
        )
        self._write(self._fd, [p.reply(unique, reply)])
        n = self.negotiated
        n.major, n.minor, n.flags = p.KERNEL_VERSION, minor, flags
        n.max_pages, n.max_readahead, n.max_background = max_pages, init.max_readahead, background
        n.names = _flag_names(flags)
        log.info(
            "FUSE transport kernel: protocol 7.%d, %s, requests up to %d KiB, max_background %d",
            minor,
            " ".join(n.names) or "no optional features",
            (max_pages or 32) * _PAGE // 1024,
            background,
        )

    def _passthrough_refusal(self, init: p.Init) -> str | None:
        """Why the kernel will not serve cached versions itself (None: it will)."""
        if self.fs.disk is None:
            return "no --cache-dir (passthrough serves versions whole in the disk cache)"
        if not init.flags & p.PASSTHROUGH or not init.flags & p.INIT_EXT:
            return "the kernel does not offer it (Linux 6.9+ with CONFIG_FUSE_PASSTHROUGH)"
        if not _has_cap_sys_admin():
            return "no CAP_SYS_ADMIN (the kernel registers backing files only for it)"
        return None

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
                try:
                    token.run_sync_soon(spawn, fd, data)
                except trio.RunFinishedError:
                    break
        finally:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._done.set)

    def _writer(self, token: trio.lowlevel.TrioToken) -> None:
        """(Thread) Write READ replies; give their holds back to the trio thread."""
        while True:
            job = self._replies.get()
            if job is None:
                return
            fd, parts, holds = job
            self._write(fd, parts)
            del parts, job
            if holds:
                try:
                    token.run_sync_soon(_run_holds, holds)
                except trio.RunFinishedError:
                    return

    def stop(self) -> None:
        """End the readers (thread-safe; the mount is removed by :meth:`close`)."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _write(self, fd: int, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        try:
            os.writev(fd, parts)
        except OSError as exc:
            # ENOENT: the request was interrupted or aborted meanwhile; ENODEV: unmounted.
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                log.error("FUSE: writing a reply failed (%s)", exc)

    async def _handle(self, fd: int, data: bytes, seq: int | None = None) -> None:
        """Parse one request, run its handler, write its reply (see the invariants). ``seq``:
        the number of a READ (see _take_turn), given up if the READ never takes its turn."""
        try:
            await self._handle_request(fd, data, seq)
        finally:
            if seq is not None and seq >= self._read_turn:
                self._skip_turn(seq)

    async def _take_turn(self, seq: int) -> None:
        """Wait until every READ that arrived before READ ``seq`` has entered the core.

        trio may start tasks spawned together in any order (it reverses batches at random),
        and the core tells a sequential reader from a random one by the order its reads come
        in: the kernel's read-ahead READ (offset 1 MiB) entering before the READ at 0 made a
        cold 5 MiB read fetch 1 MiB twice in 6 of 8 runs. Taking turns keeps arrival order."""
        while self._read_turn != seq:
            await self._turn_changed.wait()

    def _skip_turn(self, seq: int) -> None:
        """READ ``seq`` has entered the core (or never will): the next one may."""
        self._skipped.add(seq)
        while self._read_turn in self._skipped:
            self._skipped.discard(self._read_turn)
            self._read_turn += 1
        self._turn_changed.set()
        self._turn_changed = trio.Event()

    async def _handle_request(self, fd: int, data: bytes, seq: int | None) -> None:
        try:
            request = p.parse(data)
        except p.ProtocolError as exc:
            log.error("FUSE: a malformed request (%s): answering EIO", exc)
            if len(data) >= p.IN_HEADER_SIZE:
                unique = struct.unpack_from("<Q", data, 8)[0]
                self._write(fd, [p.reply_error(unique, errno.EIO)])
            return
        header = request.header
        op = header.opcode
        if op in _NO_REPLY:
            self._no_reply(request)
            return
        reply: Sequence[bytes | bytearray | memoryview]
        with trio.CancelScope() as scope:
            self._inflight[header.unique] = scope
            try:
                if op == p.Opcode.READ and isinstance(request.args, p.Read):
                    await self._read(fd, header.unique, request.args, seq)
                    return
                reply = await self._dispatch(request)
            except ObjfsError as exc:
                log.log(exc.log_level, "%s: %s", _name(op), exc)
                reply = [p.reply_error(header.unique, exc.errno)]
            except Exception:
                log.exception("unexpected error in %s; answering EIO", _name(op))
                reply = [p.reply_error(header.unique, errno.EIO)]
            finally:
                del self._inflight[header.unique]
        if scope.cancelled_caught:
            if self._stopping.is_set():
                return
            reply = [p.reply_error(header.unique, errno.EINTR)]
        self._write(fd, reply)
        if op == p.Opcode.DESTROY:
            self._done.set()

    async def _read(self, fd: int, unique: int, args: p.Read, seq: int | None) -> None:
        """A READ: the bytes from the core, held until a writer thread wrote the reply."""
        holds: list[Callable[[], None]] = []
        if seq is not None:
            await self._take_turn(seq)
        reading = self.fs.read(args.fh, args.offset, args.size, holds=holds)
        if seq is not None:
            # The next READ may run once this one suspends: by then it has entered the core
            # (awaiting the coroutine runs it up to its first suspension).
            self._skip_turn(seq)
        try:
            data = await reading
        except BaseException:
            _run_holds(holds)
            raise
        parts = data if isinstance(data, list) else [data]
        nbytes = sum(len(part) for part in parts)
        self.bytes_served += nbytes
        self.reads += 1
        self._replies.put((fd, [p.out_header(unique, nbytes), *parts], holds))

    def _answer_at_once(self, fd: int, data: bytes) -> None:
        """(trio thread, in arrival order) RELEASE, RELEASEDIR, FORGET, BATCH_FORGET: no
        await in them, so they are answered here rather than in a task."""
        try:
            request = p.parse(data)
        except p.ProtocolError as exc:
            log.error("FUSE: a malformed request (%s): answering EIO", exc)
            if len(data) >= p.IN_HEADER_SIZE:
                self._write(fd, [p.reply_error(struct.unpack_from("<Q", data, 8)[0], errno.EIO)])
            return
        op, args, unique = request.header.opcode, request.args, request.header.unique
        if op in _NO_REPLY:
            self._no_reply(request)
            return
        try:
            if op == p.Opcode.RELEASE and isinstance(args, p.Release):
                inode = self.fs.handle_inode(args.fh)
                self.fs.release(args.fh)
                self._closed(inode)
            elif op == p.Opcode.RELEASEDIR and isinstance(args, p.Release):
                self.fs.releasedir(args.fh)
            reply = p.reply(unique)
        except ObjfsError as exc:
            log.log(exc.log_level, "%s: %s", _name(op), exc)
            reply = p.reply_error(unique, exc.errno)
        except Exception:
            log.exception("unexpected error in %s; answering EIO", _name(op))
            reply = p.reply_error(unique, errno.EIO)
        self._write(fd, [reply])

    def _no_reply(self, request: p.Request) -> None:
        args = request.args
        try:
            if isinstance(args, p.Forget):
                self.fs.forget(request.header.nodeid, args.nlookup)
            elif isinstance(args, p.BatchForget):
                for nodeid, nlookup in args.items:
                    self.fs.forget(nodeid, nlookup)
            elif isinstance(args, p.Interrupt):
                scope = self._inflight.get(args.unique)
                if scope is not None:
                    scope.cancel()
        except Exception:
            log.exception("%s failed", _name(request.header.opcode))

    async def _dispatch(self, request: p.Request) -> Sequence[bytes | bytearray | memoryview]:
        h, args = request.header, request.args
        op, unique, fs = h.opcode, h.unique, self.fs
        if op == p.Opcode.LOOKUP and isinstance(args, p.Lookup):
            try:
                node = await fs.lookup(h.nodeid, args.name)
            except ObjectNotFoundError:
                # nodeid 0: the kernel caches the miss for entry_valid (loaders probe many
                # missing files, again and again).
                return [p.reply(unique, p.entry_out(0, None, self.timeout_s, self.timeout_s))]
            entry = self._entry(fs.attributes(node))
            fs.remember(node)
            return [p.reply(unique, entry)]
        if op == p.Opcode.GETATTR:
            attrs = await fs.getattr(h.nodeid)
            return [p.reply(unique, p.attr_out(_attr(attrs), self.timeout_s))]
        if op == p.Opcode.OPEN and isinstance(args, p.Open):
            return [p.reply(unique, await self._open(h.nodeid, args.flags))]
        if op == p.Opcode.RELEASE and isinstance(args, p.Release):
            inode = fs.handle_inode(args.fh)
            fs.release(args.fh)
            self._closed(inode)
            return [p.reply(unique)]
        if op == p.Opcode.OPENDIR:
            return [p.reply(unique, p.open_out(await fs.opendir(h.nodeid), 0))]
        if op in (p.Opcode.READDIR, p.Opcode.READDIRPLUS) and isinstance(args, p.Read):
            return [p.reply(unique, self._readdir(args, plus=op == p.Opcode.READDIRPLUS))]
        if op == p.Opcode.RELEASEDIR and isinstance(args, p.Release):
            fs.releasedir(args.fh)
            return [p.reply(unique)]
        if op in (p.Opcode.FLUSH, p.Opcode.FSYNCDIR):
            return [p.reply(unique)]
        if op == p.Opcode.FSYNC and isinstance(args, p.Fsync):
            # fsync makes the file's version whole in the disk cache (`objfs warm
            # --cache-only`); see objfs.fuse_ops.
            await fs.warm(fs.handle_inode(args.fh))
            return [p.reply(unique)]
        if op == p.Opcode.STATFS:
            statfs = p.statfs_out(
                blocks=0,
                bfree=0,
                bavail=0,
                files=fs.statistics()["inodes"],
                ffree=0,
                bsize=fs.block_size,
                namelen=255,
                frsize=4096,
            )
            return [p.reply(unique, statfs)]
        if op == p.Opcode.DESTROY:
            return [p.reply(unique)]
        if op in _MUTATIONS:
            return [p.reply_error(unique, errno.EROFS)]
        if op == p.Opcode.INIT:
            return [p.reply_error(unique, errno.EIO)]  # a second INIT
        return [p.reply_error(unique, errno.ENOSYS)]

    async def _open(self, inode: int, flags: int) -> bytes:
        """OPEN: passthrough to the disk tier's file when the version is whole there and the
        inode is not open in cached mode; else cached (keep_cache). The kernel refuses to mix
        the two modes on one inode, and needs one backing file per inode while any
        passthrough open lasts: the first passthrough open registers it, the last release
        closes it."""
        io = self._io.get(inode)
        path = None
        if self.passthrough and (io is None or io.backing_id is not None):
            path = await self.fs.whole_on_disk(inode)
            io = self._io.get(inode)  # other opens may have run meanwhile
            if io is not None and io.backing_id is None:
                path = None
        fh, keep_cache = await self.fs.open(inode, flags, prefetch=path is None)
        log.debug("open of inode %d: %s", inode, "passthrough" if path else "cached")
        if path is not None:
            try:
                backing_id = io.backing_id if io is not None else self._register(path)
            except OSError as exc:
                log.warning("FUSE passthrough of %s refused (%s): serving it", path, exc)
                backing_id = None
            if backing_id is not None:
                if io is None:
                    io = self._io[inode] = _InodeIO(backing_id)
                io.opens += 1
                self.passthrough_opens += 1
                return p.open_out(fh, p.FOPEN_PASSTHROUGH, backing_id)
        if io is None:
            io = self._io[inode] = _InodeIO(None)
        io.opens += 1
        # Never DIRECT_IO: it would break mmap, which safetensors uses.
        return p.open_out(fh, p.FOPEN_KEEP_CACHE if keep_cache else 0)

    def _register(self, path: str) -> int:
        """A backing id for ``path`` (FUSE_DEV_IOC_BACKING_OPEN; the kernel keeps its own
        reference to the file, so the fd is closed at once)."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return int(fcntl.ioctl(self._fd, p.DEV_IOC_BACKING_OPEN, bytearray(p.backing_map(fd))))
        finally:
            os.close(fd)

    def _closed(self, inode: int) -> None:
        """A handle of ``inode`` was released: after the last one, its backing id goes."""
        io = self._io.get(inode)
        if io is None:
            return
        io.opens -= 1
        if io.opens > 0:
            return
        del self._io[inode]
        if io.backing_id is not None:
            try:
                fcntl.ioctl(
                    self._fd, p.DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("<i", io.backing_id))
                )
            except OSError as exc:
                log.warning("FUSE: closing backing id %d failed (%s)", io.backing_id, exc)

    def _readdir(self, args: p.Read, *, plus: bool) -> bytes:
        """Entries from offset ``args.offset`` that fit ``args.size`` bytes; with ``plus``
        each entry carries its attributes and counts as a lookup."""
        out = bytearray()
        for next_id, node in self.fs.readdir(args.fh, args.offset):
            attrs = self.fs.attributes(node)
            dtype = (attrs.mode >> 12) & 0o17
            if plus:
                if len(out) + p.dirent_size_plus(node.name) > args.size:
                    break
                p.pack_direntplus(out, self._entry(attrs), attrs.inode, next_id, dtype, node.name)
                self.fs.remember(node)
            else:
                if len(out) + p.dirent_size(node.name) > args.size:
                    break
                p.pack_dirent(out, attrs.inode, next_id, dtype, node.name)
        return bytes(out)

    def _entry(self, attrs: Attributes) -> bytes:
        return p.entry_out(attrs.inode, _attr(attrs), self.timeout_s, self.timeout_s)

    # -- the end -------------------------------------------------------------------------

    def close(self, *, unmount: bool) -> None:
        """Stop the readers, remove the mount if this session made it (``unmount``), close
        the fds (the kernel then fails what is left with ENOTCONN)."""
        self.stop()
        for t in self._threads:
            t.join(timeout=5)
        for _ in self._writers:
            self._replies.put(None)
        for t in self._writers:
            t.join(timeout=5)
        if unmount and self._mounted_here:
            self._unmount()
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = -1
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _unmount(self) -> None:
        target = self.config.mountpoint
        if not _is_our_mount(target):
            return  # unmounted already (fusermount3 -u, umount)
        if os.geteuid() == 0:
            if _libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
                log.warning("unmounting %s failed (%s)", target, os.strerror(ctypes.get_errno()))
            return
        done = subprocess.run(
            ["fusermount3", "-u", "-z", "--", target], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            log.warning("unmounting %s failed (%s)", target, done.stderr.strip())


def _is_our_mount(target: str) -> bool:
    from objfs.mountinfo import mount_entry

    entry = mount_entry(target)
    return entry is not None


@dataclass
class _InodeIO:
    """How an open inode is read: cached (``backing_id`` None) or by passthrough."""

    backing_id: int | None
    opens: int = 0


def _has_cap_sys_admin() -> bool:
    """Whether this process holds CAP_SYS_ADMIN (bit 21 of CapEff), which passthrough
    needs (in the initial user namespace)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 21 & 1)
    except (OSError, ValueError):
        pass
    return False


def _run_holds(holds: list[Callable[[], None]]) -> None:
    """(trio thread) Give back what a written reply held."""
    for release in holds:
        try:
            release()
        except Exception:
            log.exception("giving back a reply's buffer failed")


def _name(opcode: int) -> str:
    try:
        return p.Opcode(opcode).name.lower()
    except ValueError:
        return f"opcode {opcode}"


def _attr(a: Attributes) -> p.Attr:
    return p.Attr(
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


def is_fuse_fd(fd: int) -> bool:
    """Whether ``fd`` is open on /dev/fuse (major 10, minor 229)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(10, 229)
