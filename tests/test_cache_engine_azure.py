"""Data GETs of Azure mounts through a shared cache engine (``--cache-proxy``): the nginx
configuration the Helm chart renders (``k8s/charts/objfs/files/nginx.conf``) run for real in
front of Azurite, with a counting proxy between nginx and Azurite that sees every byte the
origin sends (objfs's account URL is that proxy too, so the URLs it signs name the host nginx
forwards to).

What is checked: two nodes (two mounts, each with its own disk cache) loading the same blobs
at once fetch them about once from the origin, byte-exact, with SAS that objfs signs with the
account key; a SAS token given as the credential goes through the engine as it is; the engine
killed in the middle of a load costs no error (the store answers directly); a blob replaced
between two loads is never served the old version's bytes; no SAS signature reaches objfs's
log or nginx's; ``--cache-proxy`` is accepted for an Azure SOURCE and still checked.
"""

from __future__ import annotations

import base64
import datetime as _dt
import errno
import logging
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from objfs.options import build_parser, mount_config
from tests.azurite import DEV_ACCOUNT, DEV_KEY, put_blobs
from tests.conftest import Mount, fresh_status, load_at_once, run_objfs, sha256
from tests.helpers.known_secrets import remember
from tests.helpers.proxy import FaultPlan, Proxy
from tests.test_cache_engine import PART, Engine, running_engine
from tests.test_cli_errors import assert_one_line_error

MiB = 1 << 20


@pytest.fixture
def origin(azurite: Any) -> Iterator[Proxy]:
    """A counting proxy in front of Azurite's blob port: the store as objfs and nginx see it."""
    with Proxy(azurite.port) as proxy:
        yield proxy


@pytest.fixture
def engine(origin: Proxy, tmp_path: Path) -> Iterator[Engine]:
    with running_engine(tmp_path / "nginx", origin) as e:
        yield e


def _node(
    mount_az: Any,
    container: str,
    origin: Proxy,
    engine: Engine,
    name: str,
    tmp: Path,
    *options: str,
    env: dict[str, str] | None = None,
    via: str | None = None,
) -> Mount:
    """A mount of ``az://CONTAINER/m`` signed for ``origin``, its data GETs through
    ``engine`` (or ``via``, a proxy in front of it)."""
    m: Mount = mount_az(
        f"az://{container}/m",
        "--account-url",
        f"{origin.url}/{DEV_ACCOUNT}",  # after the fixture's: this one wins
        "--cache-proxy",
        via or engine.url,
        "--part-size",
        PART,
        "--cache-dir",
        str(tmp / f"cache-{name}"),
        "--metadata-ttl",
        "1",
        *options,
        env=env,
    )
    return m


def _assert_no_signature(
    engine: Engine, mounts: list[Mount], *secrets: str, through: bool = True
) -> None:
    """No SAS signature in objfs's logs (its --log-file and its stdout/stderr) nor nginx's;
    ``through``: some GET went through nginx (its access log has a line)."""
    texts = [engine.access_log(), *(m.log() for m in mounts)]
    texts += [m.log_path.with_suffix(".out").read_text(errors="replace") for m in mounts]
    error_log = engine.run_dir / "error.log"
    if error_log.exists():
        texts.append(error_log.read_text(errors="replace"))
    assert engine.access_log() or not through, "nginx logged no request"
    for text in texts:
        assert "sig=" not in text
        for secret in (DEV_KEY, *secrets):
            assert secret not in text


def _container_sas(container: str, read: bool = True) -> str:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    sas = generate_container_sas(
        DEV_ACCOUNT,
        container,
        account_key=DEV_KEY,
        permission=ContainerSasPermissions(read=read, list=True),
        expiry=_dt.datetime.now(_dt.UTC) + _dt.timedelta(hours=1),
    )
    return remember("a container SAS for the cache engine", sas)


# -- the command line ------------------------------------------------------------------------------


