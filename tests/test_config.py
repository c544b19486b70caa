"""SOURCE, size and TTL parsing."""

from __future__ import annotations

import math

import pytest

import objfs.config
from objfs.config import (
    MountConfig,
    Source,
    parse_id,
    parse_size,
    parse_source,
    parse_ttl,
    redact_url,
)
from objfs.errors import SourceFormatError, UnknownSchemeError, UsageError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("s3://bucket", Source("s3", "bucket", "")),
        ("s3://bucket/", Source("s3", "bucket", "")),
        ("s3://bucket/models", Source("s3", "bucket", "models/")),
        ("s3://bucket/models/", Source("s3", "bucket", "models/")),
        ("S3://bucket/models/llama/", Source("s3", "bucket", "models/llama/")),
        ("s3://my.bucket-1/a b/ü", Source("s3", "my.bucket-1", "a b/ü/")),
    ],
)
def test_parse_source(text: str, expected: Source) -> None:
    assert parse_source(text) == expected


def test_prefix_with_and_without_slash_is_the_same_directory() -> None:
    assert parse_source("s3://b12/x/y") == parse_source("s3://b12/x/y/")


@pytest.mark.parametrize(
    "text", ["bucket", "s3:///x", "s3://ab", "s3://b/a//c", "s3://b/./c", "s3://u:p@bkt"]
)
def test_malformed_source(text: str) -> None:
    with pytest.raises(SourceFormatError):
        parse_source(text)


def test_unknown_scheme() -> None:
    with pytest.raises(UnknownSchemeError) as info:
        parse_source("gs://bucket")
    assert info.value.exit_code == 4


@pytest.mark.parametrize(
    ("text", "value"),
    [("512", 512), ("8M", 8 << 20), ("8MiB", 8 << 20), ("1.5G", 3 << 29), ("2t", 2 << 40)],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text, option="--x") == value


@pytest.mark.parametrize("text", ["", "M", "8X", "-1", "1e3", "eight"])
def test_bad_size(text: str) -> None:
    with pytest.raises(UsageError):
        parse_size(text, option="--x")


def test_parse_ttl() -> None:
    assert parse_ttl("0") == 0
    assert parse_ttl("1.5") == 1.5
    assert parse_ttl("indefinite") == math.inf
    for bad in ("-1", "nan", "inf5", "soon"):
        with pytest.raises(UsageError):
            parse_ttl(bad)


def test_parse_id() -> None:
    assert parse_id("0", option="--uid") == 0
    for bad in ("-1", "root", str(2**32)):
        with pytest.raises(UsageError):
            parse_id(bad, option="--uid")


def test_redact_url_drops_user_info_and_query() -> None:
    assert redact_url("https://user:secret@host:9000/path?X-Amz-Signature=abc") == (
        "https://host:9000/path"
    )


def test_the_default_budget_keeps_sixteen_parts_of_read_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default budget is 240 MiB (peak RSS: budget + ~52 MiB, under 300 MiB), and its
    read-ahead share is still the 128 MiB the 256 MiB default had: 16 parts of 8 MiB in flight.
    Other budgets: half for read-ahead, but never less than what exceeds 112 MiB, up to 128."""
    monkeypatch.setattr(objfs.config, "available_memory_bytes", lambda: 64 << 30)
    budget = objfs.config.default_memory_limit()
    assert budget == 240 << 20
    config = MountConfig(
        mountpoint="/mnt", source=parse_source("s3://bucket"), memory_limit_bytes=budget
    )
    assert config.readahead_max() == 128 << 20
    assert config.readahead_max() // config.part_size_bytes == 16
    for budget_mib, window_mib in [(256, 128), (512, 256), (200, 100), (64, 32), (1024, 512)]:
        sized = MountConfig(
            mountpoint="/mnt",
            source=parse_source("s3://bucket"),
            memory_limit_bytes=budget_mib << 20,
        )
        assert sized.readahead_max() == window_mib << 20, budget_mib
    # A small machine: a quarter of its memory, read-ahead half of that.
    monkeypatch.setattr(objfs.config, "available_memory_bytes", lambda: 512 << 20)
    assert objfs.config.default_memory_limit() == 128 << 20
