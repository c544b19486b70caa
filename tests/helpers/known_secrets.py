"""The credentials the test session hands to objfs, for the checks that none of them leaks.

The fixed ones (the AWS test key of ``tests/conftest.py``, Azurite's published dev key) are
always listed; a test that makes up another one (a SAS token, a session token) registers it
with :func:`remember`, so that ``tests/test_zz_no_secrets_in_logs.py``, which runs last, also
looks for it in every log the session wrote.
"""

from __future__ import annotations

_REMEMBERED: dict[str, str] = {}


def remember(label: str, value: str) -> str:
    """Register ``value`` (described by ``label``, never printed) and return it."""
    _REMEMBERED[value] = label
    return value


def known_secrets() -> dict[str, str]:
    """Every secret of this session: {value: label}."""
    from tests.azurite import DEV_KEY
    from tests.conftest import TEST_ENV

    found = {
        TEST_ENV["AWS_SECRET_ACCESS_KEY"]: "TEST_ENV's AWS_SECRET_ACCESS_KEY",
        DEV_KEY: "Azurite's dev account key",
    }
    found.update(_REMEMBERED)
    return found
