"""objfs as system infrastructure: the systemd unit, and fstab / mount(8) through the
``mount.fuse.objfs`` helper, against the test S3 server.

mount(8) looks for ``mount.fuse.objfs`` only in /sbin, /sbin/fs.d and /sbin/fs (it ignores
$PATH), so the fstab tests link the venv's helper as /sbin/mount.fuse.objfs, exactly as the
README tells an operator to, and remove the link afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from objfs.credentials import read_credentials_file
from objfs.demo import LocalServer, free_port
from objfs.errors import UsageError
from objfs.mount_helper import HelperError, parse_helper_args, translate_options
from objfs.mountinfo import mount_entry
from tests.conftest import sha256
from tests.helpers.deploy import objfs, reaped, sha256_file, unmount_quietly, wait_for

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "objfs@.service"
VENV_BIN = Path(sys.executable).parent
HELPER_LINK = Path("/sbin/mount.fuse.objfs")


# -- the systemd unit ------------------------------------------------------------------------


def unit_for_this_machine(tmp_path: Path) -> Path:
    """The unit as shipped, with /usr/local/bin/objfs pointing at this checkout's objfs (the
    verifier checks that every command is executable)."""
    text = UNIT.read_text().replace("/usr/local/bin/objfs", str(VENV_BIN / "objfs"))
    path = tmp_path / "objfs@.service"
    path.write_text(text)
    return path


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_analyze_verify_passes(tmp_path: Path) -> None:
    unit = unit_for_this_machine(tmp_path)
    res = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # Warnings (an unknown key, a bad value) go to stderr without failing: demand silence.
    assert (res.returncode, res.stdout, res.stderr) == (0, "", "")

    # The verifier does catch mistakes: a misspelt key and a bad value fail it.
    broken = tmp_path / "broken@.service"
    broken.write_text(
        unit.read_text().replace("Type=notify", "Type=notfiy").replace("NoNewPrivileges", "NoNew")
    )
    res = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(broken)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "Unknown key" in res.stderr
    assert "notfiy" in res.stderr


def test_unit_settings_that_matter() -> None:
    s = unit_settings()
    assert s["Type"] == ["notify"]
    assert s["NotifyAccess"] == ["main"]
    assert s["EnvironmentFile"] == ["/etc/objfs/%i.conf"]
    assert "network-online.target" in " ".join(s["After"])
    assert s["Wants"] == ["network-online.target"]
    assert s["Restart"] == ["on-failure"]
    assert s["ExecStart"][0].split()[:5] == [
        "/usr/local/bin/objfs",
        "mount",
        "${OBJFS_SOURCE}",
        "${OBJFS_MOUNTPOINT}",
        "--foreground",
    ]
    assert s["ExecStop"] == ["-/usr/local/bin/objfs unmount ${OBJFS_MOUNTPOINT}"]
    # Options that create a mount namespace would hide the mount from everyone else.
    for key in ("PrivateTmp", "ProtectSystem", "ProtectHome", "PrivateDevices", "PrivateMounts"):
        assert key not in s, key
    assert s["DeviceAllow"] == ["/dev/fuse rw"]


def test_example_config_is_valid_objfs_options(tmp_path: Path) -> None:
    from objfs.options import build_parser, mount_config

    conf = dict(
        line.split("=", 1)
        for line in (ROOT / "systemd" / "models.conf.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    options = conf["OBJFS_OPTIONS"].split()  # systemd splits $OBJFS_OPTIONS at spaces
    credentials = options[options.index("--credentials-file") + 1]
    assert credentials == "/etc/objfs/models.credentials"
    local = tmp_path / "models.credentials"
    shutil.copy(ROOT / "systemd" / "models.credentials.example", local)
    assert set(read_credentials_file(str(local))) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    options[options.index("--credentials-file") + 1] = str(local)
    args = build_parser().parse_args(
        ["mount", conf["OBJFS_SOURCE"], conf["OBJFS_MOUNTPOINT"], "--foreground", *options]
    )
    config = mount_config(args)
    assert config.source.url() == "s3://my-model-bucket/llama-3-8b-instruct/"
    assert config.metrics_addr == "127.0.0.1:9101"
    assert config.allow_other


def syscall_groups() -> dict[str, list[str]]:
    out = subprocess.run(
        ["systemd-analyze", "syscall-filter", "--no-pager"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    groups: dict[str, list[str]] = {}
    current = ""
    for line in out.splitlines():
        if line.startswith("@"):
            current = line.strip()
            groups[current] = []
        elif line.strip() and not line.strip().startswith("#") and current:
            groups[current].append(line.strip())
    return groups


def expand(groups: dict[str, list[str]], names: list[str]) -> set[str]:
    out: set[str] = set()
    for name in names:
        if name.startswith("@"):
            out |= expand(groups, groups[name])
        else:
            out.add(name)
    return out


@pytest.mark.skipif(
    shutil.which("strace") is None or shutil.which("systemd-analyze") is None,
    reason="strace or systemd-analyze missing",
)
def test_unit_hardening_leaves_a_working_mount(
    s3_server: LocalServer, s3: Any, bucket: str, tmp_path: Path
) -> None:
    """What the unit's hardening allows is enough: objfs mounts, tunes the kernel, serves,
    caches on disk, serves metrics and unmounts with CAP_SYS_ADMIN as its only capability and
    no new privileges, and every system call it makes is in the unit's SystemCallFilter.
    (systemd itself is not PID 1 here, so the unit cannot be started as a whole.)"""
    settings = unit_settings()
    assert settings["CapabilityBoundingSet"] == ["CAP_SYS_ADMIN"]
    allowed = expand(syscall_groups(), settings["SystemCallFilter"][0].split())
    data = os.urandom(3 << 20)
    s3.put_object(Bucket=bucket, Key="h/w.bin", Body=data)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "objfs.log"
    trace = tmp_path / "strace.out"
    cmd = [
        "strace",
        "-f",
        "-qq",
        "-o",
        str(trace),
        "setpriv",
        "--bounding-set=-all,+sys_admin",
        "--inh-caps=-all",
        "--no-new-privs",
        str(VENV_BIN / "objfs"),
        "mount",
        f"s3://{bucket}/h",
        str(mnt),
        "--foreground",
        "--endpoint-url",
        s3_server.url,
        "--cache-dir",
        str(tmp_path / "cache"),
        "--log-file",
        str(log),
        "--metrics-addr",
        f"127.0.0.1:{free_port()}",
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with reaped(proc, mnt):
        wait_for("the mount", lambda: proc.poll() is not None or mount_entry(str(mnt)))
        assert sha256_file(mnt / "w.bin") == sha256(data)
        wait_for("the kernel tuning", lambda: "FUSE queue for" in log.read_text())
        subprocess.run(["umount", str(mnt)], check=True)
        assert proc.wait(timeout=60) == 0, log.read_text()
    text = log.read_text()
    assert "kernel read-ahead for" in text
    assert "cannot write" not in text
    lines = trace.read_text().splitlines()
    used = {m.group(1) for line in lines if (m := re.match(r"\d+ +([a-z0-9_]+)\(", line))}
    assert "mount" in used  # the trace did follow the daemon
    assert used - allowed == set()


# -- the mount helper's options ---------------------------------------------------------------


def test_helper_translates_mount_options() -> None:
    source, mnt, options, fake, verbose = parse_helper_args(
        [
            "s3://bucket/prefix",
            "/mnt/models",
            "-o",
            "ro,_netdev,nofail,allow_other,endpoint_url=http://minio:9000,cache_dir=/var/cache/"
            "objfs,region=eu-west-1,credentials=/etc/objfs/m.cred,x-systemd.automount,noatime",
        ]
    )
    assert (source, mnt, fake, verbose) == ("s3://bucket/prefix", "/mnt/models", False, False)
    assert options == [
        "--allow-other",
        "--endpoint-url",
        "http://minio:9000",
        "--cache-dir",
        "/var/cache/objfs",
        "--region",
        "eu-west-1",
        "--credentials-file",
        "/etc/objfs/m.cred",
    ]
    assert parse_helper_args(["s3://b", "/m", "-fv", "-oro"])[2:] == ([], True, True)
    # A fleet's fstab line: data GETs through the cache engine.
    assert translate_options(
        ["cache_proxy=http://objfs-cache:8080", "cache_proxy_url_lifetime=1800"]
    ) == ["--cache-proxy", "http://objfs-cache:8080", "--cache-proxy-url-lifetime", "1800"]
    assert translate_options(["max_connections=64", "metadata_ttl=indefinite"]) == [
        "--max-connections",
        "64",
        "--metadata-ttl",
        "indefinite",
    ]


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["aws_secret_access_key=hunter2"], ["'aws_secret_access_key'", "credentials=PATH"]),
        (["AZURE_STORAGE_KEY=abc"], ["credential"]),
        (["sas_token=sv=2020&sig=xyz"], ["credential"]),
        (["rw"], ["read-only"]),
        (["colour=blue"], ["unknown option 'colour'"]),
        (["cache_dir"], ["needs a value"]),
    ],
)
def test_helper_refuses_bad_options(options: list[str], words: list[str]) -> None:
    with pytest.raises(HelperError) as info:
        translate_options(options)
    message = str(info.value)
    for word in words:
        assert word in message
    for secret in ("hunter2", "abc", "xyz"):
        assert f"={secret}" not in message
        assert f" {secret}" not in message


def test_sloppy_helper_skips_unknown_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert translate_options(["colour=blue", "allow_other"], sloppy=True) == ["--allow-other"]
    assert "ignoring unknown option 'colour'" in capsys.readouterr().err


def test_credentials_file_format(tmp_path: Path) -> None:
    path = tmp_path / "cred"
    path.write_text(
        "# comment\n\nexport AWS_ACCESS_KEY_ID=AKID\nAWS_SECRET_ACCESS_KEY = 'with = sign'\n"
        'AZURE_STORAGE_CONNECTION_STRING="A=1;B=2"\n'
    )
    assert read_credentials_file(str(path)) == {
        "AWS_ACCESS_KEY_ID": "AKID",
        "AWS_SECRET_ACCESS_KEY": "with = sign",
        "AZURE_STORAGE_CONNECTION_STRING": "A=1;B=2",
    }
    path.write_text("AWS_ACCESS_KEY_ID=AKID\nLD_PRELOAD=/evil.so\n")
    with pytest.raises(UsageError) as info:
        read_credentials_file(str(path))
    assert "line 2 does not set a credential variable" in str(info.value)
    assert "LD_PRELOAD" not in str(info.value)
    assert "/evil.so" not in str(info.value)
    path.write_text("just-a-secret-value\n")
    with pytest.raises(UsageError) as info:
        read_credentials_file(str(path))
    assert "line 1 is not NAME=VALUE" in str(info.value)
    assert "just-a-secret-value" not in str(info.value)
    with pytest.raises(UsageError, match="No such file"):
        read_credentials_file(str(tmp_path / "missing"))


# -- mount(8) and fstab ------------------------------------------------------------------------


@pytest.fixture
def helper_on_sbin() -> Iterator[Path]:
    """/sbin/mount.fuse.objfs -> this venv's helper, for the test's duration."""
    target = VENV_BIN / "mount.fuse.objfs"
    assert target.exists(), "reinstall objfs (pip install -e .) to get the console script"
    if HELPER_LINK.is_symlink() or HELPER_LINK.exists():
        if HELPER_LINK.resolve() != target.resolve():
            pytest.skip(f"{HELPER_LINK} belongs to another objfs installation")
        yield HELPER_LINK
        return
    HELPER_LINK.symlink_to(target)
    try:
        yield HELPER_LINK
    finally:
        HELPER_LINK.unlink()


def mount8_env(tmp_path: Path) -> dict[str, str]:
    """mount(8)'s environment: no AWS keys (they must come from the credentials file)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ACCESS_KEY")}
    env.pop("AWS_SECRET_ACCESS_KEY", None)
    env["OBJFS_RUNTIME_DIR"] = str(tmp_path / "run")
    return env


