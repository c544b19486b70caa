"""botocore's session, clients and credentials for the S3 backend.

Contract: :func:`new_session` makes one backend's botocore session (botocore directly, not
boto3; data files loaded without their documentation texts; ``--profile`` checked at once) and,
when credentials may rotate, makes keys taken from the environment reloadable
(:class:`ReloadableResolver`: each request is signed with one consistent set of keys, replaced
by :meth:`ReloadableResolver.prepare`). :func:`make_client` makes a client of that session: its
retries (botocore's "standard" mode), timeouts, pool size (``max_connections`` plus two) and
addressing (a path-style client of the same session presigns the cache engine's URLs);
:func:`ca_bundle` chooses, once, the CA file every request of a backend trusts.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import botocore.credentials
import botocore.exceptions
import botocore.httpsession
import botocore.loaders
import botocore.session
from botocore import UNSIGNED
from botocore.config import Config

from objfs.config import S3Options, redact_url
from objfs.errors import NoCredentialsError, UsageError

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client


class _ReloadableCredentials:
    """Credentials (botocore's interface) whose source can be replaced while clients use
    them. botocore signs each request with one ``get_frozen_credentials()`` call, so a request
    is never signed with half of the old keys and half of the new ones."""

    def __init__(self, inner: botocore.credentials.Credentials) -> None:
        self._inner = inner
        self.method = inner.method

    def replace(self, inner: botocore.credentials.Credentials) -> None:
        self._inner = inner  # one reference swap: atomic for the signing threads

    def get_frozen_credentials(self) -> botocore.credentials.ReadOnlyCredentials:
        return self._inner.get_frozen_credentials()

    def get_deferred_property(self, name: str) -> Callable[[], Any]:
        return lambda: getattr(self.get_frozen_credentials(), name, None)

    @property
    def access_key(self) -> str | None:
        return self.get_frozen_credentials().access_key

    @property
    def secret_key(self) -> str | None:
        return self.get_frozen_credentials().secret_key

    @property
    def token(self) -> str | None:
        return self.get_frozen_credentials().token

    @property
    def account_id(self) -> str | None:
        return self.get_frozen_credentials().account_id


class ReloadableResolver:
    """botocore's credential resolver, with credentials from the environment made
    reloadable (the others, profiles and roles, refresh themselves or are left alone)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.credentials: _ReloadableCredentials | None = None

    def load_credentials(self) -> Any:
        found: botocore.credentials.Credentials | None = self._inner.load_credentials()
        if found is not None and found.method == "env":
            self.credentials = _ReloadableCredentials(found)
            return self.credentials
        return found

    def prepare(self, environ: Mapping[str, str]) -> Callable[[], None]:
        """(CredentialWatch) Keys from ``environ`` (the credentials file's values), to be put
        in use by the returned function; raises NoCredentialsError if they are incomplete."""
        current = self.credentials
        if current is None:
            return lambda: None  # not signed with keys from the environment: nothing to swap
        try:
            found = botocore.credentials.EnvProvider(environ=environ).load()
        except botocore.exceptions.PartialCredentialsError as exc:
            raise NoCredentialsError(
                f"--credentials-file: {exc.kwargs.get('cred_var', 'a variable')} is missing"
            ) from None
        if found is None:
            raise NoCredentialsError(
                "--credentials-file holds no AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            )
        return lambda: current.replace(found)


def new_session(
    options: S3Options, reloadable: bool
) -> tuple[botocore.session.Session, ReloadableResolver | None]:
    """botocore's session for one backend, and the resolver that makes its keys from the
    environment reloadable when ``reloadable`` (credentials may rotate) and requests are
    signed with them (None otherwise). Raises NoCredentialsError for an unknown --profile."""
    # botocore's session directly: boto3 adds nothing objfs uses (resources, transfers)
    # and 3 MiB to the daemon's memory.
    core = botocore.session.Session()
    _use_lean_models(core)
    resolver: ReloadableResolver | None = None
    if reloadable and not options.no_sign_request and not options.profile:
        # (With --profile, botocore skips the environment: nothing here to reload.)
        resolver = ReloadableResolver(core.get_component("credential_provider"))
        core.register_component("credential_provider", resolver)
    try:
        if options.profile is not None:
            core.set_config_variable("profile", options.profile)
        core.get_scoped_config()  # raises ProfileNotFound now rather than at the first call
    except botocore.exceptions.ProfileNotFound:
        raise NoCredentialsError(
            f"AWS profile {options.profile!r} not found: check --profile and "
            "~/.aws/config (or AWS_CONFIG_FILE)"
        ) from None
    return core, resolver


def ca_bundle(options: S3Options, session: botocore.session.Session) -> str:
    """The CA certificates file that every request of a backend trusts, chosen once as
    botocore chooses for its clients: --ca-bundle, else the session's ``ca_bundle``
    ($AWS_CA_BUNDLE, else the profile's ``ca_bundle`` in the config file), else botocore's
    own bundle (certifi's; not the system store, which rawhttp would use by default). Raises
    UsageError if the file chosen is not there."""
    if options.ca_bundle is not None:
        return options.ca_bundle  # checked by S3Backend
    configured = session.get_config_variable("ca_bundle")
    if not configured:
        return str(botocore.httpsession.get_cert_path(True))
    if not os.path.isfile(configured):
        where = "AWS_CA_BUNDLE" if os.environ.get("AWS_CA_BUNDLE") else "the profile's ca_bundle"
        raise UsageError(
            f"{where}: {configured!r} is not a file: give the PEM file of the CA that signed "
            "the endpoint's certificate (or --ca-bundle)"
        )
    return str(configured)


def make_client(
    session: botocore.session.Session,
    options: S3Options,
    endpoint: str | None,
    attempts: int,
    ca_file: str,
    region: str | None = None,
    *,
    path_style: bool | None = None,
) -> S3Client:
    """A client of ``session`` for ``endpoint`` (None: AWS) and ``region`` (None: --region,
    else the session's, else us-east-1 for an endpoint), making ``attempts`` tries a request,
    trusting ``ca_file`` and addressing buckets path-style if ``path_style`` (None: as the
    options say). Raises UsageError for a malformed endpoint URL."""
    if path_style is None:
        path_style = options.path_style()
    config_kwargs: dict[str, Any] = {
        "connect_timeout": options.connect_timeout_s,
        "read_timeout": options.read_timeout_s,
        "retries": {"mode": "standard", "max_attempts": attempts},
        # +2: head and list requests run beside a full set of ranged GETs.
        "max_pool_connections": options.max_connections + 2,
        "s3": {"addressing_style": "path" if path_style else "auto"},
        "user_agent_extra": "objfs",
    }
    # SigV4 also for presigned URLs (--cache-proxy), which botocore would otherwise sign
    # with SigV2 where it still can; SigV2 is refused in newer AWS regions.
    config_kwargs["signature_version"] = UNSIGNED if options.no_sign_request else "s3v4"
    if region is None:
        region = (
            options.region
            or session.get_config_variable("region")
            or ("us-east-1" if endpoint else None)
        )
    try:
        client: S3Client = session.create_client(  # type: ignore[assignment]
            "s3",
            endpoint_url=endpoint,
            region_name=region,
            config=Config(**config_kwargs),
            verify=ca_file,  # the data path's too (see ca_bundle)
        )
    except ValueError as exc:  # botocore rejects a malformed endpoint URL this way
        raise UsageError(
            f"--endpoint-url: {redact_url(endpoint or '')!r} is not a valid URL ({exc}): "
            "give it as http(s)://HOST[:PORT]"
        ) from None
    return client


class _LeanJSONFileLoader(botocore.loaders.JSONFileLoader):
    """botocore's JSON data files loaded as plain dicts, without their documentation texts.

    botocore keeps what it loads for a client as long as the client lives (the endpoints
    table, the S3 model and its endpoint rules), as ``OrderedDict`` with every operation's and
    shape's documentation. objfs never renders documentation: each text becomes "" while the
    file is parsed (the key stays: botocore indexes some of them)."""

    def load_file(self, file_path: str) -> Any:
        """The data of ``file_path`` + ``.json`` (or ``.json.gz``), None if neither exists."""
        for ext, opener in ((".json", open), (".json.gz", gzip.open)):
            if os.path.isfile(file_path + ext):
                with opener(file_path + ext, "rb") as fp:
                    payload = fp.read()
                return json.loads(payload.decode("utf-8"), object_pairs_hook=_without_documentation)
        return None


def _without_documentation(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # The key stays (botocore indexes some of them), its text becomes the shared "".
    return {k: "" if k == "documentation" and isinstance(v, str) else v for k, v in pairs}


def _use_lean_models(session: botocore.session.Session) -> None:
    """Make ``session`` load botocore's data files with :class:`_LeanJSONFileLoader` (an
    unexpected loader, from a botocore that changed, is left as it is)."""
    loader = session.get_component("data_loader")
    if type(getattr(loader, "file_loader", None)) is botocore.loaders.JSONFileLoader:
        loader.file_loader = _LeanJSONFileLoader()
