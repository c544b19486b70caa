#!/usr/bin/env python3
"""Benchmark objfs.torch_io.load_safetensors against safetensors.torch.load_file.

Usage:
    python tests/benchmarks/bench_torch_io.py --make 1024 /tmp/bench.safetensors
    python tests/benchmarks/bench_torch_io.py /tmp/bench.safetensors --device cpu --repeat 5
    python tests/benchmarks/bench_torch_io.py /mnt/model --device cuda:0 --repeat 3 --drop-caches

Prints medians as a markdown table.  Rows:

* ``objfs load_safetensors``: our loader onto ``--device`` (CUDA: synchronised).
* baseline, CPU: ``load_file`` then touching one byte in every 4 KiB page of every tensor, which
  forces the lazily mmapped data to be read; CUDA: ``load_file`` then ``.to(device)``.
* CPU only, for reference: ``load_file`` then ``.clone()`` of every tensor (a full private copy,
  which is what objfs produces).
* CUDA only: raw pinned host-to-device bandwidth (one pinned tensor ``.to(device,
  non_blocking=True)`` + synchronize), the ceiling for any loader.

"cold" drops the files from the page cache before each run with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (``--drop-caches``: also ``echo 3 >
/proc/sys/vm/drop_caches``, root only); "warm" reads them once first.  On an objfs mount, objfs'
own block cache may still hold data after the kernel cache is dropped.

This is a script, not a test: pytest does not collect it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

try:
    from objfs.torch_io import load_safetensors, resolve_safetensors_files
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from objfs.torch_io import load_safetensors, resolve_safetensors_files

MiB = 1024 * 1024
PAGE = 4096  # the page size whose every page the baseline touches

# Shapes of a Llama-style 7B layer (hidden 4096, MLP 11008) in bf16: a realistic tensor mix of
# 32 MiB attention matrices, 86 MiB MLP matrices and tiny norm vectors.
HIDDEN = 4096
MLP = 11008
VOCAB = 32000


def make_file(size_mb: int, path: Path) -> None:
    """Write a bf16 safetensors file of about ``size_mb`` MiB with a transformer-like layout."""
    budget = size_mb * MiB
    shapes: list[tuple[str, tuple[int, ...]]] = []
    used = 0

    def add(name: str, shape: tuple[int, ...]) -> bool:
        nonlocal used
        nbytes = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        if used + nbytes > budget:
            return False
        shapes.append((name, shape))
        used += nbytes
        return True

    add("model.embed_tokens.weight", (VOCAB, HIDDEN))
    layer = 0
    while True:
        p = f"model.layers.{layer}."
        parts = [
            ("input_layernorm.weight", (HIDDEN,)),
            ("self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            ("self_attn.k_proj.weight", (HIDDEN, HIDDEN)),
            ("self_attn.v_proj.weight", (HIDDEN, HIDDEN)),
            ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            ("post_attention_layernorm.weight", (HIDDEN,)),
            ("mlp.gate_proj.weight", (MLP, HIDDEN)),
            ("mlp.up_proj.weight", (MLP, HIDDEN)),
            ("mlp.down_proj.weight", (HIDDEN, MLP)),
        ]
        if not all(add(p + name, shape) for name, shape in parts):
            break
        layer += 1
    # Fill what is left with rows of a final matrix so the file has about the requested size.
    rows = (budget - used) // (2 * HIDDEN)
    if rows:
        add("lm_head.weight", (rows, HIDDEN))

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes:
        nbytes = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors pads the header so data starts 8-aligned
    # One random 64 MiB block, repeated: realistic bytes without generating gigabytes of noise.
    block = torch.randn(32 * MiB, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        left = offset
        while left:
            chunk = block[: min(left, len(block))]
            f.write(chunk)
            left -= len(chunk)
    print(f"wrote {path}: {offset / MiB:.0f} MiB in {len(shapes)} tensors, {layer} layers")


def drop_cache(files: list[str], drop_all: bool) -> None:
    if drop_all:
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except OSError as exc:
            sys.exit(f"--drop-caches needs root: {exc}")
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(files: list[str]) -> None:
    buffer = bytearray(16 * MiB)  # reused: warming must not churn the allocator
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def touch_pages(tensors: dict[str, torch.Tensor]) -> int:
    total = 0
    for tensor in tensors.values():
        raw = tensor.reshape(-1).view(torch.uint8)
        if raw.numel():
            total += int(raw[::PAGE].sum()) + int(raw[-1])
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_objfs(files: list[str], device: torch.device, args: argparse.Namespace) -> None:
    out = load_safetensors(
        files,
        device,
        threads=args.threads,
        buffer_bytes=args.buffer_mib * MiB,
        num_buffers=args.buffers,
        huge_pages=args.huge_pages,
    )
    sync(device)
    del out


def run_baseline(files: list[str], device: torch.device, args: argparse.Namespace) -> None:
    for name in files:
        tensors = load_file(name)
        if device.type == "cuda":
            moved = {k: v.to(device) for k, v in tensors.items()}
            sync(device)
            del moved
        else:
            touch_pages(tensors)
        del tensors


def run_clone(files: list[str], device: torch.device, args: argparse.Namespace) -> None:
    for name in files:
        tensors = load_file(name)
        copies = {k: v.clone() for k, v in tensors.items()}
        del copies, tensors


def h2d_bandwidth(device: torch.device, nbytes: int, repeat: int) -> float:
    """Median seconds to copy ``nbytes`` from one pinned tensor to ``device``."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    times = []
    for _ in range(repeat + 1):  # the first copy also pays for the device allocation
        start = time.perf_counter()
        dev = host.to(device, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        del dev
    return statistics.median(times[1:])


def measure(
    fn: Callable[[list[str], torch.device, argparse.Namespace], None],
    files: list[str],
    device: torch.device,
    args: argparse.Namespace,
    cold: bool,
) -> float:
    fn(files, device, args)  # untimed: one-time costs (CUDA context, lazy imports, pinned pool)
    times = []
    for _ in range(args.repeat):
        gc.collect()
        if cold:
            drop_cache(files, args.drop_caches)
        else:
            warm_cache(files)
        start = time.perf_counter()
        fn(files, device, args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="safetensors files, model folders or index json")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--threads", type=int, default=None, help="loader threads (default auto)")
    parser.add_argument("--buffer-mib", type=int, default=16, help="read size / pinned buffer")
    parser.add_argument("--buffers", type=int, default=None, help="pinned buffers (CUDA)")
    parser.add_argument("--modes", default="cold,warm", help="comma list of cold, warm")
    parser.add_argument("--huge-pages", action="store_true", help="objfs huge_pages=True (CPU)")
    parser.add_argument("--drop-caches", action="store_true", help="also drop all caches (root)")
    parser.add_argument(
        "--make", nargs=2, metavar=("SIZE_MB", "PATH"), help="write a test file and exit"
    )
    args = parser.parse_args()
    if args.make:
        make_file(int(args.make[0]), Path(args.make[1]))
        return
    if not args.paths:
        parser.error("give safetensors paths (or --make SIZE_MB PATH)")
    files = resolve_safetensors_files(args.paths)
    device = torch.device(args.device)
    total = sum(os.path.getsize(f) for f in files)
    modes = [m for m in args.modes.split(",") if m]

    rows: list[tuple[str, Callable[[list[str], torch.device, argparse.Namespace], None]]] = [
        ("objfs load_safetensors", run_objfs),
        (
            "load_file + .to(device)" if device.type == "cuda" else "load_file + touch pages",
            run_baseline,
        ),
    ]
    if device.type == "cpu":
        rows.append(("load_file + clone (reference)", run_clone))
    results: dict[str, dict[str, float]] = {}
    for label, fn in rows:
        results[label] = {mode: measure(fn, files, device, args, mode == "cold") for mode in modes}

    print(
        f"\n{len(files)} file(s), {total / MiB:.0f} MiB, device {device}, "
        f"threads {args.threads or 'auto'}, buffer {args.buffer_mib} MiB, "
        f"huge_pages {args.huge_pages}, "
        f"median of {args.repeat}, torch {torch.__version__}, {os.cpu_count()} CPUs\n"
    )
    baseline = rows[1][0]
    header = "| method |"
    rule = "|---|"
    for mode in modes:
        header += f" {mode} s | {mode} GB/s | {mode} speedup vs baseline |"
        rule += "---:|---:|---:|"
    print(header)
    print(rule)
    for label, _ in rows:
        line = f"| {label} |"
        for mode in modes:
            t = results[label][mode]
            line += f" {t:.3f} | {total / t / 1e9:.2f} | {results[baseline][mode] / t:.2f}x |"
        print(line)
    if device.type == "cuda":
        nbytes = min(total, 2048 * MiB)  # 2 GiB is plenty for a steady-state bandwidth figure
        t = h2d_bandwidth(device, nbytes, args.repeat)
        bandwidth = nbytes / t / 1e9
        print(f"| raw pinned H2D ({nbytes / MiB:.0f} MiB) | | {bandwidth:.2f} GB/s | |")
        ours = {mode: total / results[rows[0][0]][mode] / 1e9 for mode in modes}
        print()
        for mode in modes:
            print(f"objfs {mode}: {ours[mode] / bandwidth:.0%} of raw pinned H2D bandwidth")


if __name__ == "__main__":
    main()