def test_an_azure_source_takes_the_cache_proxy_options() -> None:
    args = build_parser().parse_args(
        [
            "mount",
            "az://models/m",
            "/mnt",
            "--account-name",
            "acct",
            "--cache-proxy",
            "http://cache:8080/",
            "--cache-proxy-url-lifetime",
            "600",
        ]
    )
    config = mount_config(args)
    assert config.azure.cache_proxy == "http://cache:8080"
    assert config.azure.cache_proxy_url_lifetime_s == 600
    # Declared once (CacheProxyOptions), parsed once, the same for both stores.
    assert config.s3.cache_proxy == config.azure.cache_proxy
    assert config.s3.cache_proxy_url_lifetime_s == 600


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["--cache-proxy", "cache:8080"], ["--cache-proxy", "http://"]),
        (["--cache-proxy", "http://u:p@cache:8080"], ["--cache-proxy", "engine's address"]),
        (
            ["--cache-proxy", "http://cache:8080", "--cache-proxy-url-lifetime", "1"],
            ["--cache-proxy-url-lifetime", "2 to 604800"],
        ),
    ],
)
def test_the_command_checks_the_cache_proxy_options_of_an_azure_source(
    mnt: Path, options: list[str], words: list[str]
) -> None:
    res = run_objfs("mount", "az://models/m", str(mnt), "--account-name", DEV_ACCOUNT, *options)
    assert_one_line_error(res, 2, *words)
    assert "S3 option" not in res.stderr
    assert "u:p" not in res.stderr


# -- the SAS objfs sends ---------------------------------------------------------------------------


def _signer(credential: Any) -> Any:
    from objfs.backends.azure_auth import Credentials, Signer

    return Signer(Credentials("http://127.0.0.1:1/acct", "acct", credential, "test"))


def _fields(sas: str) -> dict[str, str]:
    return {k: urllib.parse.unquote(v) for k, v in (p.split("=", 1) for p in sas.split("&"))}


def _when(text: str) -> _dt.datetime:
    return _dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.UTC)


def test_a_sas_signed_with_the_key_reads_one_blob_and_is_renewed_at_half_its_lifetime() -> None:
    from azure.core.credentials import AzureNamedKeyCredential

    signer = _signer(AzureNamedKeyCredential("acct", DEV_KEY))
    sas, minted = signer.engine_query("models", "m/a.bin", 4, None)
    assert minted
    f = _fields(sas)
    assert (f["sp"], f["sr"]) == ("r", "b")  # read, this blob only
    assert "sig" in f
    life = (_when(f["se"]) - _when(f["st"])).total_seconds()
    assert 4 + 240 <= life <= 4 + 360  # the lifetime, from a few minutes back (clock skew)
    assert signer.engine_query("models", "m/a.bin", 4, None) == (sas, False)
    other, minted = signer.engine_query("models", "m/b.bin", 4, None)
    assert minted
    assert other != sas
    time.sleep(2.2)  # past half the lifetime: signed again
    again, minted = signer.engine_query("models", "m/a.bin", 4, None)
    assert minted
    assert again != sas


def test_a_sas_token_credential_is_sent_only_when_asked_and_follows_its_rotation() -> None:
    """A SAS token credential cannot sign a narrower SAS: without --cache-proxy-send-sas-token
    it never goes to the engine (None: that GET reads the store directly)."""
    from azure.core.credentials import AzureSasCredential

    credential = AzureSasCredential("?sv=2022-11-02&sp=rl&sig=first")
    signer = _signer(credential)
    assert signer.engine_query("models", "m/a.bin", 3600, None) == (None, False)
    assert signer.engine_query("models", "m/a.bin", 3600, None, send_sas_token=True) == (
        "sv=2022-11-02&sp=rl&sig=first",
        False,
    )
    credential.update("sv=2022-11-02&sp=rl&sig=second")  # a rotated --sas-token-file
    query = signer.engine_query("models", "m/a.bin", 3600, None, send_sas_token=True)[0]
    assert query is not None
    assert query.endswith("sig=second")
    assert _signer(None).engine_query("models", "m/a.bin", 3600, None) == ("", False)


class _Token:
    """A token credential (DefaultAzureCredential's shape)."""

    def get_token(self, *scopes: str) -> Any:
        raise AssertionError("the engine's SAS needs no token of its own here")


class _Service:
    """A BlobServiceClient's get_user_delegation_key: refused, or a key."""

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.calls = 0

    def get_user_delegation_key(self, start: _dt.datetime, expiry: _dt.datetime) -> Any:
        from azure.core.exceptions import HttpResponseError
        from azure.storage.blob import UserDelegationKey

        self.calls += 1
        if self.refuse:
            exc = HttpResponseError(message="denied for https://acct/?sig=SECRET-IN-SDK-TEXT")
            exc.status_code = 403
            exc.error_code = "AuthorizationPermissionMismatch"  # type: ignore[attr-defined]
            raise exc
        key = UserDelegationKey()  # type: ignore[no-untyped-call]
        key.signed_oid, key.signed_tid = "oid-1", "tid-1"
        key.signed_start = start.strftime("%Y-%m-%dT%H:%M:%SZ")
        key.signed_expiry = expiry.strftime("%Y-%m-%dT%H:%M:%SZ")
        key.signed_service, key.signed_version = "b", "2021-08-06"
        key.value = base64.b64encode(b"k" * 32).decode()
        return key


