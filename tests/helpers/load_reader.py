"""One reader process of ``tests/test_load.py``: THREADS workers read files of a mount at once.

Usage: load_reader.py MOUNTDIR PROCESS THREADS NAME=SIZE [NAME=SIZE ...]

Worker ``w = PROCESS * THREADS + thread`` does what :func:`plan` says: read a whole file in
1 MiB reads and hash it, or make seeded random reads (4 KiB to 1 MiB, at any offset, some
crossing the end of the file) and compare each with the bytes
:class:`~objfs.backends.memory.SyntheticData` derives for that range (the content
``tests/helpers/serve_memory.py`` serves). Prints one JSON object per worker.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import threading
from dataclasses import dataclass

from objfs.backends.memory import SyntheticData

KiB = 1024
MiB = 1024 * KiB
RANDOM_READS = 32  # per random worker


@dataclass(frozen=True)
class Work:
    kind: str  # "sequential" or "random"
    names: tuple[str, ...]  # the files it reads (one for sequential)
    seed: int


def plan(worker: int, threads: int, names: list[str]) -> Work:
    """What worker ``worker`` does. Per process: two sequential readers, one random reader
    of a single file and one random reader of every file (with 4 threads)."""
    process, thread = divmod(worker, threads)
    n = len(names)
    if thread % 4 in (0, 1):
        # Two processes read each file sequentially at the same time.
        return Work("sequential", (names[(2 * process + thread) % n],), worker)
    if thread % 4 == 2:
        # A file that two sequential readers are reading too.
        return Work("random", (names[(process + 3) % n],), worker)
    return Work("random", tuple(names), worker)


def synthetic(name: str, size: int) -> SyntheticData:
    """The content tests/helpers/serve_memory.py serves for ``name``."""
    return SyntheticData(size, seed=name.encode())


def expected_sha256(name: str, size: int) -> str:
    data = synthetic(name, size)
    h = hashlib.sha256()
    for off in range(0, size, 8 * MiB):
        h.update(data.read(off, 8 * MiB))
    return h.hexdigest()


def _pread_full(fd: int, length: int, offset: int) -> bytes:
    parts: list[bytes] = []
    while length > 0:
        chunk = os.pread(fd, length, offset)
        if not chunk:
            break  # end of file
        parts.append(chunk)
        length -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def run_sequential(mountdir: str, name: str) -> dict[str, object]:
    h = hashlib.sha256()
    total = reads = 0
    with open(os.path.join(mountdir, name), "rb", buffering=0) as f:
        while chunk := f.read(MiB):
            h.update(chunk)
            total += len(chunk)
            reads += 1
    return {
        "kind": "sequential",
        "name": name,
        "sha256": h.hexdigest(),
        "bytes": total,
        "reads": reads,
    }


def run_random(mountdir: str, work: Work, sizes: dict[str, int]) -> dict[str, object]:
    rng = random.Random(work.seed)
    fds = {name: os.open(os.path.join(mountdir, name), os.O_RDONLY) for name in work.names}
    checked = wrong = 0
    first_wrong: list[list[object]] = []
    try:
        for _ in range(RANDOM_READS):
            name = rng.choice(work.names)
            size = sizes[name]
            length = int(4 * KiB * 256 ** rng.random())  # 4 KiB to 1 MiB, log-uniform
            offset = rng.randrange(size)
            if rng.random() < 0.5:
                offset -= offset % (4 * KiB)  # page-aligned half the time
            got = _pread_full(fds[name], length, offset)
            want = synthetic(name, size).read(offset, length)
            checked += len(want)
            if got != want:
                wrong += 1
                if len(first_wrong) < 5:
                    first_wrong.append([name, offset, length, len(got), len(want)])
    finally:
        for fd in fds.values():
            os.close(fd)
    return {
        "kind": "random",
        "names": list(work.names),
        "reads": RANDOM_READS,
        "bytes": checked,
        "wrong": wrong,
        "first_wrong": first_wrong,
    }


def main() -> int:
    mountdir, process, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sizes = {name: int(size) for name, _, size in (a.partition("=") for a in sys.argv[4:])}
    names = list(sizes)
    results: dict[int, dict[str, object]] = {}

    def work(worker: int) -> None:
        todo = plan(worker, threads, names)
        try:
            if todo.kind == "sequential":
                result = run_sequential(mountdir, todo.names[0])
            else:
                result = run_random(mountdir, todo, sizes)
        except OSError as exc:
            result = {"kind": todo.kind, "error": f"{type(exc).__name__}: {exc}"}
        results[worker] = {"worker": worker, **result}

    workers = [threading.Thread(target=work, args=(process * threads + t,)) for t in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    for worker in sorted(results):
        print(json.dumps(results[worker]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
