"""Fast, validating safetensors loader: parallel ``preadv`` into tensors or pinned buffers.

:func:`iter_safetensors` and :func:`load_safetensors` read a safetensors file (or a sharded
model) onto the CPU, straight into each tensor's storage, or onto a CUDA device through a pool
of pinned host buffers (:mod:`objfs.torch_pipeline`; the CPU path and ``.to(device)`` when
pinned memory cannot be allocated). Every header is validated first
(:mod:`objfs.safetensors_header`): a malformed file raises ``ValueError`` naming the file and
the problem before any large allocation happens.

``torch`` is imported lazily inside the functions that need it, so ``import objfs.torch_io``
stays cheap and works without torch (``read_header`` and ``resolve_safetensors_files`` are
torch-free).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Final

from objfs.safetensors_header import (
    DTYPES,
    INDEX_NAME,
    MAX_HEADER_BYTES,
    PathsArg,
    SafetensorsHeader,
    TensorEntry,
    read_header,
    resolve_safetensors_files,
)
from objfs.torch_pipeline import close_all, iter_cpu, iter_cuda, open_all, pin_pool, plan

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "DEFAULT_PREFETCH_BYTES",
    "DTYPES",
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "SafetensorsHeader",
    "TensorEntry",
    "iter_safetensors",
    "load_safetensors",
    "read_header",
    "resolve_safetensors_files",
]

logger = logging.getLogger(__name__)

_MiB: Final = 1024 * 1024

# Pieces of 16 MiB are large enough that per-request costs (syscall, FUSE round trip, CUDA copy
# launch) are noise, and small enough that a 1 GiB tensor is spread over 64 parallel reads.
DEFAULT_BUFFER_BYTES: Final = 16 * _MiB

# How far (in bytes) the streaming CPU iterator may read ahead of the consumer: several large
# weight matrices, so every thread stays busy, while host memory stays bounded for huge models.
DEFAULT_PREFETCH_BYTES: Final = 1024 * _MiB


# dtype= casts only these: plain floating weights.  Float8/float4 payloads are quantised data
# that belongs with its scales, so casting them would silently corrupt a quantised checkpoint.
_CASTABLE: Final = frozenset({"F16", "BF16", "F32", "F64"})


def _auto_threads() -> int:
    # Readers mostly wait in the kernel (page cache copies, FUSE or disk I/O): at least 4 keep
    # a deep request queue on slow storage; beyond 16 page-cache copies stop scaling.
    return min(16, max(4, os.cpu_count() or 4))


def _auto_buffers(threads: int) -> int:
    # One buffer per reader plus a few being copied to the device, within the 8-16 range that
    # bounds pinned memory to 16 x buffer_bytes.
    return max(8, min(16, threads + 4))


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def iter_safetensors(
    paths: PathsArg,
    device: str | torch.device = "cuda:0",
    *,
    dtype: torch.dtype | None = None,
    threads: int | None = None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    num_buffers: int | None = None,
    prefetch_bytes: int | None = DEFAULT_PREFETCH_BYTES,
    huge_pages: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of ``paths`` in file order, loading ahead.

    ``paths``: see :func:`resolve_safetensors_files`.  All headers are read and validated before
    the first tensor is yielded; tensor names must be unique across files.  Tensors come in file
    order (files in the resolved order, tensors by data offset) as soon as their bytes have
    arrived, while later tensors keep loading in the background.

    ``device``: ``"cpu"``, a CUDA device (pinned-buffer path), or any other torch device (loaded
    on the CPU, then moved).  Requesting CUDA while ``torch.cuda.is_available()`` is false raises
    ``RuntimeError``.  CUDA tensors are ordered on the caller's current stream: using them from
    that stream needs no synchronisation.

    ``dtype``: if given, F16/BF16/F32/F64 tensors are cast to it; integer, bool, complex and the
    quantised float8/float4 dtypes are returned as stored.

    ``threads``: reader threads (default: CPU count clamped to 4..16).  ``buffer_bytes``: the read
    request size and, on CUDA, the size of each pinned buffer.  ``num_buffers``: pinned buffers
    (CUDA only; default 8..16 depending on ``threads``).  ``prefetch_bytes``: CPU path only, how
    many bytes may be read ahead of the tensor last yielded (``None``: unbounded); at least the
    next tensor is always read in full.  ``huge_pages``: CPU path only, ``madvise`` tensors of 8
    MiB or more onto transparent huge pages (Linux): faster when the process reuses memory
    (repeated loads), but the first huge-page allocations of a process can stall, so a single
    load may be slower (figures in tests/benchmarks/README.md).

    Each yielded tensor owns its storage.  Closing the generator early stops the readers and
    releases buffers and file descriptors.  Bad arguments and missing paths raise right away;
    files are opened when iteration starts, so malformed files raise ``ValueError`` and I/O
    errors ``OSError`` (both naming the file) from the first ``next()``.
    """
    import torch

    if sys.byteorder != "little":
        raise NotImplementedError("safetensors data is little-endian; big-endian hosts unsupported")
    if not hasattr(os, "preadv"):
        raise NotImplementedError("objfs.torch_io needs os.preadv (Linux, macOS 11+)")
    n_threads = _auto_threads() if threads is None else threads
    _check_positive("threads", n_threads)
    _check_positive("buffer_bytes", buffer_bytes)
    n_buffers = _auto_buffers(n_threads) if num_buffers is None else num_buffers
    _check_positive("num_buffers", n_buffers)
    if prefetch_bytes is not None:
        _check_positive("prefetch_bytes", prefetch_bytes)
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {target} requested but torch.cuda.is_available() is False")
    files = resolve_safetensors_files(paths)
    # Arguments are checked above, eagerly; files are opened only once iteration starts, so a
    # generator that is never iterated holds no descriptors.
    window = sys.maxsize if prefetch_bytes is None else prefetch_bytes
    return _generate(
        files, target, dtype, n_threads, buffer_bytes, n_buffers, window, bool(huge_pages)
    )


