"""Azure SOURCE parsing and credential precedence: pure units, nothing is contacted.

``https://ACCOUNT.blob.core.windows.net`` URLs are only parsed here, never requested.
"""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential

from objfs.backends.azure import _is_folder
from objfs.backends.azure_auth import NO_IDENTITY_ENV, resolve_credentials
from objfs.config import AzureOptions, Source, parse_source
from objfs.errors import SourceFormatError, UsageError

KEY = "a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2U="
SAS = "sv=2022-11-02&sr=c&sp=rl&se=2030-01-01&sig=c2lnbmF0dXJl"


@pytest.mark.parametrize(
    ("text", "expected", "url"),
    [
        ("az://models", Source("az", "models", ""), "az://models/"),
        ("az://models/llama", Source("az", "models", "llama/"), "az://models/llama/"),
        ("az://models/llama/", Source("az", "models", "llama/"), "az://models/llama/"),
        ("AZ://models//", Source("az", "models", ""), "az://models/"),
        ("az://$root/x", Source("az", "$root", "x/"), "az://$root/x/"),
        (
            "azure://acct1/models/a/b",
            Source("azure", "models", "a/b/", account="acct1"),
            "azure://acct1/models/a/b/",
        ),
        (
            "https://acct1.blob.core.windows.net/models/my%20model/",
            Source(
                "https",
                "models",
                "my model/",
                account="acct1",
                account_url="https://acct1.blob.core.windows.net",
            ),
            "https://acct1.blob.core.windows.net/models/my model/",
        ),
        (
            "https://Acct1.privatelink.blob.core.chinacloudapi.cn/c-1",
            Source(
                "https",
                "c-1",
                "",
                account="acct1",
                account_url="https://acct1.privatelink.blob.core.chinacloudapi.cn",
            ),
            "https://acct1.privatelink.blob.core.chinacloudapi.cn/c-1/",
        ),
    ],
)
def test_azure_sources(text: str, expected: Source, url: str) -> None:
    source = parse_source(text)
    assert source == expected
    assert source.store == "azure"
    assert source.url() == url


def test_s3_sources_are_unchanged() -> None:
    source = parse_source("s3://bucket/models/llama")
    assert source == Source("s3", "bucket", "models/llama/")
    assert (source.account, source.account_url, source.store) == (None, None, "s3")
    assert source.url() == "s3://bucket/models/llama/"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("az://-models", "not a valid container name"),
        ("az://models-", "not a valid container name"),
        ("az://" + "a" * 64, "not a valid container name"),
        ("az://models/./x", "empty, '.' or '..'"),
        ("azure://a/models", "not a valid storage account name"),
        ("azure://" + "a" * 25 + "/models", "not a valid storage account name"),
        ("https://acct.dfs.core.windows.net/models", "Azure blob URL"),
        ("https://acct.blob.core.windows.net:443/models", "must not contain credentials"),
        ("az://models/x#y?z", "query string"),
    ],
)
def test_bad_azure_sources(text: str, words: str) -> None:
    with pytest.raises(SourceFormatError, match=words.replace(".", r"\.").replace("'", "'")):
        parse_source(text)


# -- credentials ------------------------------------------------------------------------------


@pytest.fixture
def identity(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """A stand-in azure.identity: records every DefaultAzureCredential constructed."""
    made: list[object] = []

    class DefaultAzureCredential:
        def __init__(self) -> None:
            made.append(self)

    module = types.ModuleType("azure.identity")
    module.DefaultAzureCredential = DefaultAzureCredential  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "azure.identity", module)
    return made


AZ = parse_source("az://models/llama")
OPTS = AzureOptions(account_name="acct1")


def test_connection_string_comes_first(identity: list[object]) -> None:
    env = {
        "AZURE_STORAGE_CONNECTION_STRING": (
            f"DefaultEndpointsProtocol=https;AccountName=acct1;AccountKey={KEY};"
            "EndpointSuffix=core.chinacloudapi.cn"
        ),
        "AZURE_STORAGE_KEY": KEY,
        "AZURE_STORAGE_SAS_TOKEN": SAS,
    }
    creds = resolve_credentials(AZ, AzureOptions(), env)
    assert creds.kind == "AZURE_STORAGE_CONNECTION_STRING"
    assert isinstance(creds.credential, AzureNamedKeyCredential)
    assert creds.credential.named_key == ("acct1", KEY)
    assert creds.account_url == "https://acct1.blob.core.chinacloudapi.cn"
    assert identity == []


def test_connection_string_with_a_sas_and_an_endpoint() -> None:
    env = {
        "AZURE_STORAGE_CONNECTION_STRING": (
            f"BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;SharedAccessSignature=?{SAS}"
        )
    }
    creds = resolve_credentials(AZ, AzureOptions(), env)
    assert isinstance(creds.credential, AzureSasCredential)
    assert creds.credential.signature == SAS
    assert creds.account_url == "http://127.0.0.1:10000/devstoreaccount1"
    assert creds.account_name == "devstoreaccount1"


def test_account_key_comes_before_a_sas(identity: list[object], tmp_path: Path) -> None:
    token = tmp_path / "sas"
    token.write_text(SAS)
    env = {"AZURE_STORAGE_KEY": KEY, "AZURE_STORAGE_SAS_TOKEN": SAS}
    options = AzureOptions(account_name="acct1", sas_token_file=str(token))
    creds = resolve_credentials(AZ, options, env)
    assert creds.kind == "AZURE_STORAGE_KEY"
    assert creds.credential.named_key == ("acct1", KEY)
    assert creds.account_url == "https://acct1.blob.core.windows.net"
    assert identity == []


