"""The pyfuse3 adapter: a few lines per handler over :class:`objfs.fs.FileSystem`.

This is the only module that raises ``pyfuse3.FUSEError``. pyfuse3 lets any other exception
escape and stop the main loop, which unmounts the file system under every process that has a
file mmapped (they then die of SIGBUS). So every handler goes through :func:`_errno_boundary`:
objfs errors become their errno, anything unexpected is logged with its traceback and becomes
EIO, and the mount stays up.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import pyfuse3
import trio

from objfs.errors import ObjectNotFoundError, ObjfsError
from objfs.fs import FileSystem
from objfs.inodes import Attributes

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def _errno_boundary(
    fn: Callable[Concatenate[ObjfsOperations, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[ObjfsOperations, P], Coroutine[Any, Any, R]]:
    @functools.wraps(fn)
    async def wrapper(self: ObjfsOperations, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except ObjfsError as exc:
            log.log(exc.log_level, "%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno) from None
        except Exception:
            log.exception("unexpected error in %s; answering EIO", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


def _read_only(*_args: Any, **_kwargs: Any) -> Any:
    async def refuse() -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    return refuse()


class ObjfsOperations(pyfuse3.Operations):
    """Read-only FUSE operations; mutating calls answer EROFS."""

    enable_writeback_cache = False

    def __init__(self, fs: FileSystem) -> None:
        super().__init__()
        self.fs = fs
        self.timeout_s = fs.config.kernel_timeout_s()
        # Set once the kernel's INIT request is answered: the kernel applies its own limits
        # (e.g. read-ahead) when it reads that answer, so tuning must come after.
        self.initialized = trio.Event()
        # Bytes and requests answered by read (metrics and `objfs status` read them).
        self.bytes_served = 0
        self.reads = 0

    def init(self) -> None:
        self.initialized.set()

    def _entry(self, attrs: Attributes) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = pyfuse3.InodeT(attrs.inode)
        entry.generation = 0
        entry.entry_timeout = self.timeout_s
        entry.attr_timeout = self.timeout_s
        entry.st_mode = pyfuse3.ModeT(attrs.mode)
        entry.st_nlink = attrs.nlink
        entry.st_uid = attrs.uid
        entry.st_gid = attrs.gid
        entry.st_rdev = 0
        entry.st_size = attrs.size
        entry.st_blksize = attrs.blksize
        entry.st_blocks = (attrs.size + 511) // 512  # st_blocks counts 512-byte units
        entry.st_atime_ns = attrs.mtime_ns
        entry.st_mtime_ns = attrs.mtime_ns
        entry.st_ctime_ns = attrs.mtime_ns
        return entry

    # -- metadata --------------------------------------------------------------------------

    @_errno_boundary
    async def lookup(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        try:
            node = await self.fs.lookup(parent_inode, name)
        except ObjectNotFoundError:
            # st_ino 0: the kernel caches the miss for entry_timeout (loaders probe many
            # missing files, again and again).
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = pyfuse3.InodeT(0)
            negative.entry_timeout = self.timeout_s
            return negative
        entry = self._entry(self.fs.attributes(node))
        self.fs.remember(node)  # the kernel holds one more reference once this is answered
        return entry

    async def forget(self, inode_list: Sequence[tuple[pyfuse3.InodeT, int]]) -> None:
        # Must not raise (pyfuse3 has no reply for it): the kernel dropped these references.
        for inode, nlookup in inode_list:
            try:
                self.fs.forget(inode, nlookup)
            except Exception:
                log.exception("forget(%d, %d) failed", inode, nlookup)

    @_errno_boundary
    async def getattr(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self._entry(await self.fs.getattr(inode))

    @_errno_boundary
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        data = pyfuse3.StatvfsData()
        data.f_bsize = self.fs.block_size
        data.f_frsize = 4096  # the unit of f_blocks
        data.f_blocks = 0
        data.f_bfree = 0
        data.f_bavail = 0
        inodes = self.fs.statistics()["inodes"]
        data.f_files = inodes
        data.f_ffree = 0
        data.f_favail = 0
        data.f_namemax = 255
        return data

    # -- directories -----------------------------------------------------------------------

    @_errno_boundary
    async def opendir(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileHandleT:
        return pyfuse3.FileHandleT(await self.fs.opendir(inode))

    @_errno_boundary
    async def readdir(self, fh: pyfuse3.FileHandleT, start_id: int, token: Any) -> None:
        for next_id, node in self.fs.readdir(fh, start_id):
            attrs = self._entry(self.fs.attributes(node))
            if not pyfuse3.readdir_reply(token, pyfuse3.FileNameT(node.name), attrs, next_id):
                break
            self.fs.remember(node)  # an entry the kernel took counts as a lookup

    @_errno_boundary
    async def releasedir(self, fh: pyfuse3.FileHandleT) -> None:
        self.fs.releasedir(fh)

    # -- files -----------------------------------------------------------------------------

    @_errno_boundary
    async def open(
        self, inode: pyfuse3.InodeT, flags: pyfuse3.FlagT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileInfo:
        fh, keep_cache = await self.fs.open(inode, flags)
        # Never direct_io: it would break mmap, which safetensors uses.
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fh), keep_cache=keep_cache)

    @_errno_boundary
    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        # pyfuse3 takes any buffer; a memoryview of a cached block saves a copy per request.
        data = await self.fs.read(fh, off, size)
        self.bytes_served += len(data)
        self.reads += 1
        return cast(bytes, data)

    @_errno_boundary
    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        self.fs.release(fh)

    @_errno_boundary
    async def flush(self, fh: pyfuse3.FileHandleT) -> None:
        return None

    @_errno_boundary
    async def fsync(self, fh: pyfuse3.FileHandleT, datasync: bool) -> None:
        # Nothing is ever dirty. What can be made durable is the local copy: fsync makes the
        # file's version whole in the disk cache (`objfs warm --cache-only`), answering once
        # it is written; EOPNOTSUPP without a disk cache. Nothing else sends it: a read-only
        # file is not fsynced by loaders or copy tools, and an extended attribute as the
        # trigger would have cost `ls -l` a request per file (it asks for security.selinux).
        await self.fs.warm(self.fs.handle_inode(fh))

    @_errno_boundary
    async def fsyncdir(self, fh: pyfuse3.FileHandleT, datasync: bool) -> None:
        return None

    # -- everything that would modify the tree ---------------------------------------------

    setattr = _read_only
    mknod = _read_only
    mkdir = _read_only
    unlink = _read_only
    rmdir = _read_only
    symlink = _read_only
    rename = _read_only
    link = _read_only
    write = _read_only
    create = _read_only
    setxattr = _read_only
    removexattr = _read_only
