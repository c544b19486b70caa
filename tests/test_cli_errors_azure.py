"""Every Azure error a user will hit: one line on stderr, the documented exit code, no secret,
nothing mounted. Commands run as a user types them (daemon mode)."""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any

import pytest

from objfs.demo import free_port
from tests.azurite import DEV_ACCOUNT, DEV_KEY
from tests.test_cli_errors import SECRET, assert_one_line_error, objfs

# A well-formed account key that is not the emulator's.
WRONG_KEY = "V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3Jvbmc="


def env_with(**values: str) -> dict[str, str]:
    """This process's environment (no AZURE_*, identity off) plus ``values``."""
    return {**os.environ, **values}


def az(azurite: Any, source: str, mnt: Path, *options: str, **env: str) -> Any:
    args = ["mount", source, str(mnt), "--account-url", azurite.account_url, *options]
    return objfs(*args, env=env_with(**env))


@pytest.mark.parametrize(
    ("source", "code", "words"),
    [
        ("az:///models", 3, ["no container name", "az://CONTAINER/PREFIX"]),
        ("az://Models/llama", 3, ["'Models' is not a valid container name", "lowercase"]),
        ("az://ab", 3, ["not a valid container name", "3-63"]),
        ("az://bad--name", 3, ["not a valid container name"]),
        ("az://models/a//b", 3, ["empty, '.' or '..'"]),
        ("azure:///models", 3, ["'' is not a valid storage account name"]),
        ("azure://Account/models", 3, ["'Account' is not a valid storage account name"]),
        ("azure://acct//models", 3, ["no container name"]),
        ("https://example.com/models/x", 3, ["Azure blob URL", "s3://"]),
        ("https://acct.blob.core.windows.net//models", 3, ["no container name"]),
        ("abfs://models", 4, ["unknown scheme 'abfs'", "az://"]),
    ],
)
def test_bad_azure_source(mnt: Path, source: str, code: int, words: list[str]) -> None:
    assert_one_line_error(objfs("mount", source, str(mnt)), code, *words)


@pytest.mark.parametrize(
    "source",
    [
        f"https://acct.blob.core.windows.net/models/llama?sv=2022-11-02&sp=rl&sig={SECRET}",
        f"az://models/llama?sig={SECRET}",
        f"azure://acct:{SECRET}@models/llama",
    ],
)
def test_credentials_in_source_are_refused_and_not_echoed(mnt: Path, source: str) -> None:
    res = objfs("mount", source, str(mnt))
    assert_one_line_error(res, 3)
    assert "query string" in res.stderr or "credentials" in res.stderr
    assert SECRET not in res.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["az://models/m", "--endpoint-url", "http://127.0.0.1:1"], ["--endpoint-url is an S3"]),
        (["az://models/m", "--region", "eu-west-1"], ["--region is an S3 option"]),
        (["s3://bucket/m", "--account-url", "http://127.0.0.1:1"], ["--account-url is an Azure"]),
        (["az://models/m", "--account-name", "Not_An_Account"], ["--account-name", "3-24"]),
        (["az://models/m"], ["needs a storage account", "--account-name"]),
    ],
)
def test_bad_azure_options(mnt: Path, args: list[str], words: list[str]) -> None:
    source, *options = args
    assert_one_line_error(objfs("mount", source, str(mnt), *options), 2, *words)


def test_container_not_found(azurite: Any, mnt: Path) -> None:
    res = az(azurite, "az://no-such-container/m", mnt, AZURE_STORAGE_KEY=DEV_KEY)
    assert_one_line_error(
        res, 5, "container 'no-such-container' does not exist", "--account-url", azurite.url
    )


def test_wrong_account_key_is_access_denied(azurite: Any, container: str, mnt: Path) -> None:
    res = az(azurite, f"az://{container}/m", mnt, AZURE_STORAGE_KEY=WRONG_KEY)
    assert_one_line_error(res, 6, "AuthorizationFailure", "check the credentials")
    assert WRONG_KEY not in res.stderr


def test_connection_string_takes_precedence_over_the_key(
    azurite: Any, container: str, mnt: Path
) -> None:
    res = az(
        azurite,
        f"az://{container}/m",
        mnt,
        AZURE_STORAGE_CONNECTION_STRING=azurite.connection_string(key=WRONG_KEY),
        AZURE_STORAGE_KEY=DEV_KEY,
    )
    assert_one_line_error(res, 6, "check the credentials")
    assert WRONG_KEY not in res.stderr
    assert DEV_KEY not in res.stderr


