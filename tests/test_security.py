"""Security properties of real mounts: read-only for the kernel, no access for other users
unless asked, a private disk cache (and a refused unsafe one), and credentials that appear in
no log, output, status, metric or command line."""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import os
import secrets
import stat
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from objfs.demo import LocalServer, free_port
from objfs.disk_cache import cached_blocks
from objfs.mountinfo import _mountinfo_record, mount_entry
from tests.conftest import (
    Mount,
    force_unmount,
    mount_command,
    put_many,
    run_mount,
    run_objfs,
    sha256,
)
from tests.helpers.deploy import objfs
from tests.helpers.known_secrets import known_secrets, remember

MiB = 1 << 20


def mount_options(path: Path) -> tuple[set[str], set[str]]:
    """(per-mount options, file-system options) of the mount at ``path``, from mountinfo."""
    record = _mountinfo_record(str(path))
    assert record is not None, f"{path} is not mounted"
    fields, rest = record
    return set(fields[5].split(",")), set(rest[2].split(",") if len(rest) > 2 else [])


@pytest.fixture
def weights(s3: Any, bucket: str) -> bytes:
    data = os.urandom(3 * MiB + 17)
    put_many(s3, bucket, {"m/w.bin": data, "m/config.json": b'{"layers": 2}'})
    return data


# -- the mount ---------------------------------------------------------------------------------


def test_mount_is_read_only_for_the_kernel_and_private_by_default(
    mount_s3: Any, bucket: str, weights: bytes
) -> None:
    m: Mount = mount_s3(f"s3://{bucket}/m")
    per_mount, per_fs = mount_options(m.path)
    assert "ro" in per_mount, per_mount  # MS_RDONLY: the kernel refuses writes itself
    assert "allow_other" not in per_fs, per_fs
    assert "default_permissions" in per_fs  # the kernel checks modes, not objfs
    for attempt in (
        lambda: open(m.path / "w.bin", "r+b"),  # noqa: SIM115
        lambda: open(m.path / "new.bin", "wb"),  # noqa: SIM115
        lambda: (m.path / "dir").mkdir(),
        lambda: (m.path / "w.bin").unlink(),
        lambda: os.rename(m.path / "w.bin", m.path / "x.bin"),
    ):
        with pytest.raises(OSError, match="Read-only file system") as info:
            attempt()
        assert info.value.errno == errno.EROFS
    assert sha256((m.path / "w.bin").read_bytes()) == sha256(weights)


def _user_allow_other() -> bool:
    try:
        return "user_allow_other" in Path("/etc/fuse.conf").read_text().split()
    except OSError:
        return False


def test_allow_other_adds_the_mount_option(mount_s3: Any, bucket: str, weights: bytes) -> None:
    if os.geteuid() != 0 and not _user_allow_other():
        pytest.skip("--allow-other needs root or user_allow_other in /etc/fuse.conf")
    m: Mount = mount_s3(f"s3://{bucket}/m", "--allow-other")
    per_mount, per_fs = mount_options(m.path)
    assert "allow_other" in per_fs, per_fs
    assert "ro" in per_mount, per_mount
    assert (m.path / "config.json").read_bytes() == b'{"layers": 2}'


# -- the disk cache ----------------------------------------------------------------------------


def cache_mount_command(
    s3_server: LocalServer, bucket: str, tmp_path: Path, cache: Path, *options: str
) -> tuple[list[str], Path]:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir(exist_ok=True)
    cmd = mount_command(
        f"s3://{bucket}/m",
        mountpoint,
        tmp_path / "objfs.log",
        *("--endpoint-url", s3_server.url, "--cache-dir", str(cache), *options),
    )
    return cmd, mountpoint