def test_sas_file_comes_before_the_sas_variable(tmp_path: Path) -> None:
    token = tmp_path / "sas"
    token.write_text("?" + SAS + "\n")
    env = {"AZURE_STORAGE_SAS_TOKEN": "sv=other&sig=other"}
    options = AzureOptions(account_name="acct1", sas_token_file=str(token))
    creds = resolve_credentials(AZ, options, env)
    assert (creds.kind, creds.credential.signature) == ("--sas-token-file", SAS)
    creds = resolve_credentials(AZ, OPTS, env)
    assert (creds.kind, creds.credential.signature) == (
        "AZURE_STORAGE_SAS_TOKEN",
        "sv=other&sig=other",
    )


def test_an_ignored_sas_file_is_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = tmp_path / "sas"
    token.write_text(SAS)
    options = AzureOptions(account_name="acct1", sas_token_file=str(token))
    with caplog.at_level(logging.WARNING, logger="objfs"):
        creds = resolve_credentials(AZ, options, {"AZURE_STORAGE_KEY": KEY})
    assert creds.kind == "AZURE_STORAGE_KEY"
    assert "--sas-token-file is ignored: AZURE_STORAGE_KEY takes precedence" in caplog.text
    assert SAS not in caplog.text


def test_default_azure_credential_then_anonymous(identity: list[object]) -> None:
    creds = resolve_credentials(AZ, OPTS, {})
    assert creds.kind == "DefaultAzureCredential"
    assert identity == [creds.credential]
    creds = resolve_credentials(AZ, OPTS, {NO_IDENTITY_ENV: "1"})
    assert (creds.kind, creds.credential) == ("anonymous (no credentials found)", None)
    assert len(identity) == 1  # not constructed when switched off


def test_no_identity_without_azure_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "azure.identity", None)  # import fails
    creds = resolve_credentials(AZ, OPTS, {})
    assert (creds.kind, creds.credential) == ("anonymous (no credentials found)", None)


def test_no_sign_request_looks_nothing_up(identity: list[object]) -> None:
    env = {"AZURE_STORAGE_CONNECTION_STRING": "malformed", "AZURE_STORAGE_KEY": KEY}
    options = AzureOptions(account_name="acct1", no_sign_request=True)
    creds = resolve_credentials(AZ, options, env)
    assert (creds.kind, creds.credential) == ("anonymous (--no-sign-request)", None)
    assert identity == []


def test_the_tests_never_reach_default_azure_credential() -> None:
    """conftest switches identity off for this process and every objfs it starts."""
    import os

    assert os.environ.get(NO_IDENTITY_ENV)
    assert not [name for name in os.environ if name.startswith("AZURE_")]


def test_account_url_sources_in_order() -> None:
    https = parse_source("https://acct1.blob.core.usgovcloudapi.net/models")
    assert resolve_credentials(https, AzureOptions(), {}).account_url == (
        "https://acct1.blob.core.usgovcloudapi.net"
    )
    custom = AzureOptions(account_url="http://127.0.0.1:10000/devstoreaccount1/")
    creds = resolve_credentials(AZ, custom, {"AZURE_STORAGE_KEY": KEY})
    assert creds.account_url == "http://127.0.0.1:10000/devstoreaccount1"
    assert creds.credential.named_key == ("devstoreaccount1", KEY)  # account from the path
    env_account = resolve_credentials(AZ, AzureOptions(), {"AZURE_STORAGE_ACCOUNT": "acct2"})
    assert env_account.account_url == "https://acct2.blob.core.windows.net"


@pytest.mark.parametrize(
    ("source", "options", "env", "words"),
    [
        (AZ, AzureOptions(), {}, "needs a storage account"),
        (
            parse_source("azure://acct1/models"),
            AzureOptions(account_name="acct2"),
            {},
            "SOURCE names account 'acct1' but --account-name says 'acct2'",
        ),
        (AZ, AzureOptions(account_url=f"https://h/?sig={SAS}"), {}, "--account-url must not"),
        (AZ, AzureOptions(account_url="ftp://h"), {}, "--account-url is not a URL"),
        (AZ, OPTS, {"AZURE_STORAGE_CONNECTION_STRING": "AccountName=acct1"}, "neither"),
        (
            parse_source("azure://acct1/models"),
            AzureOptions(),
            {"AZURE_STORAGE_CONNECTION_STRING": f"AccountName=acct2;AccountKey={KEY}"},
            "is for account 'acct2' but SOURCE names 'acct1'",
        ),
        (AZ, AzureOptions(account_url="http://127.0.0.1:1"), {"AZURE_STORAGE_KEY": KEY}, "needs"),
    ],
)
def test_contradictory_or_incomplete_settings(
    source: Source, options: AzureOptions, env: dict[str, str], words: str
) -> None:
    with pytest.raises(UsageError) as info:
        resolve_credentials(source, options, env)
    assert words in str(info.value)
    assert SAS not in str(info.value)
    assert KEY not in str(info.value)


def test_folder_metadata_is_case_insensitive() -> None:
    assert _is_folder({"hdi_isfolder": "true"})
    assert _is_folder({"Hdi_IsFolder": "TRUE"})
    assert not _is_folder({"hdi_isfolder": "false"})
    assert not _is_folder({})
    assert not _is_folder(None)