def test_a_token_credential_signs_with_one_user_delegation_key() -> None:
    signer, service = _signer(_Token()), _Service(refuse=False)
    sas, minted = signer.engine_query("models", "m/a.bin", 3600, service)
    assert minted
    f = _fields(sas)
    assert (f["sp"], f["sr"], f["skoid"]) == ("r", "b", "oid-1")
    assert signer.engine_query("models", "m/b.bin", 3600, service)[1]
    assert service.calls == 1  # one key for every blob's SAS


def test_a_token_credential_without_a_delegation_key_reads_directly_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    signer, service = _signer(_Token()), _Service(refuse=True)
    with caplog.at_level(logging.WARNING, logger="objfs"):
        assert signer.engine_query("models", "m/a.bin", 3600, service) == (None, False)
        assert signer.engine_query("models", "m/b.bin", 3600, service) == (None, False)
    assert service.calls == 1  # not asked again at every GET
    warnings = [r.getMessage() for r in caplog.records if "delegation" in r.getMessage()]
    assert len(warnings) == 1
    assert "AuthorizationPermissionMismatch" in warnings[0]
    assert "SECRET" not in caplog.text
    assert "sig=" not in caplog.text


# -- through a real engine -------------------------------------------------------------------------


def test_two_nodes_loading_at_once_fetch_the_blobs_once_from_the_origin(
    azurite: Any, container: str, origin: Proxy, engine: Engine, mount_az: Any, tmp_path: Path
) -> None:
    files = {f"m/shard{i}.bin": os.urandom(24 * MiB + 1000 * i) for i in range(2)}
    put_blobs(azurite, container, files)
    nodes = [_node(mount_az, container, origin, engine, n, tmp_path) for n in ("a", "b")]
    origin.reset_stats()
    assert load_at_once(nodes, {key[2:]: data for key, data in files.items()}) == []
    total = sum(len(d) for d in files.values())
    sent = origin.stats.response_bytes
    assert sent <= 1.1 * total, f"the origin sent {sent / total:.2f}x the blobs"
    for m in nodes:
        status = fresh_status(m.path)["cache_engine"]
        assert status["bytes_via_engine"] == total
        assert status["failures"] == 0
        assert status["bytes_direct"] == 0
        assert status["urls_signed"] >= len(files)  # with the account key: one SAS a blob
    _assert_no_signature(engine, nodes)


@pytest.mark.parametrize(
    "env",
    [
        {"AZURE_STORAGE_SAS_TOKEN": "sv=2022-11-02&sp=rl&sig=SECRET-SAS"},
        {
            "AZURE_STORAGE_CONNECTION_STRING": "BlobEndpoint=http://127.0.0.1:1/a;"
            "SharedAccessSignature=sv=2022-11-02&sp=rl&sig=SECRET-SAS"
        },
    ],
    ids=["sas-token", "connection-string"],
)
def test_a_sas_token_credential_with_the_engine_is_refused_unless_asked(
    mnt: Path, env: dict[str, str]
) -> None:
    """The mount's own SAS (often long-lived, listing, maybe broader) would go to a shared
    engine, by default over http://: refused in one line that says what to do."""
    res = run_objfs(
        "mount",
        "az://models/m",
        str(mnt),
        "--account-name",
        DEV_ACCOUNT,
        "--account-url",
        f"http://127.0.0.1:1/{DEV_ACCOUNT}",
        "--cache-proxy",
        "http://127.0.0.1:1",
        env={**os.environ, "AZURE_STORAGE_KEY": "", **env},
    )
    assert_one_line_error(res, 2, "--cache-proxy", "SAS token", "--cache-proxy-send-sas-token")
    assert "SECRET" not in res.stderr
    assert "sig=" not in res.stderr