def _generate(
    files: list[str],
    target: torch.device,
    dtype: torch.dtype | None,
    threads: int,
    buffer_bytes: int,
    num_buffers: int,
    window: int,
    huge_pages: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    opened = open_all(files)
    started = time.perf_counter()
    total = 0
    stream: Generator[tuple[str, torch.Tensor], None, None] | None = None
    try:
        items, segments = plan([o.header for o in opened], buffer_bytes)
        if target.type == "cuda":
            pool = pin_pool(num_buffers, buffer_bytes)
            if pool is not None:
                stream = iter_cuda(opened, items, segments, threads, target, pool)
        if stream is None:
            stream = iter_cpu(opened, items, segments, threads, window, huge_pages)
        for name, tensor in stream:
            total += tensor.nbytes
            if tensor.device != target:
                tensor = tensor.to(target)
            if dtype is not None and tensor.dtype != dtype and _castable(tensor.dtype):
                tensor = tensor.to(dtype)
            yield name, tensor
    finally:
        if stream is not None:
            stream.close()  # stops the reader threads before their descriptors are closed
        close_all(opened)
    elapsed = time.perf_counter() - started
    logger.debug(
        "loaded %d tensors, %.1f MiB from %d files to %s in %.3f s (%.0f MiB/s)",
        len(items),
        total / _MiB,
        len(files),
        target,
        elapsed,
        total / _MiB / max(elapsed, 1e-9),
    )


def _castable(dtype: torch.dtype) -> bool:
    """True for the torch dtypes of the codes in _CASTABLE (float16, bfloat16, 32 and 64)."""
    import torch

    return any(dtype == getattr(torch, str(DTYPES[code].torch_name)) for code in _CASTABLE)


def load_safetensors(
    paths: PathsArg,
    device: str | torch.device = "cuda:0",
    *,
    dtype: torch.dtype | None = None,
    threads: int | None = None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    num_buffers: int | None = None,
    huge_pages: bool = False,
) -> dict[str, torch.Tensor]:
    """Load every tensor of ``paths`` onto ``device`` and return ``{name: tensor}``.

    Same arguments and errors as :func:`iter_safetensors`, without a read-ahead bound.  The
    result equals ``safetensors.torch.load_file`` (dtype, shape and bytes) for every file, with
    each tensor in its own storage.
    """
    return dict(
        iter_safetensors(
            paths,
            device,
            dtype=dtype,
            threads=threads,
            buffer_bytes=buffer_bytes,
            num_buffers=num_buffers,
            prefetch_bytes=None,
            huge_pages=huge_pages,
        )
    )