def test_cache_directory_and_blocks_are_private_whatever_the_umask(
    s3_server: LocalServer, bucket: str, weights: bytes, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    # --cache-min-free: objfs itself creates the directory (not only its v4/ subdirectory).
    cmd, mountpoint = cache_mount_command(
        s3_server, bucket, tmp_path, cache, "--cache-min-free", "1M"
    )
    with contextlib.ExitStack() as stack:
        old = os.umask(0)  # the daemon inherits it: objfs must not rely on the caller's umask
        try:
            m = stack.enter_context(run_mount(cmd, mountpoint, tmp_path / "objfs.out"))
        finally:
            os.umask(old)
        assert sha256((m.path / "w.bin").read_bytes()) == sha256(weights)
    # Unmounted: the daemon has written every queued block.
    for root, dirs, files in os.walk(cache):
        for d in [root, *(os.path.join(root, d) for d in dirs)]:
            st = os.lstat(d)
            assert stat.S_ISDIR(st.st_mode)
            assert stat.S_IMODE(st.st_mode) == 0o700, (d, oct(st.st_mode))
            assert st.st_uid == os.geteuid()
        for f in files:
            st = os.lstat(os.path.join(root, f))
            assert stat.S_ISREG(st.st_mode)
            assert stat.S_IMODE(st.st_mode) == 0o600, (f, oct(st.st_mode))
    # 3 MiB + 17 bytes: four 1 MiB blocks, plus config.json's.
    assert cached_blocks(str(cache)) >= 4


def refused_mount(
    s3_server: LocalServer, bucket: str, tmp_path: Path, cache: Path
) -> subprocess.CompletedProcess[str]:
    """``objfs mount`` (as a daemon: it returns whatever happens) with ``cache``; checks that
    nothing was mounted."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir(exist_ok=True)
    try:
        res = run_objfs(
            "mount",
            f"s3://{bucket}/m",
            str(mountpoint),
            *("--endpoint-url", s3_server.url, "--cache-dir", str(cache)),
            *("--log-file", str(tmp_path / "refused.log")),
        )
        mounted = mount_entry(str(mountpoint)) is not None
    finally:
        force_unmount(mountpoint)
    assert not mounted, res.stderr
    return res


def assert_one_line_usage_error(res: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert res.stderr.startswith("objfs: error: --cache-dir "), res.stderr
    assert len(res.stderr.splitlines()) == 1, res.stderr
    for fragment in fragments:
        assert fragment in res.stderr, res.stderr


@pytest.mark.parametrize(
    ("where", "mode"),
    [("cache", 0o777), ("cache", 0o730), ("cache", 0o1777), ("cache/v4", 0o707)],
)
def test_cache_directory_writable_by_others_is_refused(
    s3_server: LocalServer, bucket: str, weights: bytes, tmp_path: Path, where: str, mode: int
) -> None:
    cache = tmp_path / "cache"
    (cache / "v4").mkdir(parents=True, mode=0o700)
    cache.chmod(0o700)
    (tmp_path / where).chmod(mode)
    res = refused_mount(s3_server, bucket, tmp_path, cache)
    assert_one_line_usage_error(
        res, f"{tmp_path / where} is writable by group or others", f"chmod 700 {tmp_path / where}"
    )
    # Refused, not repaired: objfs changed nothing.
    assert stat.S_IMODE((tmp_path / where).stat().st_mode) == mode
    assert sorted(p.name for p in cache.rglob("*")) == ["v4"]


def test_cache_directory_of_another_user_is_refused(
    s3_server: LocalServer, bucket: str, weights: bytes, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    os.chown(cache, 65534, 65534)  # nobody
    res = refused_mount(s3_server, bucket, tmp_path, cache)
    assert_one_line_usage_error(res, f"{cache} is owned by uid 65534", "give a directory")
    assert list(cache.iterdir()) == []


def test_symlinked_cache_directory_is_followed_and_checked(
    s3_server: LocalServer, bucket: str, weights: bytes, tmp_path: Path
) -> None:
    """A symlink is followed: the directory it points to is the one checked, tightened (when
    only readable by others) and used; a symlink to an unsafe one is refused, naming both."""
    real = tmp_path / "disk" / "objfs-cache"
    real.mkdir(parents=True, mode=0o755)
    real.chmod(0o755)
    link = tmp_path / "cache"
    link.symlink_to(real)
    cmd, mountpoint = cache_mount_command(s3_server, bucket, tmp_path, link)
    with run_mount(cmd, mountpoint, tmp_path / "objfs.out") as m:
        assert sha256((m.path / "w.bin").read_bytes()) == sha256(weights)
    assert link.is_symlink()
    assert stat.S_IMODE(real.stat().st_mode) == 0o700
    assert cached_blocks(str(real)) >= 4

    unsafe = tmp_path / "shared"
    unsafe.mkdir()
    unsafe.chmod(0o777)
    link.unlink()
    link.symlink_to(unsafe)
    res = refused_mount(s3_server, bucket, tmp_path, link)
    assert_one_line_usage_error(
        res, f"{link} (which resolves to {unsafe}) is writable by group or others"
    )
    assert list(unsafe.iterdir()) == []


# -- credentials -------------------------------------------------------------------------------


def assert_no_secret(texts: dict[str, str], secret_values: dict[str, str]) -> None:
    """No value of ``secret_values`` ({value: label}) in any of ``texts`` ({where: text})."""
    leaks = [
        f"{label} in {where}"
        for where, text in texts.items()
        for value, label in secret_values.items()
        if value in text
    ]
    assert leaks == []


def daemon_outputs(m: Mount, runtime: Path, metrics_url: str) -> dict[str, str]:
    """What a mount shows while it serves: status (both forms), its status files, metrics and
    the daemon's command line."""
    env = {"OBJFS_RUNTIME_DIR": str(runtime)}
    status = objfs("status", str(m.path), env=env)
    status_json = objfs("status", "--json", str(m.path), env=env)
    assert status.returncode == 0, status.stderr
    assert status_json.returncode == 0, status_json.stderr
    assert str(m.path) in status.stdout
    with urllib.request.urlopen(metrics_url, timeout=30) as resp:
        metrics = resp.read().decode()
    assert "objfs_served_bytes_total" in metrics
    cmdline = Path(f"/proc/{m.proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert "mount" in cmdline
    texts = {
        "`objfs status`": status.stdout + status.stderr,
        "`objfs status --json`": status_json.stdout + status_json.stderr,
        "the metrics": metrics,
        "the daemon's command line": cmdline,
    }
    status_files = [p for p in runtime.rglob("*") if p.is_file()]
    assert status_files
    for p in status_files:
        texts[f"status file {p.name}"] = p.read_text(errors="replace")
    return texts


def test_s3_credentials_stay_out_of_logs_outputs_status_metrics_and_cmdline(
    s3_server: LocalServer, bucket: str, weights: bytes, tmp_path: Path
) -> None:
    # A session token, from a --credentials-file: a second secret, on a second path in.
    token = remember("an AWS session token", f"objfs-session-{secrets.token_hex(16)}")
    credentials = tmp_path / "credentials"
    credentials.write_text(f"AWS_SESSION_TOKEN={token}\n")
    credentials.chmod(0o600)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    runtime = tmp_path / "run"
    log, out = tmp_path / "objfs.log", tmp_path / "objfs.out"
    metrics_url = f"http://127.0.0.1:{(port := free_port())}/metrics"
    cmd = mount_command(
        f"s3://{bucket}/m",
        mountpoint,
        log,
        *("--endpoint-url", s3_server.url, "--log-level", "debug"),
        *("--metrics-addr", f"127.0.0.1:{port}", "--credentials-file", str(credentials)),
        *("--cache-dir", str(tmp_path / "cache")),
    )
    with run_mount(cmd, mountpoint, out, {"OBJFS_RUNTIME_DIR": str(runtime)}) as m:
        assert sha256((m.path / "w.bin").read_bytes()) == sha256(weights)
        assert sorted(os.listdir(m.path)) == ["config.json", "w.bin"]
        with pytest.raises(FileNotFoundError):
            (m.path / "missing.bin").stat()
        texts = daemon_outputs(m, runtime, metrics_url)
    # After the unmount: the logs are complete.
    texts["the log file"] = log.read_text(errors="replace")
    texts["the daemon's stdout and stderr"] = out.read_text(errors="replace")
    assert " DEBUG " in texts["the log file"]  # debug output was on, and was checked
    assert_no_secret(texts, known_secrets())


def _container_sas(container: str) -> str:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from tests.azurite import DEV_ACCOUNT, DEV_KEY

    return generate_container_sas(
        DEV_ACCOUNT,
        container,
        account_key=DEV_KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=_dt.datetime.now(_dt.UTC) + _dt.timedelta(hours=1),
    )


@pytest.mark.parametrize("credential", ["account key", "SAS token file"])
def test_azure_credentials_stay_out_of_logs_outputs_status_metrics_and_cmdline(
    azurite: Any, container: str, tmp_path: Path, credential: str
) -> None:
    from tests.azurite import DEV_ACCOUNT, DEV_KEY, put_blobs

    data = os.urandom(2 * MiB + 5)
    put_blobs(azurite, container, {"m/w.bin": data, "m/config.json": b"{}"})
    options: list[str] = []
    env = {"AZURE_STORAGE_KEY": DEV_KEY}
    if credential == "SAS token file":
        sas = remember("a container SAS", _container_sas(container))
        signature = dict(part.split("=", 1) for part in sas.split("&"))["sig"]
        remember("a SAS signature", signature)
        remember("a SAS signature (decoded)", urllib.parse.unquote(signature))
        token_file = tmp_path / "sas.token"
        token_file.write_text(sas + "\n")
        options = ["--sas-token-file", str(token_file)]
        env = {"AZURE_STORAGE_KEY": ""}  # only the SAS
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    runtime = tmp_path / "run"
    log, out = tmp_path / "objfs-az.log", tmp_path / "objfs-az.out"
    metrics_url = f"http://127.0.0.1:{(port := free_port())}/metrics"
    cmd = [
        sys.executable,
        "-m",
        "objfs",
        "mount",
        f"az://{container}/m",
        str(mountpoint),
        "--foreground",
        *("--account-name", DEV_ACCOUNT, "--account-url", azurite.account_url),
        *("--log-file", str(log), "--log-level", "debug"),
        *("--metrics-addr", f"127.0.0.1:{port}"),
        *options,
    ]
    with run_mount(cmd, mountpoint, out, {**env, "OBJFS_RUNTIME_DIR": str(runtime)}) as m:
        assert sha256((m.path / "w.bin").read_bytes()) == sha256(data)
        assert sorted(os.listdir(m.path)) == ["config.json", "w.bin"]
        texts = daemon_outputs(m, runtime, metrics_url)
    texts["the log file"] = log.read_text(errors="replace")
    texts["the daemon's stdout and stderr"] = out.read_text(errors="replace")
    assert " DEBUG " in texts["the log file"]
    assert_no_secret(texts, known_secrets())
