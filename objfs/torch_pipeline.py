"""The read pipelines of :mod:`objfs.torch_io`: planned ``preadv`` into tensors or pinned buffers.

:func:`plan` cuts the tensor bytes of validated headers into segments of one buffer's worth,
aligned on multiples of ``buffer_bytes``; reader threads then issue large, mostly sequential
``os.preadv`` requests, which is what a FUSE mount's read-ahead and the page cache reward.
Bytes land directly in their final home:

* :func:`iter_cpu`: every tensor gets its own storage (``torch.empty`` with its dtype and
  shape) and the file bytes are read straight into it; no mmap, no intermediate buffer. Big
  tensors are cut into pieces so that one large tensor keeps every thread busy; runs of small
  adjacent tensors are read with one scatter ``preadv``. Read-ahead is bounded by bytes.
  Optionally large tensors are advised onto transparent huge pages.
* :func:`iter_cuda`: a small pool of page-locked host buffers (:func:`pin_pool`) is filled by
  the reader threads and each filled buffer is copied host-to-device (``non_blocking=True``) on
  a dedicated CUDA stream into per-tensor device allocations; a CUDA event per buffer says when
  it may be refilled. Tensors that span buffers are assembled on the device, and each is
  ordered on the consumer's current stream before it is yielded.

Both yield ``(name, tensor)`` in file order and stop their threads when closed. ``torch`` is
imported inside the functions that need it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import sys
from collections.abc import Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from objfs.safetensors_header import DTYPES, SafetensorsHeader, TensorEntry, parse_header

if TYPE_CHECKING:
    import torch

# The loader's logger: these pipelines are part of objfs.torch_io.
logger = logging.getLogger("objfs.torch_io")

_MiB: Final = 1024 * 1024

# Linux accepts at most IOV_MAX (1024) iovecs per preadv; stay well below it.
_MAX_IOVECS: Final = 512

# 2 MiB is the x86-64 / arm64 transparent huge page size used for madvise(MADV_HUGEPAGE).
_HUGE_PAGE: Final = 2 * _MiB

# Only tensors of at least this size are worth a madvise syscall (several huge pages).
_HUGE_PAGE_MIN_TENSOR: Final = 8 * _MiB

# madvise advice value from <sys/mman.h> on Linux.
_MADV_HUGEPAGE: Final = 14


# --------------------------------------------------------------------------------------------
# Read planning shared by the CPU and CUDA paths.


@dataclass(slots=True)
class _Piece:
    item: int  # index into the global tensor list
    tensor_offset: int  # byte offset inside the tensor
    file_offset: int  # absolute byte offset in the file
    length: int


@dataclass(slots=True)
class _Segment:
    """A file range inside one ``buffer_bytes``-aligned window: one buffer's worth of reading."""

    file: int
    lo: int
    hi: int
    pieces: list[_Piece]


@dataclass(frozen=True, slots=True)
class _Item:
    file: int
    entry: TensorEntry
    last_segment: int  # the tensor is complete once segments up to this index are done


def plan(
    headers: list[SafetensorsHeader], segment_bytes: int
) -> tuple[list[_Item], list[_Segment]]:
    """Cut every file's tensor bytes into segments aligned on multiples of ``segment_bytes``."""
    items: list[_Item] = []
    segments: list[_Segment] = []
    for file_index, header in enumerate(headers):
        current: _Segment | None = None
        current_window = -1
        for entry in header.tensors:
            index = len(items)
            pos, end = entry.start, entry.start + entry.nbytes
            while pos < end:
                window = pos // segment_bytes
                hi = min(end, (window + 1) * segment_bytes)
                if current is None or window != current_window:
                    current = _Segment(file_index, pos, hi, [])
                    current_window = window
                    segments.append(current)
                else:
                    current.hi = hi
                current.pieces.append(_Piece(index, pos - entry.start, pos, hi - pos))
                pos = hi
            items.append(_Item(file_index, entry, len(segments) - 1))
    return items, segments


def _preadv_full(fd: int, buffers: list[memoryview], offset: int, path: str) -> None:
    """Fill ``buffers`` from consecutive file bytes at ``offset``, looping over short reads."""
    pending = [b for b in buffers if b.nbytes]
    while pending:
        try:
            got = os.preadv(fd, pending, offset)
        except OSError as exc:
            total = sum(b.nbytes for b in pending)
            raise OSError(
                exc.errno, f"{path}: reading {total} bytes at offset {offset} failed: {exc}"
            ) from exc
        if got == 0:
            raise ValueError(
                f"{path}: unexpected end of file at offset {offset} (was it truncated?)"
            )
        offset += got
        done = 0
        while done < len(pending) and got >= pending[done].nbytes:
            got -= pending[done].nbytes
            done += 1
        pending = pending[done:]
        if got:
            pending[0] = pending[0][got:]


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor sharing its storage."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def _torch_dtype(path: str, code: str) -> torch.dtype:
    import torch

    name = DTYPES[code].torch_name
    dtype = getattr(torch, name, None) if name else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{path}: dtype {code} has no equivalent in torch {torch.__version__}")
    return dtype


