"""What objfs answers to the kernel's FUSE INIT, and what that settles. No I/O.

Contract: :func:`negotiate` asks for what the kernel offers of ``ASYNC_READ``,
``PARALLEL_DIROPS``, ``DO_READDIRPLUS``, ``READDIRPLUS_AUTO``, ``MAX_PAGES`` (requests up to
``MAX_PAGES`` pages, within the kernel's cap) and ``INIT_EXT``, adds ``PASSTHROUGH`` where the
caller decided it (see :mod:`objfs.kernel.passthrough`), never ``WRITEBACK_CACHE``; it carries
``max_background`` and ``congestion_threshold`` in the reply itself and answers the minor
version min(the kernel's, ours). The result is kept in :class:`Negotiated` (logged with
:func:`log_negotiated`; ``objfs status`` shows :meth:`Negotiated.as_dict`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import objfs.kernel.writers as writers  # the module: WRITERS read when reported
from objfs.kernel import protocol as p
from objfs.kernel import replies as rp
from objfs.kernel.requests import Init

# The transport's log lines keep one logger name (objfs.kernel.session).
log = logging.getLogger("objfs.kernel.session")

# The largest write the kernel may send (none arrive: the mount is read-only); it sets the
# size every read buffer must have (80 + max_write, at least 8 KiB).
MAX_WRITE = 4096
# What objfs asks for when the kernel offers it.
_WANTED = (
    p.ASYNC_READ
    | p.PARALLEL_DIROPS
    | p.DO_READDIRPLUS
    | p.READDIRPLUS_AUTO
    | p.MAX_PAGES
    | p.INIT_EXT
)
_PAGE = 4096
# The largest request objfs asks for: 8 MiB (the kernel's own cap was 256 pages before 6.13
# and is fs.fuse.max_pages_limit since; objfs raises that sysctl to this when root). A cold
# load's READs, each a hand-off between threads or three, halve from 4 MiB ones; 16 MiB cost
# more (tests/benchmarks/README.md).
MAX_PAGES = 2048


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
            "reply_threads": writers.WRITERS,
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


def negotiate(
    init: Init,
    *,
    pages_limit: int,
    max_background: int,
    passthrough: bool,
    backing_depth: int = 0,
) -> tuple[bytes, Negotiated]:
    """The fuse_init_out to answer ``init`` with (major 7 only), and what it settles.

    ``pages_limit``: the kernel's cap on pages per request as the connection was made with;
    ``passthrough``: whether to ask for it (the caller checked the kernel offers it);
    ``backing_depth``: how deep the backing files' file system stacks (0 on a disk, 1 on
    overlayfs): the kernel takes backing files only from file systems shallower than
    ``max_stack_depth``, which is one more (at most 2, the kernel's limit; the mount itself
    then counts as that deep, so no stacking file system can be mounted over it)."""
    flags = init.flags & _WANTED
    if passthrough:
        flags |= p.PASSTHROUGH
    minor = min(init.minor, p.KERNEL_MINOR_VERSION)
    max_pages = min(pages_limit, MAX_PAGES) if flags & p.MAX_PAGES else 0
    payload = rp.init_out(
        minor=minor,
        max_readahead=init.max_readahead,
        flags=flags,
        max_background=max_background,
        congestion_threshold=max_background * 3 // 4,
        max_write=MAX_WRITE,
        max_pages=max_pages,
        max_stack_depth=min(backing_depth + 1, 2) if passthrough else 0,
    )
    settled = Negotiated(
        major=p.KERNEL_VERSION,
        minor=minor,
        flags=flags,
        max_pages=max_pages,
        max_readahead=init.max_readahead,
        max_background=max_background,
        names=_flag_names(flags),
    )
    return payload, settled


def log_negotiated(n: Negotiated) -> None:
    """The one log line that says what INIT settled."""
    log.info(
        "FUSE transport kernel: protocol 7.%d, %s, requests up to %d KiB, max_background %d",
        n.minor,
        " ".join(n.names) or "no optional features",
        (n.max_pages or 32) * _PAGE // 1024,
        n.max_background,
    )