def test_the_s3_source_refuses_the_azure_only_sas_option(mnt: Path) -> None:
    res = run_objfs(
        "mount",
        "s3://models/m",
        str(mnt),
        "--cache-proxy",
        "http://127.0.0.1:1",
        "--cache-proxy-send-sas-token",
    )
    assert_one_line_error(res, 2, "--cache-proxy-send-sas-token", "Azure option")


def test_a_sas_token_credential_goes_through_the_engine_as_it_is_when_asked(
    azurite: Any, container: str, origin: Proxy, engine: Engine, mount_az: Any, tmp_path: Path
) -> None:
    data = os.urandom(20 * MiB + 333)
    put_blobs(azurite, container, {"m/w.bin": data})
    sas = _container_sas(container)
    signature = dict(part.split("=", 1) for part in sas.split("&"))["sig"]
    env = {"AZURE_STORAGE_KEY": "", "AZURE_STORAGE_SAS_TOKEN": sas}  # only the SAS
    m = _node(
        mount_az, container, origin, engine, "a", tmp_path, "--cache-proxy-send-sas-token", env=env
    )
    assert "AZURE_STORAGE_SAS_TOKEN" in m.log()  # the credential source is named
    assert sha256((m.path / "w.bin").read_bytes()) == sha256(data)
    status = fresh_status(m.path)["cache_engine"]
    assert status["bytes_via_engine"] == len(data)
    assert status["failures"] == 0
    assert status["urls_signed"] == 0  # the user's SAS, not one objfs signed
    _assert_no_signature(engine, [m], signature, sas)


def test_the_engine_killed_in_the_middle_of_a_load_costs_no_error(
    azurite: Any, container: str, origin: Proxy, engine: Engine, mount_az: Any, tmp_path: Path
) -> None:
    data = os.urandom(40 * MiB + 77)
    put_blobs(azurite, container, {"m/big.bin": data})
    m = _node(mount_az, container, origin, engine, "a", tmp_path)
    with open(m.path / "big.bin", "rb") as f:
        head = f.read(8 * MiB)
        engine.kill()
        rest = f.read()
    assert sha256(head + rest) == sha256(data)
    status = fresh_status(m.path)["cache_engine"]
    assert status["failures"] >= 1
    assert status["bytes_direct"] > 0
    assert status["bytes_via_engine"] > 0
    log = m.log()
    assert "cache engine" in log
    assert "reading from the store directly" in log
    _assert_no_signature(engine, [m])


def test_a_replaced_blob_is_never_served_the_old_versions_bytes(
    azurite: Any, container: str, origin: Proxy, engine: Engine, mount_az: Any, tmp_path: Path
) -> None:
    old, new = os.urandom(10 * MiB), os.urandom(10 * MiB)
    put_blobs(azurite, container, {"m/r.bin": old})
    a = _node(mount_az, container, origin, engine, "a", tmp_path)
    assert sha256((a.path / "r.bin").read_bytes()) == sha256(old)
    put_blobs(azurite, container, {"m/r.bin": new})
    b = _node(mount_az, container, origin, engine, "b", tmp_path)
    assert sha256((b.path / "r.bin").read_bytes()) == sha256(new)
    time.sleep(1.5)  # past node a's metadata TTL
    assert sha256((a.path / "r.bin").read_bytes()) == sha256(new)
    for m in (a, b):
        status = fresh_status(m.path)["cache_engine"]
        assert status["failures"] == 0
        assert status["bytes_via_engine"] > 0
    # b read the new version through the engine only: its bytes were never a's cached ones.
    assert fresh_status(b.path)["cache_engine"]["bytes_via_engine"] == len(new)


def test_a_blob_replaced_under_an_open_handle_is_stale_and_the_engine_not_blamed(
    azurite: Any, container: str, origin: Proxy, engine: Engine, mount_az: Any, tmp_path: Path
) -> None:
    """The engine passes the store's 412 (If-Match: the handle's pin) on: objfs reads that
    range from the store directly, which says the version is gone (ESTALE), and the engine
    is not blamed for it."""
    old, new = os.urandom(40 * MiB), os.urandom(40 * MiB)
    put_blobs(azurite, container, {"m/s.bin": old})
    m = _node(mount_az, container, origin, engine, "a", tmp_path)
    with open(m.path / "s.bin", "rb") as f:
        assert f.read(MiB) == old[:MiB]
        put_blobs(azurite, container, {"m/s.bin": new})
        f.seek(36 * MiB)
        with pytest.raises(OSError, match="Stale") as caught:
            f.read(MiB)
        assert caught.value.errno == errno.ESTALE
    assert '" 412 ' in engine.access_log()
    status = fresh_status(m.path)["cache_engine"]
    assert status["failures"] == 0
    assert status["bytes_direct"] > 0
    assert "reading from the store directly" not in m.log()


