"""A whole account as one mount: ``s3://`` and ``az://`` (``azure://ACCOUNT``) show every bucket
(container) the credentials can list as a top-level directory.

Against moto's S3 server and Azurite, through real FUSE mounts: the buckets listed exactly as
the store lists them; files of two buckets byte-exact; a bucket listed only once entered
(requests counted by a proxy in front of the store); a bucket the credentials cannot read
failing with EACCES inside its own directory only, the others serving on. For S3 the refusal is
real: a moto server of this module's own enforces IAM policies. Azurite enforces no per-container
permissions (no RBAC; a container SAS cannot list the account), so there the proxy answers for
one container exactly what Azure answers for a container outside an identity's role assignment
(403 ``AuthorizationPermissionMismatch``). moto answers every region from one endpoint, so the
test of a bucket in another region checks that its requests are signed for its own region.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from objfs.config import parse_source
from objfs.demo import LocalServer
from objfs.mount_helper import parse_helper_args
from objfs.mountinfo import mount_entry
from tests.conftest import Mount, mount_command, run_mount, run_objfs, sha256
from tests.helpers.iam_moto import enforce_auth, new_access_key
from tests.helpers.proxy import Answer, Proxy, Request
from tests.test_systemd_fstab import helper_on_sbin, mount8_env  # noqa: F401 - a fixture

MiB = 1 << 20


def _bucket_requests(proxy: Proxy, bucket: str) -> list[Request]:
    """Requests the proxy saw for ``bucket`` (path-style S3, or an Azurite container)."""
    return [
        r
        for r in proxy.stats.requests
        if re.match(rf"^/(devstoreaccount1/)?{bucket}([/?]|$)", r.target)
    ]


def _lists(requests: list[Request]) -> int:
    return sum(
        r.method == "GET" and ("list-type=" in r.target or "comp=list" in r.target)
        for r in requests
    )


# -- SOURCE ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("s3://", "s3://"),
        ("s3:///", "s3://"),
        ("az://", "az://"),
        ("azure://acct", "azure://acct/"),
        ("https://acct.blob.core.windows.net/", "https://acct.blob.core.windows.net/"),
    ],
)
def test_account_root_sources_parse(text: str, url: str) -> None:
    source = parse_source(text)
    assert source.account_root
    assert (source.bucket, source.prefix) == ("", "")
    assert source.url() == url
    assert not parse_source("s3://bucket").account_root


def test_fstab_helper_passes_the_account_root_on() -> None:
    source, mountpoint, options, _, _ = parse_helper_args(
        ["s3://", "/mnt/models", "-o", "ro,_netdev,endpoint_url=http://minio:9000"]
    )
    assert (source, mountpoint) == ("s3://", "/mnt/models")
    assert options == ["--endpoint-url", "http://minio:9000"]


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["s3:///models"], 3, ["no bucket name", "s3:// alone"]),
        (["az:///models"], 3, ["no container name"]),
        (["az://"], 2, ["needs a storage account", "--account-name"]),
        (["s3://", "--endpoint-url", "http://127.0.0.1:1"], 8, ["cannot reach"]),
    ],
)
def test_bad_account_roots_fail_in_one_line(
    mnt: Path, args: list[str], code: int, words: list[str]
) -> None:
    res = run_objfs("mount", args[0], str(mnt), "--foreground", *args[1:], "--max-attempts", "1")
    assert res.returncode == code, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("objfs: error: "), res.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


# -- S3 ----------------------------------------------------------------------------------------


@pytest.fixture
def two_buckets(s3: Any, bucket: str) -> tuple[str, str, str, dict[str, bytes], dict[str, bytes]]:
    """Buckets A and B with files (the same key in both, other bytes), and an untouched C."""
    a, b, c = bucket, f"{bucket}-b", f"{bucket}-c"
    for name in (b, c):
        s3.create_bucket(Bucket=name)
    files_a = {"same/name.bin": os.urandom(2 * MiB + 5), "a-only.txt": b"in a"}
    files_b = {
        "same/name.bin": os.urandom(3 * MiB + 7),
        "deep/er/model.safetensors": os.urandom(MiB),
    }
    for name, files in ((a, files_a), (b, files_b)):
        for key, data in files.items():
            s3.put_object(Bucket=name, Key=key, Body=data)
    s3.put_object(Bucket=c, Key="never/read.bin", Body=b"c")
    return a, b, c, files_a, files_b


def test_s3_account_lists_buckets_and_enters_only_what_is_read(
    s3: Any, proxy: Proxy, two_buckets: Any, tmp_path: Path
) -> None:
    a, b, c, files_a, files_b = two_buckets
    cache = str(tmp_path / "cache")

    def mount(n: int) -> Any:
        path = tmp_path / f"mnt{n}"
        path.mkdir()
        log = tmp_path / f"objfs{n}.log"
        cmd = mount_command("s3://", path, log, "--endpoint-url", proxy.url, "--cache-dir", cache)
        return run_mount(cmd, path, tmp_path / f"objfs{n}.out")

    with mount(0) as m:
        assert mount_entry(str(m.path)) == ("fuse.objfs", "s3://")
        # Mounting asked for the bucket list only.
        assert all(not _bucket_requests(proxy, name) for name in (a, b, c))

        names = sorted(os.listdir(m.path))
        assert names == sorted(x["Name"] for x in s3.list_buckets()["Buckets"])
        assert {a, b, c} <= set(names)
        assert all((m.path / name).is_dir() for name in (a, b, c))
        assert all(not _bucket_requests(proxy, name) for name in (a, b, c)), "ls listed one"

        for name, files in ((a, files_a), (b, files_b)):
            for key, data in files.items():
                assert sha256((m.path / name / key).read_bytes()) == sha256(data), (name, key)
        assert sorted(os.listdir(m.path / b)) == ["deep", "same"]
        assert _lists(_bucket_requests(proxy, a)) >= 1
        assert _lists(_bucket_requests(proxy, b)) >= 1
        assert not _bucket_requests(proxy, c), "a bucket nobody entered was asked for"
        status = run_objfs("status", "--json", str(m.path))
        assert status.returncode == 0, status.stderr
        figures = json.loads(status.stdout)
        assert figures["source"] == "s3://"
        assert figures["backend"].startswith("all buckets at http://127.0.0.1:")

    # The disk cache keeps the two buckets' equal keys apart, also after a remount.
    proxy.reset_stats()
    with mount(1) as again:
        for name, files in ((a, files_a), (b, files_b)):
            data = (again.path / name / "same/name.bin").read_bytes()
            assert sha256(data) == sha256(files["same/name.bin"]), name
        assert not [r for r in proxy.stats.requests if "range" in r.headers], "not cached"
    for n in (0, 1):
        assert "Traceback" not in (tmp_path / f"objfs{n}.log").read_text()


def test_s3_bucket_in_another_region_is_signed_for_its_region(
    mount_s3: Any, s3: Any, proxy: Proxy, bucket: str
) -> None:
    eu = f"{bucket}-eu"
    s3.create_bucket(Bucket=eu, CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    data = {eu: os.urandom(MiB + 3), bucket: os.urandom(MiB + 5)}
    for name, body in data.items():
        s3.put_object(Bucket=name, Key="m/w.bin", Body=body)
    m: Mount = mount_s3("s3://", "--endpoint-url", proxy.url, "--region", "us-east-1")
    for name, body in data.items():
        assert sha256((m.path / name / "m/w.bin").read_bytes()) == sha256(body)

    def scopes(name: str) -> set[str]:
        found = set()
        for r in _bucket_requests(proxy, name):
            scope = re.search(
                r"Credential=[^/]+/\d+/([^/]+)/s3/", r.headers.get("authorization", "")
            )
            if scope and r.method != "HEAD":  # the HeadBucket that asks for the region
                found.add(scope.group(1))
        return found

    assert scopes(eu) == {"eu-west-1"}
    assert scopes(bucket) == {"us-east-1"}
    assert f"bucket '{eu}' is in region eu-west-1" in m.log()


@pytest.mark.usefixtures("helper_on_sbin")
def test_mount_t_fuse_objfs_mounts_the_account_root(
    s3_server: LocalServer, two_buckets: Any, tmp_path: Path
) -> None:
    a, b, _, files_a, files_b = two_buckets
    mnt = tmp_path / "all"
    mnt.mkdir()
    env = {
        **mount8_env(tmp_path),
        **{k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")},
    }
    res = subprocess.run(
        [
            "mount",
            "-t",
            "fuse.objfs",
            "s3://",
            str(mnt),
            "-o",
            f"ro,_netdev,endpoint_url={s3_server.url}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    try:
        assert res.returncode == 0, res.stderr
        assert {a, b} <= set(os.listdir(mnt))
        assert (mnt / a / "a-only.txt").read_bytes() == files_a["a-only.txt"]
        assert sha256((mnt / b / "same/name.bin").read_bytes()) == sha256(files_b["same/name.bin"])
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, check=False)
    assert mount_entry(str(mnt)) is None


# -- S3 with IAM: a bucket the credentials cannot read -------------------------------------------


def _user(server: LocalServer, name: str, statements: list[dict[str, Any]]) -> dict[str, str]:
    import boto3

    iam = boto3.client("iam", endpoint_url=server.url, region_name="us-east-1")
    iam.create_user(UserName=name)
    policy = iam.create_policy(
        PolicyName=f"{name}-policy",
        PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": statements}),
    )
    iam.attach_user_policy(UserName=name, PolicyArn=policy["Policy"]["Arn"])
    key = new_access_key(iam, name)
    return {
        "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
    }


@pytest.fixture(scope="module")
def iam_account(iam_s3: LocalServer) -> Iterator[dict[str, Any]]:
    """Buckets open-a, open-b and denied; a reader allowed ListAllMyBuckets and both open
    buckets (denied explicitly the third), and a user allowed the open buckets only."""
    from objfs.demo import s3_client

    enforce_auth(iam_s3, False)
    s3 = s3_client(iam_s3.url)
    files = {
        "open-a": {"m/config.json": b'{"a": 1}', "m/w.bin": os.urandom(2 * MiB + 1)},
        "open-b": {"w.bin": os.urandom(MiB + 9)},
        "denied": {"secret.bin": b"never served"},
    }
    for name, items in files.items():
        s3.create_bucket(Bucket=name)
        for key, data in items.items():
            s3.put_object(Bucket=name, Key=key, Body=data)
    opened = [
        "arn:aws:s3:::open-a",
        "arn:aws:s3:::open-a/*",
        "arn:aws:s3:::open-b",
        "arn:aws:s3:::open-b/*",
    ]
    reader = _user(
        iam_s3,
        "account-reader",
        [
            {"Effect": "Allow", "Action": "s3:ListAllMyBuckets", "Resource": "*"},
            {"Effect": "Allow", "Action": "s3:*", "Resource": opened},
            {
                "Effect": "Deny",
                "Action": "s3:*",
                "Resource": ["arn:aws:s3:::denied", "arn:aws:s3:::denied/*"],
            },
        ],
    )
    no_list = _user(
        iam_s3, "bucket-reader", [{"Effect": "Allow", "Action": "s3:*", "Resource": opened}]
    )
    enforce_auth(iam_s3, True)
    try:
        yield {"files": files, "reader": reader, "no_list": no_list}
    finally:
        enforce_auth(iam_s3, False)


def test_s3_bucket_the_credentials_cannot_read_fails_only_inside_it(
    iam_s3: LocalServer, iam_account: dict[str, Any], tmp_path: Path
) -> None:
    files = iam_account["files"]
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    log_path = tmp_path / "objfs.log"
    cmd = mount_command(
        "s3://", mountpoint, log_path, "--endpoint-url", iam_s3.url, "--metadata-ttl", "0"
    )
    with run_mount(cmd, mountpoint, tmp_path / "objfs.out", env=iam_account["reader"]) as m:
        assert sorted(os.listdir(m.path)) == ["denied", "open-a", "open-b"]
        assert (m.path / "denied").is_dir()  # listed by ListBuckets: a directory
        for attempt in range(2):
            with pytest.raises(PermissionError) as info:
                os.listdir(m.path / "denied")
            assert info.value.errno == errno.EACCES
            with pytest.raises(PermissionError):
                (m.path / "denied" / "secret.bin").read_bytes()
            # The other buckets serve on, before and after.
            for bucket in ("open-a", "open-b"):
                for key, data in files[bucket].items():
                    assert sha256((m.path / bucket / key).read_bytes()) == sha256(data), attempt
        assert sorted(os.listdir(m.path)) == ["denied", "open-a", "open-b"]
        assert m.proc.poll() is None
    log = log_path.read_text()
    denials = [
        line for line in log.splitlines() if "access denied" in line and "s3://denied/" in line
    ]
    assert denials, log
    assert all("AccessDenied" in line for line in denials), log
    assert "open-a" not in "".join(line for line in log.splitlines() if "denied" in line.lower())
    assert "Traceback" not in log


def test_s3_account_root_needs_list_all_my_buckets(
    iam_s3: LocalServer, iam_account: dict[str, Any], mnt: Path
) -> None:
    def mount(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return run_objfs(
            "mount",
            "s3://",
            str(mnt),
            "--foreground",
            "--endpoint-url",
            iam_s3.url,
            env={**os.environ, **env},
        )

    res = mount(iam_account["no_list"])
    assert res.returncode == 6, res.stderr
    assert "s3:ListAllMyBuckets" in res.stderr
    assert "s3://BUCKET" in res.stderr
    assert len(res.stderr.splitlines()) == 1
    wrong = {**iam_account["reader"], "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    res = mount(wrong)
    assert res.returncode == 6, res.stderr
    assert "rejected the credentials" in res.stderr
    assert "not-the-secret" not in res.stderr


# -- Azure -------------------------------------------------------------------------------------


@pytest.fixture
def two_containers(
    azurite: Any, azure_service: Any, container: str
) -> tuple[str, str, str, dict[str, bytes], dict[str, bytes]]:
    from tests.azurite import put_blobs

    a, b, c = container, f"{container}-b", f"{container}-c"
    for name in (b, c):
        azure_service.create_container(name)
    files_a = {"same/name.bin": os.urandom(2 * MiB + 5), "a-only.txt": b"in a"}
    files_b = {"same/name.bin": os.urandom(MiB + 7), "deep/er/config.json": b"{}"}
    put_blobs(azurite, a, files_a)
    put_blobs(azurite, b, files_b)
    put_blobs(azurite, c, {"never/read.bin": b"c"})
    return a, b, c, files_a, files_b


@pytest.fixture
def azurite_proxy(azurite: Any) -> Iterator[Proxy]:
    with Proxy(azurite.port) as p:
        yield p


def test_azure_account_lists_containers_and_enters_only_what_is_read(
    mount_az: Any, azure_service: Any, azurite_proxy: Proxy, two_containers: Any
) -> None:
    from tests.azurite import DEV_ACCOUNT

    a, b, c, files_a, files_b = two_containers
    url = f"{azurite_proxy.url}/{DEV_ACCOUNT}"
    m: Mount = mount_az(f"azure://{DEV_ACCOUNT}", "--account-url", url)
    assert all(not _bucket_requests(azurite_proxy, name) for name in (a, b, c))
    names = sorted(os.listdir(m.path))
    assert names == sorted(x["name"] for x in azure_service.list_containers())
    assert {a, b, c} <= set(names)
    assert all(not _bucket_requests(azurite_proxy, name) for name in (a, b, c)), "ls listed one"
    for name, files in ((a, files_a), (b, files_b)):
        for key, data in files.items():
            assert sha256((m.path / name / key).read_bytes()) == sha256(data), (name, key)
    assert _lists(_bucket_requests(azurite_proxy, a)) >= 1
    assert not _bucket_requests(azurite_proxy, c), "a container nobody entered was asked for"
    assert "Traceback" not in m.log()


def test_azure_container_the_credentials_cannot_read_fails_only_inside_it(
    mount_az: Any, azurite_proxy: Proxy, two_containers: Any
) -> None:
    from tests.azurite import DEV_ACCOUNT

    a, b, denied, files_a, files_b = two_containers
    # What Azure answers for a container outside the identity's role assignment.
    azurite_proxy.answer(
        Answer(
            lambda r: r.target.startswith(f"/{DEV_ACCOUNT}/{denied}"),
            "403 This request is not authorized to perform this operation using this permission.",
            {
                "x-ms-error-code": "AuthorizationPermissionMismatch",
                "Content-Type": "application/xml",
            },
            b'<?xml version="1.0" encoding="utf-8"?><Error>'
            b"<Code>AuthorizationPermissionMismatch</Code>"
            b"<Message>This request is not authorized to perform this operation using this "
            b"permission.</Message></Error>",
        )
    )
    m: Mount = mount_az(
        "az://", "--account-url", f"{azurite_proxy.url}/{DEV_ACCOUNT}", "--metadata-ttl", "0"
    )
    assert {a, b, denied} <= set(os.listdir(m.path))
    for _ in range(2):
        with pytest.raises(PermissionError) as info:
            os.listdir(m.path / denied)
        assert info.value.errno == errno.EACCES
        assert (m.path / a / "a-only.txt").read_bytes() == files_a["a-only.txt"]
        assert sha256((m.path / b / "same/name.bin").read_bytes()) == sha256(
            files_b["same/name.bin"]
        )
    assert azurite_proxy.injected["answered"] >= 2
    log = m.log()
    assert any(
        f"az://{denied}/" in line and "AuthorizationPermissionMismatch" in line
        for line in log.splitlines()
    ), log
    assert "Traceback" not in log
