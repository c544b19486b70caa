"""A moto S3 server that enforces IAM, for tests of credentials and permissions.

``iam_s3`` (a module-scoped fixture in ``tests/conftest.py``) starts one per test module;
:func:`enforce_auth` switches its checking on and off (set-up runs with it off), and
:func:`new_access_key` makes a user's key and registers its secret, so that the last test
(``tests/test_zz_no_secrets_in_logs.py``) looks for it in every log.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from objfs.demo import LocalServer
from tests.helpers.known_secrets import remember


def enforce_auth(server: LocalServer, on: bool) -> None:
    """Check every request's credentials from now on (``on``), or none."""
    request = urllib.request.Request(
        f"{server.url}/moto-api/reset-auth",
        data=b"0" if on else b"inf",  # requests allowed before credentials are checked
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert json.load(reply)["status"] == "ok"


def new_access_key(iam: Any, user: str) -> dict[str, str]:
    """A new access key of ``user`` (IAM's ``AccessKey``), its secret registered."""
    key: dict[str, str] = iam.create_access_key(UserName=user)["AccessKey"]
    remember(f"moto IAM secret of {user}", key["SecretAccessKey"])
    return key