def test_an_engine_that_serves_another_version_is_caught_by_the_etag_check(
    azurite: Any, container: str, origin: Proxy, engine: Engine, mount_az: Any, tmp_path: Path
) -> None:
    """A gateway in front of the engine drops If-Match: the engine's cache key no longer names
    the version, and it serves the old version's cached slices for the new pin. objfs sees
    the reply's ETag, reads the store directly, and blames the engine."""
    old, new = os.urandom(9 * MiB), os.urandom(9 * MiB)
    put_blobs(azurite, container, {"m/v.bin": old})
    with Proxy(engine.listen) as gateway:
        gateway.drop_request_headers({"if-match"})
        a = _node(mount_az, container, origin, engine, "a", tmp_path, via=gateway.url)
        assert sha256((a.path / "v.bin").read_bytes()) == sha256(old)
        put_blobs(azurite, container, {"m/v.bin": new})
        b = _node(mount_az, container, origin, engine, "b", tmp_path, via=gateway.url)
        assert sha256((b.path / "v.bin").read_bytes()) == sha256(new)
        assert gateway.injected["dropped if-match"] > 0
    status = fresh_status(b.path)["cache_engine"]
    assert status["failures"] >= 1
    assert status["bytes_direct"] > 0
    assert "it answered another version" in b.log()


@pytest.mark.parametrize("fault", ["500", "wrong_range", "truncate", "reset"])
def test_a_broken_engine_reply_is_never_used(
    azurite: Any,
    container: str,
    origin: Proxy,
    engine: Engine,
    mount_az: Any,
    tmp_path: Path,
    fault: str,
) -> None:
    data = os.urandom(16 * MiB + 99)
    put_blobs(azurite, container, {"m/f.bin": data})
    with Proxy(engine.listen) as gateway:
        gateway.set_faults(FaultPlan(kinds=(fault,), cut_after=64 * 1024))
        # A short read timeout: the proxy's reset reaches objfs when its other thread's
        # read of the socket ends (tests/test_faults.py does the same).
        m = _node(
            mount_az,
            container,
            origin,
            engine,
            "a",
            tmp_path,
            "--read-timeout",
            "2",
            via=gateway.url,
        )
        assert sha256((m.path / "f.bin").read_bytes()) == sha256(data)
        assert gateway.injected[fault] >= 1
    status = fresh_status(m.path)["cache_engine"]
    assert status["failures"] >= 1
    assert status["bytes_direct"] > 0
    assert "reading from the store directly" in m.log()
    _assert_no_signature(engine, [m], through=fault != "500")  # a 500 is the gateway's own


def test_no_signature_reaches_a_log_even_at_debug_level(
    azurite: Any, container: str, origin: Proxy, engine: Engine, mount_az: Any, tmp_path: Path
) -> None:
    data = os.urandom(12 * MiB + 5)
    put_blobs(azurite, container, {"m/d.bin": data, "m/e.bin": data[::-1]})
    m = _node(mount_az, container, origin, engine, "a", tmp_path, "--log-level", "debug")
    assert sha256((m.path / "d.bin").read_bytes()) == sha256(data)
    # An engine failure is logged too: the SAS must not be in that line either.
    engine.kill()
    assert sha256((m.path / "e.bin").read_bytes()) == sha256(data[::-1])
    status = fresh_status(m.path)["cache_engine"]
    assert status["failures"] >= 1
    assert "cache engine" in m.log()
    _assert_no_signature(engine, [m])


# -- authorization: the store decides every GET, hit or miss ------------------------------------


def _checks(origin: Proxy) -> list[str]:
    """The authorization checks the store saw (the engine's: 1 byte, no If-Match), by path."""
    return [
        r.target.split("?", 1)[0]
        for r in origin.stats.requests
        if r.headers.get("range") == "bytes=0-0" and "if-match" not in r.headers
    ]


