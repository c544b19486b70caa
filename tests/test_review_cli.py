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
import errno
import json
import logging
import os
import resource
import selectors
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from objfs.config import available_memory_bytes, default_memory_ceiling, default_memory_limit
from objfs.credentials import CredentialWatch
from objfs.demo import LocalServer
from objfs.mountinfo import mount_entry
from objfs.status_files import status_file_name
from tests.conftest import mount_command, run_mount, run_objfs
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


# -- item 12: internal errors of a daemon, --memory-limit beyond the machine ---------------------


def _one_line(res: subprocess.CompletedProcess[str], code: int) -> str:
    assert res.returncode == code, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


def test_a_memory_limit_beyond_the_machine_is_a_usage_error(
    s3_server: LocalServer, bucket: str, mnt: Path, tmp_path: Path
) -> None:
    for mode in ((), ("--foreground",)):
        res = run_objfs(
            "mount", f"s3://{bucket}", str(mnt), "--endpoint-url", s3_server.url,
            "--memory-limit", "64T", "--log-file", str(tmp_path / "objfs.log"), *mode,
        )  # fmt: skip
        line = _one_line(res, 2)
        assert line.startswith("objfs: error: --memory-limit: '64T' is more than"), line


def test_a_memory_limit_the_system_refuses_is_a_usage_error(
    s3_server: LocalServer, bucket: str, mnt: Path, tmp_path: Path
) -> None:
    """Within the machine's memory, but more than the address space the process may have
    (ulimit -v): mapping the budget's arena fails with ENOMEM."""
    if available_memory_bytes() < 3 << 30:
        pytest.skip("needs 3 GiB of memory for a --memory-limit the machine could give")

    def limit_address_space() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    for mode in ((), ("--foreground",)):
        res = run_objfs(
            "mount", f"s3://{bucket}", str(mnt), "--endpoint-url", s3_server.url,
            "--memory-limit", "3G", "--log-file", str(tmp_path / "objfs.log"), *mode,
            preexec_fn=limit_address_space,
        )  # fmt: skip
        line = _one_line(res, 2)
        assert line.startswith("objfs: error: --memory-limit: the system refused 3072M"), line


_ARENA_LIMIT = """
import errno, os
if os.environ.get("OBJFS_TEST_ARENA_LIMIT"):
    import objfs.buffer_pool

    _limit = int(os.environ["OBJFS_TEST_ARENA_LIMIT"])
    _init = objfs.buffer_pool.BufferPool.__init__

    def _refusing(self, buffer_size, max_mapped, reserve_mapped=0):
        if buffer_size * max(max_mapped, reserve_mapped) > _limit:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        _init(self, buffer_size, max_mapped, reserve_mapped)

    objfs.buffer_pool.BufferPool.__init__ = _refusing
"""


def test_a_default_budget_the_system_refuses_names_its_growth_and_the_way_out(
    s3_server: LocalServer, bucket: str, mnt: Path, tmp_path: Path
) -> None:
    """The default budget's arena is mapped for its ceiling (it grows while several processes
    read one file). Where the system refuses that much (a sitecustomize stands in for a
    short ``ulimit -v``: a real one first fails the daemon's threads), the error says so
    and that a given --memory-limit does not grow; with one, the same system mounts."""
    ceiling, base = default_memory_ceiling(), default_memory_limit()
    if ceiling <= base:
        pytest.skip("the default budget cannot grow on this machine")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_ARENA_LIMIT)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OBJFS_TEST_ARENA_LIMIT": str(base)}
    args = ["mount", f"s3://{bucket}", str(mnt), "--endpoint-url", s3_server.url]
    for mode in ((), ("--foreground",)):
        line = _one_line(run_objfs(*args, *mode, env=env), 2)
        assert line == (
            f"objfs: error: the system refused {ceiling >> 20}M of address space for the "
            f"default memory budget ({base >> 20}M, which grows up to that while several "
            f"processes read one file; {os.strerror(errno.ENOMEM)}): give --memory-limit, "
            "which never grows (see free -h, ulimit -v and the cgroup's limit)"
        ), line
    res = run_objfs(*args, "--memory-limit", f"{base >> 20}M", env=env)
    try:
        assert res.returncode == 0, res.stderr
        assert mount_entry(str(mnt)) is not None
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False, capture_output=True)


