"""botocore exceptions and data-GET replies as objfs errors.

Contract: :func:`map_error` turns any exception of a request (botocore's, or a data GET's
reply made into botocore's shape by :func:`reply_error`) into the ObjfsError it means, one
table for every request; :func:`is_refusal` names the refusals that fresher credentials may
cure. The exception groups name which failures the data path's own loop retries.
"""

from __future__ import annotations

import re
from typing import Any

import botocore.exceptions

from objfs.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    EndpointUnreachableError,
    NoCredentialsError,
    ObjectNotFoundError,
    ObjfsError,
    StaleObjectError,
    TransientStoreError,
)

_ACCESS_CODES = {"AccessDenied", "AllAccessDisabled", "AccountProblem", "403", "Forbidden"}
CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
}
# Refusals that fresher credentials may cure: re-read the credential files and try once more.
_AUTH_RETRY_CODES = CREDENTIAL_CODES | _ACCESS_CODES
_AUTH_RETRY_STATUSES = {401, 403}
_NETWORK_ERRORS = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.SSLError,
    botocore.exceptions.ProxyConnectionError,
)
# Connection failures of the SDK's path that the data path's own loop retries (TLS errors are
# not: they do not go away by themselves).
CONNECTION_ERRORS = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ProxyConnectionError,
)
_CREDENTIAL_ERRORS = (
    botocore.exceptions.NoCredentialsError,
    botocore.exceptions.PartialCredentialsError,
)
BODY_ERRORS = (
    botocore.exceptions.IncompleteReadError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.ConnectionClosedError,
)


def map_error(exc: Exception, what: str, bucket: str, description: str) -> ObjfsError:
    """Turn a botocore exception into an objfs error; ``what`` names the request, ``bucket``
    and ``description`` (``s3://BUCKET at ENDPOINT``) the backend."""
    if isinstance(exc, ObjfsError):
        return exc
    if isinstance(
        exc,
        botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError,
    ):
        return NoCredentialsError(
            "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "pass --profile, or use --no-sign-request for a public bucket"
        )
    if isinstance(exc, _NETWORK_ERRORS):
        return EndpointUnreachableError(
            f"cannot reach {description} ({type(exc).__name__}): check --endpoint-url, "
            "the network and, for TLS, --ca-bundle"
        )
    if isinstance(exc, BODY_ERRORS):
        return TransientStoreError(f"{what}: connection failed ({type(exc).__name__})")
    if isinstance(exc, botocore.exceptions.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
        if code == "NoSuchBucket":
            return BucketNotFoundError(
                f"bucket {bucket!r} does not exist at {description.split(' at ')[1]}"
                ": check the bucket name, --endpoint-url and --region"
            )
        if code in CREDENTIAL_CODES:
            return AccessDeniedError(
                f"{description} rejected the credentials ({code}): check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the profile"
            )
        if code in _ACCESS_CODES or status == 403:
            return AccessDeniedError(
                f"access denied: {what} ({code or status}): grant s3:ListBucket and "
                "s3:GetObject on the bucket and prefix to these credentials"
            )
        if code in ("PermanentRedirect", "AuthorizationHeaderMalformed", "301"):
            return EndpointUnreachableError(
                f"bucket {bucket!r} is in another region ({code}): pass --region"
            )
        if code in ("NoSuchKey", "404", "NotFound"):
            return ObjectNotFoundError(f"{what}: not found")
        if code in ("PreconditionFailed", "412"):
            return StaleObjectError(f"{what}: the object changed while it was open")
        return TransientStoreError(f"{what}: store error {code or status}")
    if isinstance(exc, botocore.exceptions.BotoCoreError):
        return TransientStoreError(f"{what}: {type(exc).__name__}")
    return TransientStoreError(f"{what}: unexpected {type(exc).__name__}")


def is_refusal(exc: Exception) -> bool:
    """A refusal that fresher credentials may cure."""
    if not isinstance(exc, botocore.exceptions.ClientError):
        return False
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
    return code in _AUTH_RETRY_CODES or status in _AUTH_RETRY_STATUSES


def reply_error(status: int, body: bytes, operation: str) -> botocore.exceptions.ClientError:
    """A data GET's error reply (``status``, the error document ``body``) as the SDK's
    ClientError, so that one table (:func:`map_error`) maps every request's errors."""
    code = error_code(body) or str(status)
    response: Any = {
        "Error": {"Code": code, "Message": ""},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return botocore.exceptions.ClientError(response, operation)


def client_error_code(exc: BaseException | None) -> str:
    """The error code of a botocore ClientError, else ""."""
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def error_code(body: bytes) -> str:
    """The ``<Code>`` of an S3 error document, or ""."""
    match = re.search(rb"<Code>([^<]{1,100})</Code>", body)
    return match.group(1).decode("ascii", "replace") if match else ""