def _get(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return int(reply.status), bytes(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_store_authorizes_every_get_through_the_engine_once_per_sas(
    azurite: Any, container: str, origin: Proxy, engine: Engine, mount_az: Any, tmp_path: Path
) -> None:
    """A mount signed with the account key loads through the engine with one authorization
    check per blob SAS, not per slice; then the warm engine refuses a GET without a SAS, with
    a SAS without read permission and with a tampered one, and serves a valid one."""
    from azure.storage.blob import BlobSasPermissions, generate_blob_sas

    from objfs.backends.azure_auth import API_VERSION

    files = {"m/w.bin": os.urandom(20 * MiB + 3), "m/v.bin": os.urandom(9 * MiB)}
    put_blobs(azurite, container, files)
    origin.reset_stats()
    m = _node(mount_az, container, origin, engine, "a", tmp_path)
    assert load_at_once([m], {k[2:]: v for k, v in files.items()}) == []
    status = fresh_status(m.path)["cache_engine"]
    slices = [r for r in origin.stats.requests if "if-match" in r.headers]
    checks = _checks(origin)

    path = f"/{DEV_ACCOUNT}/{container}/m/w.bin"
    etag = next(r.headers["if-match"] for r in slices if r.target.startswith(path + "?"))
    headers = {"Range": f"bytes=0-{MiB - 1}", "If-Match": etag, "x-ms-version": API_VERSION}
    readable = remember(
        "a blob SAS for the cache engine",
        generate_blob_sas(
            DEV_ACCOUNT,
            container,
            "m/w.bin",
            account_key=DEV_KEY,
            permission=BlobSasPermissions(read=True),
            expiry=_dt.datetime.now(_dt.UTC) + _dt.timedelta(hours=1),
        ),
    )
    no_read = _container_sas(container, read=False)  # may list, not read
    assert _get(f"{origin.url}{path}?{no_read}", headers)[0] == 403  # the store refuses it
    tampered = readable.replace("sig=", "sig=0")
    origin.reset_stats()
    for query in ("", f"?{no_read}", f"?{tampered}"):
        code, body = _get(engine.url + path + query, headers)
        assert code == 403, (query.split("sig=")[0], code)
        assert files["m/w.bin"][:64] not in body
    code, body = _get(f"{engine.url}{path}?{readable}", headers)
    assert (code, sha256(body)) == (206, sha256(files["m/w.bin"][:MiB]))
    assert len(_checks(origin)) == 4  # each asked of the store
    assert all("if-match" not in r.headers for r in origin.stats.requests)  # no slice

    # The load: the store sent every 4 MiB slice once, and was asked once per SAS (objfs
    # signs one per blob) whether the caller may read it.
    assert len(slices) == 6 + 3
    assert sorted(checks) == sorted(f"/{DEV_ACCOUNT}/{container}/{k}" for k in files), checks
    assert status["bytes_via_engine"] == sum(len(d) for d in files.values())
    assert (status["failures"], status["refused"], status["urls_signed"]) == (0, 0, 2)
    _assert_no_signature(engine, [m], readable, no_read)


def test_a_mount_whose_sas_may_not_read_gets_eacces_from_a_warm_engine(
    azurite: Any, container: str, origin: Proxy, engine: Engine, mount_az: Any, tmp_path: Path
) -> None:
    """A mount whose SAS may list and not read (sent to the engine, as asked): reading a
    blob the engine holds gives EACCES (the engine passes the store's refusal on, objfs
    asks the store directly, which refuses too), without blaming the engine."""
    data = os.urandom(12 * MiB + 5)
    put_blobs(azurite, container, {"m/w.bin": data})
    a = _node(mount_az, container, origin, engine, "a", tmp_path)
    assert sha256((a.path / "w.bin").read_bytes()) == sha256(data)  # the engine is warm
    sas = _container_sas(container, read=False)
    env = {"AZURE_STORAGE_KEY": "", "AZURE_STORAGE_SAS_TOKEN": sas}
    b = _node(
        mount_az, container, origin, engine, "b", tmp_path, "--cache-proxy-send-sas-token", env=env
    )
    assert os.listdir(b.path) == ["w.bin"]
    for _ in range(2):
        with pytest.raises(PermissionError) as caught:
            (b.path / "w.bin").read_bytes()
        assert caught.value.errno == errno.EACCES
    status = fresh_status(b.path)["cache_engine"]
    assert status["bytes_via_engine"] == 0
    assert status["refused"] >= 1
    assert status["failures"] == 0  # the store's refusal, not the engine's fault
    log = b.log()
    assert "the store refused a GET through it" in log
    assert "reading from the store directly, trying" not in log
    _assert_no_signature(engine, [a, b], sas)
