"""The binding ceiling: what a FUSE transport can serve on this machine, from memory.

``python -m tests.benchmarks.binding_ceiling SRC_DIR MOUNTPOINT [--transport T]`` reads every
file under
SRC_DIR (dot files excepted, as the bucket has none) into memory, then mounts MOUNTPOINT and
serves that tree read-only until SIGINT/SIGTERM or an unmount. It answers only what a load
needs: lookup, getattr, opendir/readdir/releasedir, open (``keep_cache=True``), read (a
memoryview slice of the file's bytes, no copy), flush and release; no store, no cache, no
read-ahead logic.

Everything between the loader and the handlers is objfs's: the same mount options
(``objfs.kernel_setup.fuse_options``, with this file system's own fsname and subtype), the same
pyfuse3 task limit, the same attribute timeouts and block size (``objfs.config.MountConfig``
defaults), and, once the kernel's INIT is answered, the same kernel tuning
(``kernel_setup.tune_kernel`` with objfs's defaults: the mount's bdi ``read_ahead_kb``, the FUSE
connection's ``max_background`` and ``congestion_threshold``). That tuning finds the mount's
major:minor in /proc/self/mountinfo and never touches the mountpoint, which this process alone
could answer. ``bench_models`` loads the model through it like through objfs: the gap between
the two is objfs's own, not the kernel's or the binding's.

``--transport pyfuse3`` (the default) serves the tree through pyfuse3 (``MemoryOperations``);
``--transport kernel`` through objfs's own transport (:class:`objfs.kernel.session.
KernelSession`, its INIT, reader thread and reply writers), with ``MemoryCore`` standing in for
objfs's ``FileSystem``: the ceiling of the transport objfs mounts with by default.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pyfuse3
import trio

from objfs.config import MountConfig, parse_source
from objfs.errors import IsADirectoryFsError, ObjectNotFoundError, ReadOnlyError
from objfs.fs import Attributes, FileSystem
from objfs.kernel.session import KernelSession
from objfs.kernel_setup import fuse_options, tune_kernel
from objfs.mount import _MAX_FUSE_TASKS

NAME = "binding-ceiling"
log = logging.getLogger(NAME)


@dataclass
class Node:
    inode: int
    name: bytes
    mode: int
    mtime_ns: int
    data: bytes = b""
    children: dict[bytes, Node] = field(default_factory=dict)  # directories only


class MemoryOperations(pyfuse3.Operations):
    """Read-only FUSE operations over a tree held in memory."""

    enable_writeback_cache = False

    def __init__(self, root: Node, config: MountConfig) -> None:
        super().__init__()
        self.nodes = {root.inode: root}
        stack = [root]
        while stack:
            for child in stack.pop().children.values():
                self.nodes[child.inode] = child
                stack.append(child)
        self.timeout_s = config.kernel_timeout_s()
        self.block_size = config.block_size_bytes
        self.uid, self.gid = os.getuid(), os.getgid()
        self.initialized = trio.Event()

    def init(self) -> None:
        self.initialized.set()

    def _node(self, inode: int) -> Node:
        node = self.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _entry(self, node: Node) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = pyfuse3.InodeT(node.inode)
        entry.generation = 0
        entry.entry_timeout = self.timeout_s
        entry.attr_timeout = self.timeout_s
        entry.st_mode = pyfuse3.ModeT(node.mode)
        entry.st_nlink = 2 if stat.S_ISDIR(node.mode) else 1
        entry.st_uid = self.uid
        entry.st_gid = self.gid
        entry.st_rdev = 0
        entry.st_size = len(node.data)
        entry.st_blksize = self.block_size
        entry.st_blocks = (len(node.data) + 511) // 512
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = node.mtime_ns
        return entry

    async def lookup(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        node = self._node(parent_inode).children.get(name)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._entry(node)

    async def getattr(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self._entry(self._node(inode))

    async def opendir(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileHandleT:
        if not stat.S_ISDIR(self._node(inode).mode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return pyfuse3.FileHandleT(inode)

    async def readdir(self, fh: pyfuse3.FileHandleT, start_id: int, token: Any) -> None:
        entries = list(self._node(fh).children.values())
        for index in range(start_id, len(entries)):
            node = entries[index]
            if not pyfuse3.readdir_reply(
                token, pyfuse3.FileNameT(node.name), self._entry(node), index + 1
            ):
                break

    async def releasedir(self, fh: pyfuse3.FileHandleT) -> None:
        return None

    async def open(
        self, inode: pyfuse3.InodeT, flags: pyfuse3.FlagT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileInfo:
        node = self._node(inode)
        if stat.S_ISDIR(node.mode):
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(inode), keep_cache=True)

    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        # pyfuse3 takes any contiguous buffer: a slice of the file's bytes, no copy.
        return cast(bytes, memoryview(self.nodes[fh].data)[off : off + size])

    async def flush(self, fh: pyfuse3.FileHandleT) -> None:
        return None

    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        return None


class MemoryCore:
    """What :class:`KernelSession` asks of objfs's ``FileSystem``, answered from the same
    tree in memory: a READ is a slice of the file's bytes (no copy, nothing held), no disk
    tier (so no passthrough), no store."""

    disk = None

    def __init__(self, root: Node, config: MountConfig) -> None:
        self.config = config
        self.nodes = MemoryOperations(root, config).nodes
        self.block_size = config.block_size_bytes
        self.uid, self.gid = os.getuid(), os.getgid()
        self._handles: dict[int, int] = {}  # fh -> inode
        self._next_fh = 1

    def _node(self, inode: int) -> Node:
        node = self.nodes.get(inode)
        if node is None:
            raise ObjectNotFoundError(f"no inode {inode}")
        return node

    def _fh(self, inode: int) -> int:
        fh, self._next_fh = self._next_fh, self._next_fh + 1
        self._handles[fh] = inode
        return fh

    def attributes(self, node: Node) -> Attributes:
        is_dir = stat.S_ISDIR(node.mode)
        return Attributes(
            inode=node.inode,
            mode=node.mode,
            nlink=2 if is_dir else 1,
            uid=self.uid,
            gid=self.gid,
            size=len(node.data),
            mtime_ns=node.mtime_ns,
            blksize=self.block_size,
        )

    async def lookup(self, parent_inode: int, name: bytes) -> Node:
        node = self._node(parent_inode).children.get(name)
        if node is None:
            raise ObjectNotFoundError(f"no {name!r}")
        return node

    def remember(self, node: Node) -> None:
        return None

    def forget(self, inode: int, nlookup: int) -> None:
        return None

    async def getattr(self, inode: int) -> Attributes:
        return self.attributes(self._node(inode))

    async def opendir(self, inode: int) -> int:
        return self._fh(inode)

    def readdir(self, fh: int, start: int) -> list[tuple[int, Node]]:
        entries = list(self._node(self._handles[fh]).children.values())
        return [(index + 1, entries[index]) for index in range(start, len(entries))]

    def releasedir(self, fh: int) -> None:
        self._handles.pop(fh, None)

    async def whole_on_disk(self, inode: int) -> str | None:
        return None

    async def open(self, inode: int, flags: int, *, prefetch: bool = True) -> tuple[int, bool]:
        if stat.S_ISDIR(self._node(inode).mode):
            raise IsADirectoryFsError("a directory")
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise ReadOnlyError("read-only")
        return self._fh(inode), True

    async def read(
        self, fh: int, offset: int, size: int, *, holds: list[Any] | None = None
    ) -> memoryview:
        return memoryview(self.nodes[self._handles[fh]].data)[offset : offset + size]

    def handle_inode(self, fh: int) -> int:
        return self._handles[fh]

    def release(self, fh: int) -> None:
        self._handles.pop(fh, None)

    async def warm(self, inode: int) -> int:
        return 0

    def statistics(self) -> dict[str, int]:
        return {"inodes": len(self.nodes)}


def load_tree(src: Path) -> Node:
    """Every file under ``src`` (dot files excepted) read into memory."""
    inodes = iter(range(pyfuse3.ROOT_INODE, 1 << 62))
    root = Node(next(inodes), b"", stat.S_IFDIR | 0o555, src.stat().st_mtime_ns)
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        parent = root
        for part in rel.parts[:-1]:
            name = os.fsencode(part)
            if name not in parent.children:
                mtime = (src / part).stat().st_mtime_ns
                parent.children[name] = Node(next(inodes), name, stat.S_IFDIR | 0o555, mtime)
            parent = parent.children[name]
        name = os.fsencode(rel.parts[-1])
        parent.children[name] = Node(
            next(inodes), name, stat.S_IFREG | 0o444, path.stat().st_mtime_ns, path.read_bytes()
        )
    return root


async def serve(ops: MemoryOperations, config: MountConfig) -> None:
    options = {o for o in fuse_options(config) if not o.startswith(("fsname=", "subtype="))}
    pyfuse3.init(ops, config.mountpoint, options | {f"fsname={NAME}", f"subtype={NAME}"})
    files = [n for n in ops.nodes.values() if stat.S_ISREG(n.mode)]
    log.info(
        "serving %d files (%d bytes) from memory on %s",
        len(files),
        sum(len(n.data) for n in files),
        config.mountpoint,
    )

    async def tune_after_init() -> None:
        await ops.initialized.wait()
        tune_kernel(config)

    async def watch_signals() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                pyfuse3.terminate()
                return

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tune_after_init)
            nursery.start_soon(watch_signals)
            await pyfuse3.main(max_tasks=_MAX_FUSE_TASKS)
            nursery.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=True)


async def serve_kernel(core: MemoryCore, config: MountConfig) -> None:
    """The same tree through objfs's own transport, tuned as objfs tunes its mounts."""
    session = KernelSession(cast(FileSystem, core), config, None)
    session.mount()
    files = [n for n in core.nodes.values() if stat.S_ISREG(n.mode)]
    log.info(
        "serving %d files (%d bytes) from memory on %s (kernel transport)",
        len(files),
        sum(len(n.data) for n in files),
        config.mountpoint,
    )

    async def tune_after_init() -> None:
        await session.initialized.wait()
        tune_kernel(config)

    async def watch_signals() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                session.stop()
                return

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tune_after_init)
            nursery.start_soon(watch_signals)
            await session.serve()
            nursery.cancel_scope.cancel()
    finally:
        session.close(unmount=True)


TRANSPORTS = ("pyfuse3", "kernel")


def main(argv: list[str]) -> int:
    transport = "pyfuse3"
    if len(argv) == 4 and argv[2] == "--transport" and argv[3] in TRANSPORTS:
        transport, argv = argv[3], argv[:2]
    if len(argv) != 2:
        print(
            "usage: python -m tests.benchmarks.binding_ceiling SRC_DIR MOUNTPOINT"
            " [--transport pyfuse3|kernel]",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s"
    )
    src = Path(argv[0])
    # A real path before mounting: nothing may resolve it once it is mounted.
    config = MountConfig(source=parse_source(f"s3://{NAME}"), mountpoint=os.path.realpath(argv[1]))
    root = load_tree(src)
    if transport == "kernel":
        trio.run(serve_kernel, MemoryCore(root, config), config)
    else:
        trio.run(serve, MemoryOperations(root, config), config)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