def _torch_shape(entry: TensorEntry) -> tuple[int, ...]:
    if DTYPES[entry.dtype].bits == 4:
        # float4_e2m1fn_x2 packs two F4 values per element.
        return (*entry.shape[:-1], entry.shape[-1] // 2)
    return entry.shape


def _advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask Linux to back a large fresh CPU tensor with huge pages (512x fewer page faults).

    Only advice: with THP disabled, an old kernel or no libc, pages stay ordinary.
    """
    nbytes = tensor.untyped_storage().nbytes()
    libc = _libc()
    if nbytes < _HUGE_PAGE_MIN_TENSOR or libc is None:
        return
    import ctypes

    address = tensor.data_ptr()
    lo = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    hi = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if hi > lo:
        # Advice only; failure (old kernel, THP disabled) just means ordinary pages.
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE)


@functools.cache
def _libc() -> Any:  # a ctypes.CDLL, whose functions are only known at run time
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


@dataclass(slots=True)
class _Open:
    fd: int
    header: SafetensorsHeader


def open_all(files: list[str]) -> list[_Open]:
    """Open and validate every file (sequential read hint); tensor names must be unique across
    them. On any error the files opened so far are closed again."""
    opened: list[_Open] = []
    try:
        for name in files:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
            try:
                header = parse_header(fd, name, os.fstat(fd).st_size)
            except BaseException:
                os.close(fd)
                raise
            opened.append(_Open(fd, header))
            if hasattr(os, "posix_fadvise"):
                # Sequential hint: doubles kernel read-ahead (also on FUSE mounts).
                with contextlib.suppress(OSError):  # only a hint
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except BaseException:
        close_all(opened)
        raise
    seen: dict[str, str] = {}
    for item in opened:
        for entry in item.header.tensors:
            other = seen.setdefault(entry.name, item.header.path)
            if other != item.header.path:
                close_all(opened)
                raise ValueError(
                    f"tensor {entry.name!r} appears in both {other} and {item.header.path}"
                )
    return opened


def close_all(opened: list[_Open]) -> None:
    """Close what :func:`open_all` opened."""
    for item in opened:
        os.close(item.fd)


# --------------------------------------------------------------------------------------------
# CPU path: read straight into each tensor's storage.


def _empty(opened: list[_Open], item: _Item, device: torch.device) -> torch.Tensor:
    import torch

    path = opened[item.file].header.path
    return torch.empty(
        _torch_shape(item.entry), dtype=_torch_dtype(path, item.entry.dtype), device=device
    )


def iter_cpu(
    opened: list[_Open],
    items: list[_Item],
    segments: list[_Segment],
    threads: int,
    window: int,
    huge_pages: bool,
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """CPU tensors of ``items`` in order, read by ``threads`` readers at most ``window`` bytes
    ahead of the tensor yielded last (the next tensor is always read in full)."""
    import torch

    cpu = torch.device("cpu")
    tensors: dict[int, torch.Tensor] = {}
    views: dict[int, memoryview] = {}
    futures: list[list[Future[None]]] = []
    # cumulative[i]: bytes in segments 0..i, to bound read-ahead by bytes.
    cumulative = list(_accumulate(sum(p.length for p in s.pieces) for s in segments))

    def submit(segment: _Segment) -> list[Future[None]]:
        fd, path = opened[segment.file].fd, opened[segment.file].header.path
        jobs: list[Future[None]] = []
        run: list[memoryview] = []
        run_start = run_end = -1
        for piece in segment.pieces:
            view = views.get(piece.item)
            if view is None:
                tensor = _empty(opened, items[piece.item], cpu)
                if huge_pages:
                    _advise_huge_pages(tensor)
                tensors[piece.item] = tensor
                view = views[piece.item] = _byte_view(tensor).numpy().data
            target = view[piece.tensor_offset : piece.tensor_offset + piece.length]
            if piece.file_offset != run_end or len(run) >= _MAX_IOVECS:
                if run:
                    jobs.append(pool.submit(_preadv_full, fd, run, run_start, path))
                run, run_start = [], piece.file_offset
            run.append(target)
            run_end = piece.file_offset + piece.length
        if run:
            jobs.append(pool.submit(_preadv_full, fd, run, run_start, path))
        return jobs

    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="objfs-read")
    waited = 0
    try:
        for index, item in enumerate(items):
            need = item.last_segment
            base = cumulative[need] if need >= 0 else 0
            while len(futures) < len(segments) and (
                len(futures) <= need or cumulative[len(futures)] - base <= window
            ):
                futures.append(submit(segments[len(futures)]))
            while waited <= need:
                jobs = futures[waited]
                while jobs:
                    jobs.pop().result()
                waited += 1
            tensor = tensors.pop(index, None)
            views.pop(index, None)
            if tensor is None:  # zero-size tensor: no bytes to read
                tensor = _empty(opened, item, cpu)
            yield item.entry.name, tensor
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _accumulate(values: Iterable[int]) -> Iterator[int]:
    total = 0
    for value in values:
        total += value
        yield total


# --------------------------------------------------------------------------------------------
# CUDA path: pinned host buffers, H2D copies on a dedicated stream, per-buffer events.


@dataclass(slots=True)
class _Pinned:
    tensor: torch.Tensor
    view: memoryview
    ready: torch.cuda.Event | None  # recorded after the last copy out of this buffer


def pin_pool(count: int, size: int) -> list[_Pinned] | None:
    """Allocate ``count`` page-locked buffers, or return None (and log) if pinning fails."""
    import torch

    pool: list[_Pinned] = []
    try:
        for _ in range(count):
            tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            pool.append(_Pinned(tensor, tensor.numpy().data, None))
    except RuntimeError as exc:
        logger.warning(
            "objfs: cannot pin %d x %d bytes of host memory (%s); loading through the CPU "
            "path and .to(device) instead",
            count,
            size,
            exc,
        )
        return None
    return pool


def _fill(fd: int, buffer: _Pinned, segment: _Segment, path: str) -> None:
    if buffer.ready is not None:
        buffer.ready.synchronize()  # the previous H2D copy out of this buffer has finished
    _preadv_full(fd, [buffer.view[: segment.hi - segment.lo]], segment.lo, path)


def iter_cuda(
    opened: list[_Open],
    items: list[_Item],
    segments: list[_Segment],
    threads: int,
    device: torch.device,
    pool: list[_Pinned],
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Tensors of ``items`` on ``device`` in order, through the pinned buffers of ``pool``;
    each is ready to use on the caller's current stream."""
    import torch

    consumer = torch.cuda.current_stream(device)
    copier = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # untyped in torch
    free = collections.deque(pool)
    reading: collections.deque[tuple[_Segment, _Pinned, Future[None]]] = collections.deque()
    staged: dict[int, torch.Tensor] = {}  # device byte views of tensors being assembled
    done: dict[int, torch.Tensor] = {}
    last_event: torch.cuda.Event | None = None
    next_read = 0
    readers = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="objfs-read")

    def pump() -> None:
        nonlocal next_read
        while next_read < len(segments) and free:
            segment, buffer = segments[next_read], free.popleft()
            source = opened[segment.file]
            future = readers.submit(_fill, source.fd, buffer, segment, source.header.path)
            reading.append((segment, buffer, future))
            next_read += 1

    def issue() -> None:
        """Queue the H2D copies of the oldest segment once its buffer is filled."""
        nonlocal last_event
        segment, buffer, future = reading.popleft()
        future.result()
        with torch.cuda.stream(copier):
            for piece in segment.pieces:
                target = staged.get(piece.item)
                if target is None:
                    # Allocated on the copy stream so the allocator orders reuse after our copies.
                    tensor = _empty(opened, items[piece.item], device)
                    done[piece.item] = tensor
                    target = staged[piece.item] = _byte_view(tensor)
                lo = piece.file_offset - segment.lo
                target[piece.tensor_offset : piece.tensor_offset + piece.length].copy_(
                    buffer.tensor[lo : lo + piece.length], non_blocking=True
                )
            # Blocking: readers waiting for a buffer sleep instead of spinning on a CPU core.
            event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]  # untyped in torch
            event.record(copier)
        buffer.ready = last_event = event
        free.append(buffer)
        pump()

    issued = 0
    awaited: torch.cuda.Event | None = None  # newest copy event the consumer already waits on
    try:
        pump()
        for index, item in enumerate(items):
            while issued <= item.last_segment:
                issue()
                issued += 1
            tensor = done.pop(index, None)
            staged.pop(index, None)
            if tensor is None:
                tensor = _empty(opened, item, device)  # zero-size: allocated on the consumer
            elif last_event is not None:
                if awaited is not last_event:  # one wait covers every tensor it completed
                    consumer.wait_event(last_event)
                    awaited = last_event
                # The consumer stream uses the tensor from now on: the allocator must not hand
                # its memory to the copy stream again before the consumer's work is done.
                tensor.record_stream(consumer)
            yield item.entry.name, tensor
    finally:
        readers.shutdown(wait=True, cancel_futures=True)
        # Pinned buffers and device tensors may still be in flight on the copy stream.
        copier.synchronize()
