"""Serve a memory-backend bucket of arbitrary keys through a real FUSE mount.

Usage: serve_keys.py MOUNTPOINT SPEC.json

Object stores hold keys that S3 servers used in tests (moto) refuse or mangle (NUL, 4 KiB
keys...); this child mounts them from a :class:`MemoryBackend` exactly the
way ``serve_memory.py`` (and ``objfs mount``) does. SPEC is a JSON object:

``source``          SOURCE to mount (default ``s3://memory``, the whole bucket)
``page_size``       keys and common prefixes per listing page (default 1000)
``metadata_ttl_s``  the mount's metadata TTL (default 60)
``log_level``       the mount's log level (default info; the log is the child's stderr)
``objects``         {key: hex of its bytes}
``synthetic``       {key: size}: :class:`SyntheticData` seeded with the key's UTF-8
``generate``        [{"prefix": P, "count": N}]: keys ``P + "%06d" % i`` holding
                    :func:`generated_bytes` (``i``)
``mutate``          {"prefix": P, "after_page": K, "put": {key: hex}, "delete": [key],
                    "repeat_last": bool}: once, in the first listing of P, after its K-th
                    page and before the next one, store ``put``, delete ``delete`` and (with
                    ``repeat_last``) start the next page with the last entry of the previous
                    one again, as a store with an unstable continuation token may.

With ``mutate``, listings page the way S3 does with a continuation token: every page is cut
from the keys as they are *then*, after the last entry already returned.
"""

from __future__ import annotations

import bisect
import json
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

from objfs.backends.base import ListPage, ObjectInfo
from objfs.backends.memory import MemoryBackend, SyntheticData
from objfs.config import MountConfig, parse_source
from objfs.logsetup import setup_logging
from objfs.mount import serve

log = logging.getLogger("serve_keys")


def synthetic(key: str, size: int) -> SyntheticData:
    return SyntheticData(size, seed=key.encode())


def generated_bytes(index: int) -> bytes:
    return f"object {index}\n".encode()


class ShiftingBackend(MemoryBackend):
    """A memory bucket whose listing of one prefix changes between two of its pages."""

    def __init__(self, *, page_size: int, mutate: dict[str, Any]) -> None:
        super().__init__(page_size=page_size)
        self.mutate = mutate
        self.mutated = False

    def _apply(self) -> None:
        self.mutated = True
        for key, data in self.mutate.get("put", {}).items():
            self.put(key, bytes.fromhex(data))
        for key in self.mutate.get("delete", []):
            self.delete(key)

    def _page(self, prefix: str, after: str | None) -> list[ObjectInfo | str]:
        """Up to page_size + 1 entries of ``prefix``'s level sorting after ``after`` (a key, or
        a common prefix whose keys are all skipped)."""
        if after is None:
            i = bisect.bisect_left(self._sorted, prefix)
        elif after.endswith("/"):
            i = bisect.bisect_left(self._sorted, after[:-1] + chr(ord("/") + 1))
        else:
            i = bisect.bisect_right(self._sorted, after)
        entries: list[ObjectInfo | str] = []
        while (
            i < len(self._sorted)
            and self._sorted[i].startswith(prefix)
            and len(entries) <= self.page_size
        ):
            key = self._sorted[i]
            slash = key.find("/", len(prefix))
            if slash < 0:
                entries.append(self._info(key, self._objects[key]))
                i += 1
            else:
                common = key[: slash + 1]
                entries.append(common)
                i = bisect.bisect_left(self._sorted, common[:-1] + chr(ord("/") + 1))
        return entries

    async def list_prefix(self, prefix: str) -> AsyncIterator[ListPage]:
        after: str | None = None
        last: ObjectInfo | str | None = None
        pages = 0
        while True:
            repeat: list[ObjectInfo | str] = []
            if (
                not self.mutated
                and prefix == self.mutate["prefix"]
                and pages == self.mutate["after_page"]
            ):
                self._apply()
                log.info("changed the bucket after page %d of %r", pages, prefix)
                if self.mutate.get("repeat_last") and last is not None:
                    repeat = [last]
                    log.info("page %d of %r repeats %r", pages + 1, prefix, last)
            entries = self._page(prefix, after)
            chunk = repeat + entries[: self.page_size]
            await self._request("list", prefix)
            yield ListPage(
                objects=[e for e in chunk if isinstance(e, ObjectInfo)],
                prefixes=[e for e in chunk if isinstance(e, str)],
            )
            pages += 1
            if len(entries) <= self.page_size:
                return
            last = entries[self.page_size - 1]
            after = last if isinstance(last, str) else last.key


def build_backend(spec: dict[str, Any]) -> MemoryBackend:
    page_size = int(spec.get("page_size", 1000))
    mutate = spec.get("mutate")
    backend = (
        MemoryBackend(page_size=page_size)
        if mutate is None
        else ShiftingBackend(page_size=page_size, mutate=mutate)
    )
    items: list[tuple[str, bytes | SyntheticData]] = []
    items += [(k, bytes.fromhex(v)) for k, v in spec.get("objects", {}).items()]
    items += [(k, synthetic(k, int(n))) for k, n in spec.get("synthetic", {}).items()]
    for gen in spec.get("generate", []):
        items += [(f"{gen['prefix']}{i:06d}", generated_bytes(i)) for i in range(gen["count"])]
    # In key order: each put then appends to the backend's sorted key list.
    for key, data in sorted(items, key=lambda item: item[0]):
        backend.put(key, data)
    return backend


def main() -> int:
    mountpoint, spec_path = sys.argv[1:3]
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    backend = build_backend(spec)
    config = MountConfig(
        source=parse_source(spec.get("source", "s3://memory")),
        mountpoint=mountpoint,
        foreground=True,
        memory_limit_bytes=256 << 20,
        metadata_ttl_s=float(spec.get("metadata_ttl_s", 60.0)),
    )
    setup_logging(spec.get("log_level", "info"), None, daemon=False)
    return serve(config, lambda: backend, None)


if __name__ == "__main__":
    sys.exit(main())
