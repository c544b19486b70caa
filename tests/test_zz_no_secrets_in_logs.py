"""Runs last (by its name): no credential of the session is in any log its tests wrote.

Every mount of the suite logs under pytest's base temporary folder: objfs's ``--log-file``
(``*.log``) and its children's stdout and stderr (``*.out``), plus the test servers' logs. This
test reads them all and looks for every secret the session handed out
(:func:`tests.helpers.known_secrets.known_secrets`: the AWS test key, Azurite's dev key and the
tokens tests registered), and for the shape of an unredacted SAS signature or account key,
which catches SAS tokens made by tests that did not register theirs.

It reads logs only: not token or credentials files, cache blocks or other data, and not
``strace*`` traces (they may show the bytes objfs read from a credentials file).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from objfs.mountinfo import _unescape_mountinfo
from tests.helpers.known_secrets import known_secrets

LOG_SUFFIXES = {".log", ".out"}
# `sig=` of a SAS (URL-encoded base64 of an HMAC-SHA256) and an account key in a connection
# string, unless redacted.
SHAPES = {
    "an unredacted SAS signature": re.compile(rb"(?<![A-Za-z])sig=(?!REDACTED)[A-Za-z0-9%+/]{20,}"),
    "an unredacted account key": re.compile(rb"AccountKey=(?!REDACTED)[A-Za-z0-9+/]{40,}"),
}


def _mounted_below(base: Path) -> set[str]:
    """Mount points under ``base`` still mounted: never walked into (a hung one would hang)."""
    found = set()
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            target = _unescape_mountinfo(line.split()[4])
            if target.startswith(str(base) + "/"):
                found.add(target)
    return found


def log_files(base: Path) -> list[Path]:
    skip = _mounted_below(base)
    found = []
    for root, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
        for name in files:
            path = Path(root, name)
            if (
                path.suffix in LOG_SUFFIXES
                and not name.startswith("strace")
                and path.is_file()
                and not path.is_symlink()
            ):
                found.append(path)
    return sorted(found)


def test_no_secret_in_any_log_of_the_session(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> None:
    others = [item for item in request.session.items if item.path != request.path]
    if not others:
        pytest.skip("checks the logs of the tests that ran before it in the same session")
    base = tmp_path_factory.getbasetemp()
    secret_values = {value.encode(): label for value, label in known_secrets().items()}
    files = log_files(base)
    leaks = []
    for path in files:
        data = path.read_bytes()
        for value, label in secret_values.items():
            if value in data:
                leaks.append(f"{path.relative_to(base)}: {label}")
        for label, shape in SHAPES.items():
            if shape.search(data):
                leaks.append(f"{path.relative_to(base)}: {label}")
    print(f"\nscanned {len(files)} log files under {base} for {len(secret_values)} secrets")
    assert len(files) > 0, f"no log files under {base}"
    assert leaks == [], f"{len(leaks)} leaks in {len(files)} log files"
