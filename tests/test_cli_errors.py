"""Every error a user will hit: one line on stderr, the documented exit code, nothing mounted.

The commands run exactly as a user types them (daemon mode, no --foreground).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from objfs.demo import LocalServer, free_port, s3_client, start_moto_server
from objfs.errors import EXIT_CODES
from tests.conftest import run_objfs

SECRET = "s3cr3t-Value-That-Must-Not-Leak"


def objfs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_objfs(*args, env=env)


def assert_one_line_error(res: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    assert res.returncode == code, (res.returncode, res.stderr)
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("objfs: error: "), lines[0]
    assert "Traceback" not in res.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.fixture
def tree(s3: Any, bucket: str) -> str:
    s3.put_object(Bucket=bucket, Key="m/config.json", Body=b"{}")
    return bucket


def test_every_exit_code_is_documented_in_the_readme() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for code, text in EXIT_CODES.items():
        assert f"| {code} | {text} |" in readme, code


@pytest.mark.parametrize(
    ("source", "code", "words"),
    [
        ("bucket-without-scheme", 3, ["not a URL", "s3://BUCKET"]),
        ("s3:///prefix", 3, ["no bucket name"]),
        ("s3://a/b", 3, ["not a valid bucket name"]),
        ("s3://bucket/a//b", 3, ["empty, '.' or '..'"]),
        ("s3://bucket/x?versionId=1", 3, ["query string"]),
        ("gs://bucket/prefix", 4, ["unknown scheme 'gs'", "--endpoint-url"]),
        ("ftp://bucket", 4, ["unknown scheme"]),
    ],
)
def test_bad_source(mnt: Path, source: str, code: int, words: list[str]) -> None:
    assert_one_line_error(objfs("mount", source, str(mnt)), code, *words)


def test_source_with_credentials_is_refused_and_not_echoed(mnt: Path) -> None:
    res = objfs("mount", f"s3://AKIAEXAMPLE:{SECRET}@bucket/prefix", str(mnt))
    assert_one_line_error(res, 3, "must not contain credentials")
    assert SECRET not in res.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--metadata-ttl", "soon"], ["--metadata-ttl", "'indefinite'"]),
        (["--metadata-ttl", "-1"], ["zero or more"]),
        (["--uid", "root"], ["--uid", "numeric"]),
        (["--max-connections", "0"], ["--max-connections", "1 to 1024"]),
        (["--log-level", "loud"], ["--log-level"]),
        (["--no-such-option"], ["unrecognized arguments"]),
    ],
)
def test_bad_option(mnt: Path, args: list[str], words: list[str]) -> None:
    assert_one_line_error(objfs("mount", "s3://bucket/p", str(mnt), *args), 2, *words)


def test_missing_bucket(s3_server: LocalServer, mnt: Path) -> None:
    res = objfs("mount", "s3://no-such-bucket/x", str(mnt), "--endpoint-url", s3_server.url)
    assert_one_line_error(res, 5, "'no-such-bucket' does not exist", "--endpoint-url")


def test_no_credentials(s3_server: LocalServer, tree: str, mnt: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_CONFIG_FILE="/nonexistent",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
        AWS_EC2_METADATA_DISABLED="true",
    )
    res = objfs("mount", f"s3://{tree}/m", str(mnt), "--endpoint-url", s3_server.url, env=env)
    assert_one_line_error(res, 7, "no AWS credentials", "--no-sign-request")


def test_unknown_profile(s3_server: LocalServer, tree: str, mnt: Path) -> None:
    res = objfs(
        "mount", f"s3://{tree}/m", str(mnt), "--endpoint-url", s3_server.url, "--profile", "nope"
    )
    assert_one_line_error(res, 7, "profile 'nope' not found")


def test_endpoint_unreachable(mnt: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    res = objfs("mount", "s3://bucket/m", str(mnt), "--endpoint-url", closed)
    assert_one_line_error(res, 8, "cannot reach", "--endpoint-url")


def test_bad_ca_bundle(s3_server: LocalServer, mnt: Path, tmp_path: Path) -> None:
    res = objfs(
        "mount",
        "s3://bucket/m",
        str(mnt),
        "--endpoint-url",
        s3_server.url,
        "--ca-bundle",
        str(tmp_path / "missing.pem"),
    )
    assert_one_line_error(res, 2, "--ca-bundle", "not a file")


@pytest.fixture(scope="module")
def auth_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalServer, dict[str, str]]]:
    """A second moto server that enforces IAM after its first three (set-up) requests."""
    log = tmp_path_factory.mktemp("moto-auth") / "moto.log"
    server = start_moto_server(str(log), env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"})
    try:
        import boto3

        s3_client(server.url).create_bucket(Bucket="locked")
        iam = boto3.client("iam", endpoint_url=server.url, region_name="us-east-1")
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        yield (
            server,
            {
                "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
                "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            },
        )
    finally:
        server.stop()


def test_access_denied(auth_server: tuple[LocalServer, dict[str, str]], mnt: Path) -> None:
    server, creds = auth_server
    env = {**os.environ, **creds}
    res = objfs("mount", "s3://locked/m", str(mnt), "--endpoint-url", server.url, env=env)
    assert_one_line_error(res, 6, "access denied", "s3:ListBucket")
    assert creds["AWS_SECRET_ACCESS_KEY"] not in res.stderr


def test_invalid_keys_are_access_denied(
    auth_server: tuple[LocalServer, dict[str, str]], mnt: Path
) -> None:
    server, _ = auth_server
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "AKIANOTAKEY", "AWS_SECRET_ACCESS_KEY": SECRET}
    res = objfs("mount", "s3://locked/m", str(mnt), "--endpoint-url", server.url, env=env)
    assert_one_line_error(res, 6, "rejected the credentials")
    assert SECRET not in res.stderr


def test_mountpoint_missing(tmp_path: Path) -> None:
    res = objfs("mount", "s3://bucket/m", str(tmp_path / "nope"))
    assert_one_line_error(res, 9, "does not exist", "mkdir -p")


def test_mountpoint_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    res = objfs("mount", "s3://bucket/m", str(tmp_path / "file"))
    assert_one_line_error(res, 10, "not a directory")


def test_mountpoint_not_empty(mnt: Path) -> None:
    (mnt / "something").write_text("x")
    res = objfs("mount", "s3://bucket/m", str(mnt))
    assert_one_line_error(res, 11, "not empty")


def test_mountpoint_already_mounted(s3_server: LocalServer, tree: str, mnt: Path) -> None:
    args = ["mount", f"s3://{tree}/m", str(mnt), "--endpoint-url", s3_server.url]
    assert objfs(*args).returncode == 0
    try:
        assert_one_line_error(objfs(*args), 12, "already mounted", "objfs unmount")
    finally:
        assert objfs("unmount", str(mnt)).returncode == 0


def test_fuse_unavailable(tmp_path: Path, mnt: Path) -> None:
    """/dev/fuse hidden in a private mount namespace (tmpfs over /dev)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to hide /dev/fuse")
    script = (
        f"mount -t tmpfs tmpfs /dev && exec {sys.executable} -m objfs mount s3://bucket/m {mnt}"
    )
    res = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert_one_line_error(res, 13, "/dev/fuse is missing", "fuse3")


def test_unmount_of_something_not_mounted(mnt: Path) -> None:
    assert_one_line_error(objfs("unmount", str(mnt)), 15, "is not mounted")


def test_help_lists_exit_codes_and_groups() -> None:
    res = objfs("mount", "--help")
    assert res.returncode == 0
    for text in ("object store:", "file system:", "logging:", "exit codes:", "--endpoint-url"):
        assert text in res.stdout
