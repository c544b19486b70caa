"""S3 chores for a store only reachable inside a network namespace (tests/test_fleet.py runs
this module there with ``nsenter --net``): ``python -m tests.helpers.s3tool URL ready`` (wait
until it answers, up to 60 s), ``... URL bucket NAME``, ``... URL upload BUCKET DIR PREFIX``
(every file under DIR as PREFIX/relative path). Credentials come from the environment."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from objfs.demo import s3_client


def main(argv: list[str]) -> int:
    url, command, *args = argv
    client = s3_client(url)
    if command == "ready":
        deadline = time.monotonic() + 60
        while True:
            try:
                client.list_buckets()
                return 0
            except Exception as exc:
                if time.monotonic() > deadline:
                    print(f"{url} did not answer: {exc}", file=sys.stderr)
                    return 1
                time.sleep(0.25)
    if command == "bucket":
        client.create_bucket(Bucket=args[0])
        return 0
    if command == "upload":
        bucket, folder, prefix = args
        root = Path(folder)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            client.put_object(
                Bucket=bucket, Key=f"{prefix}/{path.relative_to(root).as_posix()}",
                Body=path.read_bytes(),
            )  # fmt: skip
        return 0
    print(f"unknown command {command!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