_INJECT = """
import os
if os.environ.get("OBJFS_TEST_INJECT_ERROR"):
    import objfs.fs

    def _fail(*args, **kwargs):
        raise RuntimeError("injected by a test")

    objfs.fs.FileSystem.__init__ = _fail
"""


def _injecting_env(tmp_path: Path) -> dict[str, str]:
    """The environment of an objfs whose FileSystem raises RuntimeError (an internal error):
    a sitecustomize on PYTHONPATH patches it in each objfs process, the daemon's too."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_INJECT)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OBJFS_TEST_INJECT_ERROR": "1"}


@pytest.mark.parametrize("mode", ["daemon", "foreground"])
def test_an_internal_error_is_logged_with_its_traceback_and_shown_in_one_line(
    s3_server: LocalServer, s3: Any, bucket: str, mnt: Path, tmp_path: Path, mode: str
) -> None:
    s3.put_object(Bucket=bucket, Key="m/a", Body=b"a")
    log = tmp_path / "objfs.log"
    res = run_objfs(
        "mount", f"s3://{bucket}/m", str(mnt), "--endpoint-url", s3_server.url,
        "--log-file", str(log), *(["--foreground"] if mode == "foreground" else []),
        env=_injecting_env(tmp_path),
    )  # fmt: skip
    line = _one_line(res, 1)
    assert line == (
        "objfs: internal error: RuntimeError: injected by a test "
        f"(the traceback is in {log}; please report it)"
    )
    text = log.read_text()
    assert " ERROR objfs: internal error: RuntimeError: injected by a test\n" in text, text
    assert "Traceback (most recent call last):" in text, text
    assert 'raise RuntimeError("injected by a test")' in text, text


# -- item 15: start-up warnings on the terminal of `objfs mount` --------------------------------


def test_mount_prints_the_daemons_start_up_warnings(
    s3_server: LocalServer, bucket: str, tmp_path: Path
) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = run_objfs(
        "mount", f"s3://{bucket}/nothing-here", str(mnt), "--endpoint-url", s3_server.url,
        "--log-file", str(tmp_path / "objfs.log"),
    )  # fmt: skip
    try:
        assert res.returncode == 0, res.stderr
        assert f"objfs: warning: s3://{bucket}/nothing-here/ holds no objects" in res.stderr
        assert "Traceback" not in res.stderr
        assert all(line.startswith("objfs: warning: ") for line in res.stderr.splitlines())
    finally:
        if mount_entry(str(mnt)) is not None:
            done = run_objfs("unmount", str(mnt))
            assert done.returncode == 0, done.stderr
    assert mount_entry(str(mnt)) is None


# -- item 14: status files that another user could have written ---------------------------------


def test_status_trusts_only_files_the_mounts_owner_wrote_in_a_private_folder(
    mount_s3: Any, s3: Any, bucket: str, tmp_path: Path
) -> None:
    s3.put_object(Bucket=bucket, Key="a", Body=b"a")
    mounted = mount_s3(f"s3://{bucket}", env={"OBJFS_RUNTIME_DIR": str(tmp_path / "run")})
    mountpoint = os.path.realpath(mounted.path)
    # A file as another local user could plant it in a shared folder: a live pid (1) and a
    # time in the future, so a probe would pass for a daemon that hangs.
    shared = tmp_path / "shared"
    shared.mkdir()
    planted = shared / status_file_name(mountpoint)
    data = {"mountpoint": mountpoint, "pid": 1, "updated_at": time.time() + 3600}
    planted.write_text(json.dumps(data))
    env = {**os.environ, "OBJFS_RUNTIME_DIR": str(shared)}

    def probe(folder_mode: int, file_mode: int, owner: int) -> subprocess.CompletedProcess[str]:
        shared.chmod(folder_mode)
        planted.chmod(file_mode)
        os.chown(planted, owner, owner)
        return run_objfs("status", "--probe", str(mounted.path), env=env)

    assert os.geteuid() == 0, "the test plants files of another uid"
    # As root wrote it, in a private folder: trusted (what the planted files imitate).
    res = probe(0o700, 0o644, 0)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    for folder_mode, file_mode, owner, reason in [
        (0o700, 0o644, 12345, "owned by uid 12345, not by the mount's owner (uid 0)"),
        (0o700, 0o666, 0, "writable by other users"),
        (0o777, 0o644, 0, "its folder is writable by other users"),
    ]:
        res = probe(folder_mode, file_mode, owner)
        assert res.returncode == 18, (reason, res.stderr)
        warning, error = res.stderr.splitlines()
        assert warning.startswith(f"objfs: warning: ignoring status file {planted}: {reason}")
        assert error.startswith("objfs: error: "), error
    shared.chmod(0o700)
    os.chown(shared, 12345, 12345)
    res = probe(0o700, 0o644, 0)
    assert res.returncode == 18, res.stderr
    assert "its folder belongs to uid 12345" in res.stderr
    os.chown(shared, 0, 0)


# -- item 15: a file removed while objfs warm walks its directory --------------------------------


def test_warm_lists_a_file_removed_mid_walk_as_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from objfs import cli, warm

    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "kept").write_bytes(b"k" * 1000)
    (tree / "gone").write_bytes(b"g")
    real_walk = os.walk

    def walk(top: str, *args: Any, **kwargs: Any) -> Any:
        # The directory lists "gone"; it is removed before the walk stats it.
        for dirpath, dirnames, filenames in real_walk(top, *args, **kwargs):
            if "gone" in filenames:
                os.unlink(os.path.join(dirpath, "gone"))
            yield dirpath, dirnames, filenames

    monkeypatch.setattr(warm, "_on_objfs_mount", lambda path: True)
    monkeypatch.setattr(warm.os, "walk", walk)
    code = cli.main(["warm", str(tree)])
    err = capfd.readouterr().err
    assert "internal error" not in err
    assert code == 17, err
    assert f"objfs: could not read {tree}/gone: No such file or directory\n" in err
    assert "warmed 1 files, 1000 B" in err
    assert err.endswith("objfs: error: 1 of 2 files could not be read (listed above)\n")


# -- item 13: one CA choice for listings and data GETs -------------------------------------------


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (PEM files): a private CA of its own."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = tmp_path / "ca.pem", tmp_path / "ca.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


class TlsFront:
    """HTTPS on a loopback port in front of a plain-HTTP server (moto, Azurite): each
    connection's TLS ends here and its bytes go on to the server. One thread per connection
    does both directions, so no TLS object is used by two threads."""

    def __init__(self, cert: Path, key: Path, target_url: str) -> None:
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(cert, key)
        parts = urllib.parse.urlsplit(target_url)
        self._target = ("127.0.0.1", parts.port or 80)
        self._listener = socket.create_server(("127.0.0.1", 0))
        port = self._listener.getsockname()[1]
        self.url = urllib.parse.urlunsplit(("https", f"127.0.0.1:{port}", parts.path, "", ""))
        self.handshakes_refused = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        try:
            tls = self._context.wrap_socket(conn, server_side=True)
        except OSError:  # the client did not trust the certificate
            self.handshakes_refused += 1
            conn.close()
            return
        # A selector, not select(): the test process may hold descriptors past FD_SETSIZE.
        with (
            tls,
            socket.create_connection(self._target) as upstream,
            selectors.DefaultSelector() as selector,
        ):
            selector.register(tls, selectors.EVENT_READ)
            selector.register(upstream, selectors.EVENT_READ)
            while True:
                if tls.pending():
                    ready: list[socket.socket] = [tls]
                else:
                    ready = [key.fileobj for key, _ in selector.select(60)]  # type: ignore[misc]
                if not ready:
                    return
                for src in ready:
                    try:
                        data = src.recv(1 << 16)
                        if not data:
                            return
                        (upstream if src is tls else tls).sendall(data)
                    except OSError:
                        return


@pytest.fixture
def no_ca_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """This environment names the system's CAs in AWS_CA_BUNDLE and friends: drop them, so
    the tests see only the CA choice they make."""
    for name in ("AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_ca_variables")
def test_s3_data_gets_trust_the_cas_botocore_trusts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CA file is chosen once, as botocore does, for its clients and the data pool."""
    import botocore.httpsession

    from objfs.backends.s3 import S3Backend
    from objfs.config import S3Options
    from objfs.errors import UsageError

    profile_ca, env_ca, option_ca = (tmp_path / n for n in ("p.pem", "e.pem", "o.pem"))
    for path in (profile_ca, env_ca, option_ca):
        path.write_text("")
    config = tmp_path / "aws-config"
    config.write_text(f"[profile tls]\nregion = us-east-1\nca_bundle = {profile_ca}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))

    def chosen(**options: Any) -> tuple[str, str]:
        backend = S3Backend("b", S3Options(endpoint_url="https://127.0.0.1:1", **options))
        return backend._data._ca_file, backend._client._endpoint.http_session._verify  # type: ignore[attr-defined,return-value]

    assert chosen(profile="tls") == (str(profile_ca), str(profile_ca))
    monkeypatch.setenv("AWS_CA_BUNDLE", str(env_ca))
    assert chosen(profile="tls") == (str(env_ca), str(env_ca))
    assert chosen(profile="tls", ca_bundle=str(option_ca)) == (str(option_ca), str(option_ca))
    monkeypatch.delenv("AWS_CA_BUNDLE")
    default = botocore.httpsession.get_cert_path(True)  # certifi's, not the system store
    assert chosen() == (default, default)
    config.write_text(f"[profile tls]\nca_bundle = {tmp_path / 'missing.pem'}\n")
    with pytest.raises(UsageError, match=r"^the profile's ca_bundle: .* is not a file"):
        chosen(profile="tls")


@pytest.mark.usefixtures("no_ca_variables")
def test_a_profiles_ca_bundle_serves_listings_and_reads_over_tls(
    s3_server: LocalServer, s3: Any, bucket: str, tmp_path: Path
) -> None:
    cert, key = _self_signed(tmp_path)
    data = os.urandom(3 * (1 << 20) + 5)
    s3.put_object(Bucket=bucket, Key="m/w.bin", Body=data)
    config = tmp_path / "aws-config"
    config.write_text(
        f"[profile tls]\nregion = us-east-1\nca_bundle = {cert}\n"
        "aws_access_key_id = objfs-test\naws_secret_access_key = objfs-test-secret\n"
    )
    front = TlsFront(cert, key, s3_server.url)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = mount_command(
        f"s3://{bucket}/m", mnt, tmp_path / "objfs.log",
        "--endpoint-url", front.url, "--profile", "tls",
    )  # fmt: skip
    try:
        with run_mount(cmd, mnt, tmp_path / "objfs.out", env={"AWS_CONFIG_FILE": str(config)}):
            assert os.listdir(mnt) == ["w.bin"]  # a listing (botocore)
            assert (mnt / "w.bin").read_bytes() == data  # ranged GETs (rawhttp)
    finally:
        front.close()
    assert front.handshakes_refused == 0


@pytest.mark.usefixtures("no_ca_variables")
def test_requests_ca_bundle_serves_azure_listings_and_reads_over_tls(
    mount_az: Any, azurite: Any, azure_service: Any, container: str, tmp_path: Path
) -> None:
    cert, key = _self_signed(tmp_path)
    data = os.urandom(3 * (1 << 20) + 5)
    azure_service.get_container_client(container).upload_blob("m/w.bin", data)
    front = TlsFront(cert, key, azurite.account_url)
    try:
        mounted = mount_az(
            f"az://{container}/m", "--account-url", front.url,
            env={"REQUESTS_CA_BUNDLE": str(cert)},
        )  # fmt: skip
        assert os.listdir(mounted.path) == ["w.bin"]  # a listing (the SDK)
        assert (mounted.path / "w.bin").read_bytes() == data  # ranged GETs (rawhttp)
    finally:
        front.close()
    assert front.handshakes_refused == 0