def _container_sas(container: str, **permissions: bool) -> str:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    return generate_container_sas(
        DEV_ACCOUNT,
        container,
        account_key=DEV_KEY,
        permission=ContainerSasPermissions(**permissions),
        expiry=_dt.datetime.now(_dt.UTC) + _dt.timedelta(hours=1),
    )


def test_sas_without_list_permission_is_access_denied(
    azurite: Any, container: str, mnt: Path, tmp_path: Path
) -> None:
    sas = _container_sas(container, read=True)  # read, but no list
    signature = dict(part.split("=", 1) for part in sas.split("&"))["sig"]
    token_file = tmp_path / "sas.txt"
    token_file.write_text(sas)
    res = az(azurite, f"az://{container}/m", mnt, "--sas-token-file", str(token_file))
    assert_one_line_error(res, 6)
    assert "Authorization" in res.stderr
    assert signature not in res.stderr


def test_sas_from_the_environment_is_used(azurite: Any, container: str, mnt: Path) -> None:
    sas = _container_sas(container, read=True)  # proves the SAS (not the dev key) was sent
    res = az(azurite, f"az://{container}/m", mnt, AZURE_STORAGE_SAS_TOKEN=sas)
    assert_one_line_error(res, 6)
    assert sas not in res.stderr


def test_no_credentials_and_a_private_container(azurite: Any, container: str, mnt: Path) -> None:
    res = az(azurite, f"az://{container}/m", mnt, "--account-name", DEV_ACCOUNT)
    assert_one_line_error(res, 7, "no Azure credentials found", "AZURE_STORAGE_KEY")


def test_no_sign_request_on_a_private_container(azurite: Any, container: str, mnt: Path) -> None:
    res = az(
        azurite,
        f"az://{container}/m",
        mnt,
        "--no-sign-request",
        AZURE_STORAGE_KEY=DEV_KEY,  # ignored: no credential is looked up
    )
    assert_one_line_error(res, 6, "anonymous access refused", "--no-sign-request")


def test_endpoint_unreachable(mnt: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}/{DEV_ACCOUNT}"
    res = objfs(
        "mount",
        "az://models/m",
        str(mnt),
        "--account-url",
        closed,
        env=env_with(AZURE_STORAGE_KEY=DEV_KEY),
    )
    assert_one_line_error(res, 8, "cannot reach", "--account-url")


@pytest.mark.parametrize(
    ("env", "words"),
    [
        (
            {"AZURE_STORAGE_KEY": f"not base64 {SECRET}"},
            ["AZURE_STORAGE_KEY is not an account key"],
        ),
        (
            {"AZURE_STORAGE_CONNECTION_STRING": f"AccountKey{SECRET}"},
            ["AZURE_STORAGE_CONNECTION_STRING is malformed"],
        ),
        ({"AZURE_STORAGE_SAS_TOKEN": f"sv=1&{SECRET}"}, ["does not hold a SAS token"]),
        (
            {"AZURE_STORAGE_CONNECTION_STRING": f"UseDevelopmentStorage=true;x={SECRET}"},
            ["UseDevelopmentStorage is not supported"],
        ),
    ],
)
def test_malformed_credentials(
    azurite: Any, mnt: Path, env: dict[str, str], words: list[str]
) -> None:
    res = az(azurite, "az://models/m", mnt, "--account-name", DEV_ACCOUNT, **env)
    assert_one_line_error(res, 2, *words)
    assert SECRET not in res.stderr


def test_missing_sas_token_file(azurite: Any, mnt: Path, tmp_path: Path) -> None:
    res = az(azurite, "az://models/m", mnt, "--sas-token-file", str(tmp_path / "nope.txt"))
    assert_one_line_error(res, 2, "--sas-token-file", "cannot read")


def test_help_has_an_azure_group() -> None:
    res = objfs("mount", "--help")
    assert res.returncode == 0
    for text in ("Azure:", "--account-name", "--account-url", "--sas-token-file", "az://"):
        assert text in res.stdout


def test_unknown_account(azurite: Any, mnt: Path) -> None:
    """Azurite answers ResourceNotFound for an account it does not have (Azure itself: the
    name does not resolve, which is the 'cannot reach' case above)."""
    res = objfs(
        "mount",
        "az://models/m",
        str(mnt),
        "--account-url",
        f"{azurite.url}/otheraccount",
        env=env_with(AZURE_STORAGE_KEY=DEV_KEY),
    )
    assert_one_line_error(res, 8, "storage account 'otheraccount' not found", "--account-name")
