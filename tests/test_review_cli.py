"""Findings of the review of issue 30, each checked where a user meets it.

* A credentials file that holds a bare secret: the error and the rotation warning name the
  file and the line, never any of its text.
* Internal errors of a daemon reach its log with their traceback and the terminal of
  ``objfs mount`` as one line; ``--memory-limit`` beyond the machine is a usage error.
* Data GETs trust the CAs the SDK trusts (a profile's ``ca_bundle`` included).
* ``objfs status`` trusts only status files that the mount's owner wrote in a private folder.
* ``objfs warm`` over a file removed mid-walk, and start-up warnings of a daemon on the
  terminal of ``objfs mount``.
"""

from __future__ import annotations

import base64
import logging
import os
from pathlib import Path

import pytest

from objfs.credentials import CredentialWatch
from objfs.demo import LocalServer
from tests.conftest import run_objfs
from tests.helpers.known_secrets import remember


def _substrings(secret: str, length: int = 8) -> list[str]:
    return [secret[i : i + length] for i in range(len(secret) - length + 1)]


def _assert_no_part_of(secret: str, text: str) -> None:
    leaked = [part for part in _substrings(secret) if part in text]
    assert not leaked, f"{len(leaked)} pieces of the secret in: {text!r}"


# -- item 8: a bare secret in a credentials file -----------------------------------------------


def _bare_secret() -> str:
    # 64 random bytes in base64 end in "==": the line parses as NAME=VALUE, NAME the secret.
    secret = base64.b64encode(os.urandom(64)).decode()
    assert secret.endswith("==")
    return remember("a bare base64 secret in a credentials file", secret)


def test_a_bare_secret_in_a_credentials_file_is_not_echoed_by_mount(
    s3_server: LocalServer, mnt: Path, tmp_path: Path
) -> None:
    secret = _bare_secret()
    creds = tmp_path / "creds"
    creds.write_text(secret + "\n")
    creds.chmod(0o600)
    res = run_objfs(
        "mount", "s3://bucket/m", str(mnt), "--endpoint-url", s3_server.url,
        "--credentials-file", str(creds),
    )  # fmt: skip
    _assert_no_part_of(secret, res.stderr + res.stdout)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1
    assert res.stderr.startswith("objfs: error: ")
    assert f"{creds}: line 1 " in res.stderr
    assert "NAME=VALUE" in res.stderr


def test_a_bare_secret_in_a_rotated_credentials_file_stays_out_of_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    creds = tmp_path / "creds"
    creds.write_text("AWS_ACCESS_KEY_ID=AKID\nAWS_SECRET_ACCESS_KEY=old\n")
    watch = CredentialWatch.open(str(creds))
    assert watch is not None
    secret = _bare_secret()
    creds.write_text(f"AWS_ACCESS_KEY_ID=AKID\n{secret}\n")
    with caplog.at_level(logging.INFO, logger="objfs"):
        assert watch.poll(force=True) == 0  # refused: the current credentials stay
    text = "\n".join(record.getMessage() for record in caplog.records)
    _assert_no_part_of(secret, text)
    assert f"{creds}: line 2 " in text, text
