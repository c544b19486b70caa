"""Real FUSE mounts of Azurite through az://: the S3 suite's semantics, and Azure's own cases."""

from __future__ import annotations

import datetime as _dt
import errno
import os
from pathlib import Path
from typing import Any

import pytest

from objfs.demo import build_tiny_model, load_and_generate
from objfs.mountinfo import mount_entry
from tests.azurite import DEV_ACCOUNT, DEV_KEY, put_blobs
from tests.conftest import Mount, sha256
from tests.test_mount_s3 import EXPECTED_DIRS, EXPECTED_FILES, TREE, walk


@pytest.mark.parametrize("slash", ["", "/"], ids=["no-slash", "trailing-slash"])
def test_tree_listing_and_content(mount_az: Any, azurite: Any, container: str, slash: str) -> None:
    put_blobs(azurite, container, TREE)
    m: Mount = mount_az(f"az://{container}/data{slash}", "--metadata-ttl", "0")
    assert mount_entry(str(m.path)) == ("fuse.objfs", f"az://{container}/data/")
    files, dirs = walk(m.path)
    assert files == set(EXPECTED_FILES)
    assert dirs == EXPECTED_DIRS
    for rel, data in EXPECTED_FILES.items():
        assert sha256((m.path / rel).read_bytes()) == sha256(data), rel
    walk(m.path)  # listing again (TTL 0) still warns once per hidden or skipped key
    log = m.log()
    assert log.count("is hidden by the directory") == 1
    for bad in ("data/a//", "data/dots/./", "data/dots/../", "data/../", "x" * 256):
        assert sum(bad in line for line in log.splitlines()) == 1, bad
    assert "Traceback" not in log


def test_hdi_isfolder_blobs_are_directories(mount_az: Any, azurite: Any, container: str) -> None:
    folder = {"hdi_isfolder": "true"}
    put_blobs(
        azurite,
        container,
        {
            "hns": b"",  # the mounted prefix's own directory blob
            "hns/emptyfolder": b"",
            "hns/dir": b"",
            "hns/dir/file.txt": b"in a folder",
            "hns/dir/sub": b"",
            "hns/file.txt": b"beside",
            "hns/zero": b"",  # a zero-byte blob without the metadata stays an empty file
        },
        metadata={
            "hns": folder,
            "hns/emptyfolder": folder,
            "hns/dir": folder,
            "hns/dir/sub": folder,
        },
    )
    m: Mount = mount_az(f"az://{container}/hns", "--metadata-ttl", "0")
    files, dirs = walk(m.path)
    assert files == {"dir/file.txt", "file.txt", "zero"}
    assert dirs == {"emptyfolder", "dir", "dir/sub"}
    assert os.listdir(m.path / "emptyfolder") == []
    assert (m.path / "dir" / "file.txt").read_bytes() == b"in a folder"
    assert (m.path / "zero").read_bytes() == b""


def test_open_handle_is_pinned_to_its_etag(
    mount_az: Any, azure_service: Any, container: str
) -> None:
    client = azure_service.get_container_client(container)
    old, new = os.urandom(5 * 1024 * 1024), os.urandom(3 * 1024 * 1024 + 17)
    client.upload_blob("m/weights.bin", old)
    m: Mount = mount_az(f"az://{container}/m", "--metadata-ttl", "0")
    fd = os.open(m.path / "weights.bin", os.O_RDONLY)
    try:
        client.upload_blob("m/weights.bin", new, overwrite=True)
        with pytest.raises(OSError, match="Stale file handle") as info:
            os.pread(fd, 4096, 0)
        assert info.value.errno == errno.ESTALE
    finally:
        os.close(fd)
    assert os.stat(m.path / "weights.bin").st_size == len(new)
    assert sha256((m.path / "weights.bin").read_bytes()) == sha256(new)


def test_from_pretrained_from_an_az_mount_equals_local(
    mount_az: Any, azurite: Any, container: str, tmp_path: Path
) -> None:
    import torch

    model_dir = build_tiny_model(tmp_path / "tiny-llama")
    files = {p.relative_to(model_dir).as_posix(): p.read_bytes() for p in model_dir.rglob("*")}
    files = {rel: data for rel, data in files.items() if (model_dir / rel).is_file()}
    assert sum(rel.endswith(".safetensors") for rel in files) > 1  # sharded
    put_blobs(azurite, container, {f"models/tiny-llama/{rel}": d for rel, d in files.items()})

    m: Mount = mount_az(f"azure://{DEV_ACCOUNT}/{container}/models/tiny-llama/")
    assert set(os.listdir(m.path)) == set(files)
    for rel, data in files.items():
        assert sha256((m.path / rel).read_bytes()) == sha256(data), rel
    local_model, local_tokens, _ = load_and_generate(model_dir)
    mount_model, mount_tokens, _ = load_and_generate(m.path)
    assert type(mount_model).__name__ == "ObjfsTinyForCausalLM"  # the trust_remote_code class
    assert mount_tokens == local_tokens
    local_state, mount_state = local_model.state_dict(), mount_model.state_dict()
    assert local_state.keys() == mount_state.keys()
    for name, tensor in local_state.items():
        assert torch.equal(mount_state[name], tensor), name
    assert " ERROR " not in m.log()


def test_sas_token_file_mount_never_logs_the_token(
    mount_az: Any, azure_service: Any, container: str, tmp_path: Path
) -> None:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    client = azure_service.get_container_client(container)
    client.upload_blob("p/a.txt", b"alpha")
    client.upload_blob("p/gone.txt", b"deleted after the listing")
    sas = generate_container_sas(
        DEV_ACCOUNT,
        container,
        account_key=DEV_KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=_dt.datetime.now(_dt.UTC) + _dt.timedelta(hours=1),
    )
    signature = dict(part.split("=", 1) for part in sas.split("&"))["sig"]
    token_file = tmp_path / "sas.txt"
    token_file.write_text("?" + sas + "\n")
    m: Mount = mount_az(
        f"az://{container}/p",
        "--sas-token-file",
        str(token_file),
        "--log-level",
        "debug",
        env={"AZURE_STORAGE_KEY": ""},  # only the SAS
    )
    assert (m.path / "a.txt").read_bytes() == b"alpha"
    assert sorted(os.listdir(m.path)) == ["a.txt", "gone.txt"]
    client.delete_blob("p/gone.txt")
    with pytest.raises(FileNotFoundError):
        (m.path / "gone.txt").read_bytes()
    log = m.log()
    assert "--sas-token-file" in log  # the credential source is named...
    for secret in (signature, sas, DEV_KEY):
        assert secret not in log  # ...never the credential
        assert (
            secret
            not in m.path.parent.joinpath(m.log_path.name.replace(".log", ".out")).read_text()
        )
