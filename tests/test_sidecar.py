"""`objfs sidecar`, the Kubernetes entrypoint, run locally without Kubernetes: it mounts from
environment variables, reports ready, serves other processes, unmounts on SIGTERM and exits
non-zero when its mount dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from objfs.demo import LocalServer
from objfs.errors import UsageError
from objfs.mountinfo import mount_entry
from objfs.sidecar import sidecar_command
from tests.conftest import mount_command, sha256
from tests.helpers.deploy import objfs, reaped, sha256_file, wait_for

MiB = 1 << 20


def sidecar_env(
    s3_server: LocalServer, source: str, tmp_path: Path, **extra: str
) -> dict[str, str]:
    return {
        **os.environ,
        "OBJFS_SOURCE": source,
        "OBJFS_MOUNTPOINT": str(tmp_path / "models" / "llama"),
        "OBJFS_ENDPOINT_URL": s3_server.url,
        "OBJFS_READY_FILE": str(tmp_path / "ready"),
        "OBJFS_RUNTIME_DIR": str(tmp_path / "run"),
        "OBJFS_CACHE_DIR": str(tmp_path / "cache"),
        "OBJFS_OPTIONS": "--metadata-ttl indefinite --memory-limit 256M",
        **extra,
    }


def start_sidecar(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "objfs", "sidecar"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def wait_ready(proc: subprocess.Popen[bytes], ready: Path, log: Path) -> str:
    def check() -> str | None:
        if proc.poll() is not None:
            raise AssertionError(f"the sidecar exited with {proc.returncode}:\n{log.read_text()}")
        return ready.read_text() if ready.exists() else None

    return wait_for("the sidecar's ready file", check)


def daemon_of(proc: subprocess.Popen[bytes]) -> psutil.Process:
    children = psutil.Process(proc.pid).children()
    assert len(children) == 1, children
    return children[0]


@pytest.fixture
def model(s3: Any, bucket: str) -> dict[str, bytes]:
    files = {
        "config.json": b'{"model_type": "llama"}',
        "model.safetensors": os.urandom(3 * MiB + 17),
    }
    for name, data in files.items():
        s3.put_object(Bucket=bucket, Key=f"llama/{name}", Body=data)
    return files


def test_sidecar_serves_then_unmounts_on_sigterm(
    s3_server: LocalServer, bucket: str, model: dict[str, bytes], tmp_path: Path
) -> None:
    env = sidecar_env(s3_server, f"s3://{bucket}/llama", tmp_path)
    mnt = Path(env["OBJFS_MOUNTPOINT"])
    ready = Path(env["OBJFS_READY_FILE"])
    log = tmp_path / "sidecar.log"
    proc = start_sidecar(env, log)
    with reaped(proc, mnt):
        text = wait_ready(proc, ready, log)
        assert text.startswith(f"s3://{bucket}/llama {mnt} pid ")
        assert mnt.is_dir()  # created by the sidecar
        assert mount_entry(str(mnt)) == ("fuse.objfs", f"s3://{bucket}/llama/")
        # Another process reads through the mount.
        for name, data in model.items():
            assert sha256_file(mnt / name) == sha256(data)
        # The probe the manifests use.
        probe = objfs("status", "--probe", str(mnt), env=env)
        assert (probe.returncode, probe.stdout, probe.stderr) == (0, "", "")
        daemon = daemon_of(proc)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log.read_text()
        assert mount_entry(str(mnt)) is None
        assert not ready.exists()
        wait_for("the daemon to exit", lambda: not daemon.is_running())
        assert list(Path(env["OBJFS_RUNTIME_DIR"]).iterdir()) == []  # status file removed
        probe = objfs("status", "--probe", str(mnt), env=env)
        assert probe.returncode == 15
    assert "Traceback" not in log.read_text()


def test_sidecar_exits_non_zero_when_the_daemon_dies(
    s3_server: LocalServer, bucket: str, model: dict[str, bytes], tmp_path: Path
) -> None:
    env = sidecar_env(s3_server, f"s3://{bucket}/llama", tmp_path)
    mnt = Path(env["OBJFS_MOUNTPOINT"])
    ready = Path(env["OBJFS_READY_FILE"])
    log = tmp_path / "sidecar.log"
    proc = start_sidecar(env, log)
    with reaped(proc, mnt):
        wait_ready(proc, ready, log)
        assert sha256_file(mnt / "config.json") == sha256(model["config.json"])
        daemon = daemon_of(proc)
        daemon.kill()
        assert proc.wait(timeout=90) == 19, log.read_text()
        # The dead mount is detached, so the restarted container can mount again.
        assert mount_entry(str(mnt)) is None
        assert not ready.exists()
    errors = [line for line in log.read_text().splitlines() if line.startswith("objfs: error:")]
    assert errors == [
        f"objfs: error: the mount of s3://{bucket}/llama on {mnt} stopped while serving "
        "(objfs killed by SIGKILL); exiting so that it is restarted"
    ]


def test_sidecar_exits_non_zero_when_unmounted_under_it(
    s3_server: LocalServer, bucket: str, model: dict[str, bytes], tmp_path: Path
) -> None:
    env = sidecar_env(s3_server, f"s3://{bucket}/llama", tmp_path)
    mnt = Path(env["OBJFS_MOUNTPOINT"])
    log = tmp_path / "sidecar.log"
    proc = start_sidecar(env, log)
    with reaped(proc, mnt):
        wait_ready(proc, Path(env["OBJFS_READY_FILE"]), log)
        subprocess.run(["umount", str(mnt)], check=True)
        assert proc.wait(timeout=90) == 19, log.read_text()
    assert "(objfs exit status 0)" in log.read_text()


def test_restarted_sidecar_replaces_a_dead_mount(
    s3_server: LocalServer, bucket: str, model: dict[str, bytes], tmp_path: Path
) -> None:
    """A container restarted after a crash finds its mountpoint holding a dead FUSE mount
    (ENOTCONN); the sidecar detaches it and mounts again."""
    env = sidecar_env(s3_server, f"s3://{bucket}/llama", tmp_path)
    mnt = Path(env["OBJFS_MOUNTPOINT"])
    mnt.mkdir(parents=True)
    crashed = subprocess.Popen(
        mount_command(
            f"s3://{bucket}/llama", mnt, tmp_path / "crashed.log", "--endpoint-url", s3_server.url
        ),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with reaped(crashed, mnt):
        wait_for("the first mount", lambda: mount_entry(str(mnt)))
        assert sha256_file(mnt / "config.json") == sha256(model["config.json"])
        crashed.kill()
        crashed.wait(timeout=30)
        with pytest.raises(OSError, match="not connected"):
            os.statvfs(mnt)

        log = tmp_path / "sidecar.log"
        proc = start_sidecar(env, log)
        with reaped(proc, mnt):
            wait_ready(proc, Path(env["OBJFS_READY_FILE"]), log)
            assert sha256_file(mnt / "model.safetensors") == sha256(model["model.safetensors"])
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=90) == 0, log.read_text()
        assert mount_entry(str(mnt)) is None
        assert "detaching a dead fuse.objfs mount" in log.read_text()


def test_sidecar_passes_on_a_mount_error(s3_server: LocalServer, tmp_path: Path) -> None:
    env = sidecar_env(s3_server, "s3://no-such-bucket-objfs/x", tmp_path)
    res = subprocess.run(
        [sys.executable, "-m", "objfs", "sidecar"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 5, res.stderr
    assert "bucket 'no-such-bucket-objfs' does not exist" in res.stderr
    assert mount_entry(env["OBJFS_MOUNTPOINT"]) is None
    assert not Path(env["OBJFS_READY_FILE"]).exists()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "OBJFS_SOURCE and OBJFS_MOUNTPOINT not set"),
        ({"OBJFS_SOURCE": "s3://b"}, "OBJFS_MOUNTPOINT not set"),
        (
            {"OBJFS_SOURCE": "s3://b", "OBJFS_MOUNTPOINT": "/m", "OBJFS_ALLOW_OTHER": "maybe"},
            "OBJFS_ALLOW_OTHER='maybe' is not a boolean",
        ),
        (
            {"OBJFS_SOURCE": "s3://b", "OBJFS_MOUNTPOINT": "/m", "OBJFS_OPTIONS": "--region 'x"},
            "OBJFS_OPTIONS cannot be split",
        ),
    ],
)
def test_sidecar_configuration_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        sidecar_command(env)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OBJFS_")}
    res = subprocess.run(
        [sys.executable, "-m", "objfs", "sidecar"],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 2
    assert res.stderr.startswith("objfs: error: ")
    assert message in res.stderr
    assert len(res.stderr.splitlines()) == 1


def test_sidecar_environment_to_options() -> None:
    source, mountpoint, options = sidecar_command(
        {
            "OBJFS_SOURCE": "s3://bucket/models",
            "OBJFS_MOUNTPOINT": "/models/llama",
            "OBJFS_CACHE_DIR": "/cache",
            "OBJFS_MEMORY_LIMIT": "2G",
            "OBJFS_ALLOW_OTHER": "true",
            "OBJFS_NO_SIGN_REQUEST": "false",
            "OBJFS_METRICS_ADDR": "0.0.0.0:9101",
            "OBJFS_OPTIONS": "--region eu-west-1 --memory-limit 3G -f",
        }
    )
    assert (source, mountpoint) == ("s3://bucket/models", "/models/llama")
    assert options == [
        "--memory-limit",
        "2G",
        "--cache-dir",
        "/cache",
        "--metrics-addr",
        "0.0.0.0:9101",
        "--allow-other",
        "--region",
        "eu-west-1",
        "--memory-limit",
        "3G",  # OBJFS_OPTIONS come last and win
    ]