def credentials_file(tmp_path: Path) -> Path:
    path = tmp_path / "models.credentials"
    path.write_text("AWS_ACCESS_KEY_ID=objfs-fstab\nAWS_SECRET_ACCESS_KEY=fstab-s3cr3t\n")
    path.chmod(0o600)
    return path


def mount8(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["mount", *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def check_served_then_umount(mnt: Path, data: bytes, env: dict[str, str]) -> None:
    entry = mount_entry(str(mnt))
    assert entry is not None
    assert entry[0] == "fuse.objfs"
    assert sha256_file(mnt / "config.json") == sha256(data)
    status = objfs("status", "--json", str(mnt), env=env)
    assert status.returncode == 0, status.stderr
    pid = int(json.loads(status.stdout)["pid"])
    assert psutil.Process(pid).is_running()
    res = subprocess.run(["umount", str(mnt)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert mount_entry(str(mnt)) is None
    wait_for("the daemon to exit after umount", lambda: not psutil.pid_exists(pid))


def test_mount_t_fuse_objfs_mounts_serves_and_umount_cleans_up(
    helper_on_sbin: Path, s3_server: LocalServer, s3: Any, bucket: str, tmp_path: Path
) -> None:
    data = b'{"architectures": ["LlamaForCausalLM"]}'
    s3.put_object(Bucket=bucket, Key="models/llama/config.json", Body=data)
    mnt = tmp_path / "models"
    mnt.mkdir()
    env = mount8_env(tmp_path)
    creds = credentials_file(tmp_path)
    source = f"s3://{bucket}/models/llama"
    options = (
        f"ro,_netdev,allow_other,endpoint_url={s3_server.url},cache_dir={tmp_path / 'cache'},"
        f"region=us-east-1,metadata_ttl=indefinite"
    )
    try:
        # Without the credentials file there are no credentials: the mount fails, cleanly.
        res = mount8("-t", "fuse.objfs", source, str(mnt), "-o", options, env=env)
        assert res.returncode != 0
        assert "no AWS credentials found" in res.stderr
        assert mount_entry(str(mnt)) is None

        res = mount8(
            "-t", "fuse.objfs", source, str(mnt), "-o", f"{options},credentials={creds}", env=env
        )
        assert res.returncode == 0, res.stderr
        assert "fstab-s3cr3t" not in res.stderr
        assert (tmp_path / "cache").is_dir()
        check_served_then_umount(mnt, data, env)

        # Credentials as options are refused without echoing them.
        res = mount8(
            "-t",
            "fuse.objfs",
            source,
            str(mnt),
            "-o",
            f"{options},aws_secret_access_key=fstab-s3cr3t",
            env=env,
        )
        assert res.returncode != 0
        assert "credentials=PATH" in res.stderr
        assert "fstab-s3cr3t" not in res.stderr
        assert mount_entry(str(mnt)) is None
    finally:
        unmount_quietly(mnt)


def test_fstab_line_mounts_with_mount_T(
    helper_on_sbin: Path, s3_server: LocalServer, s3: Any, bucket: str, tmp_path: Path
) -> None:
    """systemd/README.md's sample fstab line, in a scratch fstab (mount -T), mounted by its
    target."""
    data = b'{"fstab": true}'
    s3.put_object(Bucket=bucket, Key="models/llama/config.json", Body=data)
    mnt = tmp_path / "fstab-models"
    mnt.mkdir()
    env = mount8_env(tmp_path)
    creds = credentials_file(tmp_path)
    line = (
        f"s3://{bucket}/models/llama {mnt} fuse.objfs "
        f"ro,_netdev,nofail,allow_other,endpoint_url={s3_server.url},"
        f"cache_dir={tmp_path / 'cache'},credentials={creds} 0 0\n"
    )
    fstab = tmp_path / "fstab"
    fstab.write_text("# scratch fstab for the test\n" + line)
    try:
        res = mount8("-T", str(fstab), str(mnt), env=env)
        assert res.returncode == 0, res.stderr
        check_served_then_umount(mnt, data, env)
    finally:
        unmount_quietly(mnt)


def test_sd_notify_ready_only_once_serving_and_stopping(
    s3_server: LocalServer, s3: Any, bucket: str, tmp_path: Path
) -> None:
    """Type=notify without systemd: a datagram socket stands in for $NOTIFY_SOCKET."""
    import socket

    data = b"notify me"
    s3.put_object(Bucket=bucket, Key="n/a.txt", Body=data)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    runtime = tmp_path / "run"
    address = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(address))
        sock.settimeout(90)  # a hang guard
        cmd = [
            str(VENV_BIN / "objfs"),
            "mount",
            f"s3://{bucket}/n",
            str(mnt),
            "--foreground",
            "--endpoint-url",
            s3_server.url,
            "--log-file",
            str(tmp_path / "objfs.log"),
        ]
        env = {**os.environ, "NOTIFY_SOCKET": str(address), "OBJFS_RUNTIME_DIR": str(runtime)}
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        with reaped(proc, mnt):
            assert sock.recv(256) == b"READY=1"
            # When READY=1 arrives the mount is there, serving, and `objfs status` sees it.
            assert mount_entry(str(mnt)) is not None
            assert sha256_file(mnt / "a.txt") == sha256(data)
            probe = objfs("status", "--probe", str(mnt), env={"OBJFS_RUNTIME_DIR": str(runtime)})
            assert probe.returncode == 0, probe.stderr
            proc.send_signal(signal.SIGTERM)  # what systemd sends to stop it
            assert sock.recv(256) == b"STOPPING=1"
            assert proc.wait(timeout=60) == 0
            assert mount_entry(str(mnt)) is None
