"""Azure SDK exceptions and data-GET replies as objfs errors, built from codes only.

Contract: :func:`map_error` (an SDK exception) and :func:`map_status` (a service error code and
HTTP status) return the ObjfsError a failed request means. Its text is made of the error code,
the status, the request's description and the redacted account URL, never of the SDK's
exception text (which can hold request URLs with SAS signatures). :func:`is_refusal` names the
failures that fresher credentials may cure.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
)

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

# Service error codes (https://learn.microsoft.com/rest/api/storageservices/blob-service-error-codes).
AUTHENTICATION_CODES = {"AuthenticationFailed", "InvalidAuthenticationInfo"}
# Refusals that fresher credentials may cure: re-read the credential files and try once more.
AUTH_RETRY_STATUSES = {401, 403}
_ANONYMOUS_REFUSED_CODES = {
    "NoAuthenticationInformation",
    "PublicAccessNotPermitted",
    "ResourceNotFound",
    "AuthorizationFailure",
}


@dataclass(frozen=True)
class ErrorContext:
    """What one backend's errors name: its container, its account and the account URL
    (``where``, redacted), and whether its requests are anonymous (``implicit_anonymous``:
    because no credentials were found, not because of --no-sign-request)."""

    container: str
    account_name: str | None
    where: str
    anonymous: bool
    implicit_anonymous: bool


def error_code(exc: HttpResponseError) -> str:
    """The service's error code of ``exc``, or ""."""
    code = getattr(exc, "error_code", None)
    if isinstance(code, enum.Enum):
        code = code.value
    return str(code or "")


def is_refusal(exc: Exception) -> bool:
    """An SDK error that fresher credentials may cure."""
    return isinstance(exc, HttpResponseError) and int(exc.status_code or 0) in AUTH_RETRY_STATUSES


def map_error(exc: Exception, what: str, ctx: ErrorContext) -> ObjfsError:
    """Turn an SDK exception into an objfs error built from codes only (never its text)."""
    if isinstance(exc, ObjfsError):
        return exc
    where = ctx.where
    if isinstance(exc, ClientAuthenticationError) and exc.response is None:
        # Raised by a token credential (DefaultAzureCredential), not by the service.
        return NoCredentialsError(
            "no Azure credentials found (DefaultAzureCredential: no managed identity, "
            "workload identity or az login): set AZURE_STORAGE_CONNECTION_STRING, "
            "AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, or use --no-sign-request for a "
            "public container"
        )
    if isinstance(exc, ServiceRequestError):
        return EndpointUnreachableError(
            f"cannot reach {where} ({type(exc).__name__}): check the account name "
            "(--account-name, AZURE_STORAGE_ACCOUNT), --account-url and the network"
        )
    if isinstance(exc, ServiceResponseError):
        return TransientStoreError(f"{what}: connection failed ({type(exc).__name__})")
    if isinstance(exc, HttpResponseError):
        return map_status(error_code(exc), int(exc.status_code or 0), what, ctx)
    if isinstance(exc, AzureError):
        return TransientStoreError(f"{what}: {type(exc).__name__}")
    return TransientStoreError(f"{what}: unexpected {type(exc).__name__}")


def map_status(code: str, status: int, what: str, ctx: ErrorContext) -> ObjfsError:
    """The error a service reply of ``status`` with error ``code`` means."""
    where = ctx.where
    label = code or str(status)
    if code == "ContainerNotFound":
        return BucketNotFoundError(
            f"container {ctx.container!r} does not exist at {where}: check the container "
            "name, the account (--account-name) and --account-url"
        )
    if code == "ConditionNotMet" or status == 412:
        return StaleObjectError(f"{what}: the blob changed while it was open")
    if code == "BlobNotFound":
        return ObjectNotFoundError(f"{what}: not found")
    if ctx.anonymous and (code in _ANONYMOUS_REFUSED_CODES or status in (401, 403)):
        if ctx.implicit_anonymous:
            return NoCredentialsError(
                f"no Azure credentials found and {where} refused anonymous access ({label})"
                ": set AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY or "
                "AZURE_STORAGE_SAS_TOKEN (or install objfs[azure] for managed identity)"
            )
        return AccessDeniedError(
            f"anonymous access refused: {what} ({label}): the container is not public; "
            "drop --no-sign-request and give credentials"
        )
    if code in AUTHENTICATION_CODES or status == 401:
        return AccessDeniedError(
            f"{where} rejected the credentials ({label}): check the account key, SAS token "
            "or connection string (and that the SAS has not expired)"
        )
    if code == "AuthorizationFailure":
        return AccessDeniedError(
            f"{where} refused the request ({label}): check the credentials (key, SAS, "
            "connection string) and that they may list and read the container"
        )
    if code.startswith("Authorization") or status == 403:
        return AccessDeniedError(
            f"access denied: {what} ({label}): grant read and list on the container (SAS "
            "permissions r and l, or the Storage Blob Data Reader role)"
        )
    if code == "ResourceNotFound":
        return EndpointUnreachableError(
            f"storage account {ctx.account_name!r} not found at {where}: check "
            "--account-name and --account-url"
        )
    if status == 404:
        return ObjectNotFoundError(f"{what}: not found")
    return TransientStoreError(f"{what}: store error {label}")
