"""Who may call what: the router's keys, resolved once at start (`resolve_keys`), and the
check every HTTP request passes before any route runs (`authorize`, from router/http/middleware.py).

Keys. Inference keys come from the first source given: `--api-key K [K ...]` (vLLM's flag),
`--api-key-file PATH`, `PDSERVE_API_KEY`, `VLLM_API_KEY` (a file or a variable: one key per
line; one trailing newline is not part of a key, so a Secret made from a key file works).
Admin keys likewise from `--admin-api-key`, `--admin-api-key-file`, `PDSERVE_ADMIN_API_KEY`.
An empty key, a known placeholder ("replace-me", ...), a key a client could not send in a
header, a key shorter than 16 characters (MIN_KEY_CHARS), an unreadable or empty file, or an
admin key that is also an inference key is refused at start (ValueError naming the source:
`pdserve router` exits 2). A key is never logged and never kept: `Keys` holds sha256 digests
(compared in constant time, as vLLM does).

Paths:
Before the key check (router/http/middleware.py): the Host / Origin check
(router/http/host_check.py) and the back-off of addresses that keep presenting wrong keys
(router/http/auth_throttle.py).

    open   anything not listed below: /health, /metrics, /version, /dashboard (the page
           itself holds no data: a browser cannot send a Bearer header when it navigates;
           the page sends the key on its data requests), /openapi.json, /docs, unknown paths
    api    /v1/* except the two LoRA routes, /tokenize, /detokenize: an inference or admin
           key when inference keys are set (else open, as vLLM without --api-key)
    admin  the dev endpoints (endpoints/admin/serving.py ADMIN_PATHS), /v1/load_lora_adapter,
           /v1/unload_lora_adapter, /dashboard/data: an admin key when one is set (an
           inference key alone gets 403), else as `api`

Tenant cache salts (`--cache-salt-from-api-key`): a request's prefix-cache salt is derived
from the key it presented (and its own `cache_salt`, if any), so clients holding different
keys never share prefix-cache blocks: neither `cached_tokens` nor timing can tell one tenant
what another one sent. The salt is a hash of the key, so every router replica derives the same.

Per-key limits (router/http/key_limits.py): `authorize` names the tenant of a request that
presented an inference key (its digest, `key_limits.TENANT`); admin keys are not limited, and
the limits need inference keys (refused at start otherwise).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from router.config import RouterConfig
from router.endpoints.admin.serving import ADMIN_PATHS
from router.http.errors import APIError
from router.http.key_limits import TENANT

log = logging.getLogger(__name__)

API_KEY_ENVS = ("PDSERVE_API_KEY", "VLLM_API_KEY")
ADMIN_KEY_ENV = "PDSERVE_ADMIN_API_KEY"
PLACEHOLDERS = frozenset(
    {
        "replace-me",
        "replace_me",
        "replaceme",
        "changeme",
        "change-me",
        "change_me",
        "your-api-key",
        "your_api_key",
        "yourapikey",
        "your-key",
        "api-key",
        "api_key",
        "apikey",
        "secret",
        "password",
        "placeholder",
        "empty",
        "none",
        "null",
        "xxx",
        "sk-xxx",
        "<api-key>",
        "<your-api-key>",
        "${pdserve_api_key}",
        "$(pdserve_api_key)",
    }
)
"""Values that are never a real key (compared case-insensitively). "EMPTY" is the `openai`
client's conventional dummy key for servers without one: as a server key it is a mistake."""
TENANT_SALT = "pdserve.tenant_salt"
"""The ASGI scope entry `authorize` sets to the tenant salt of the key presented."""
KEY_CHECKED = "pdserve.key_checked"
"""The ASGI scope entry `authorize` sets (True) when the request presented a right key."""
MIN_KEY_CHARS = 16
"""Shortest key accepted at start (as for the cluster token and etcd's passwords)."""
_SALT_DOMAIN = b"pdserve-cache-salt\x00"
_LORA_ADMIN = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


class Access(enum.Enum):
    OPEN = "open"
    API = "api"
    ADMIN = "admin"


def access_of(path: str) -> Access:
    """Which keys `path` needs (module docstring, "Paths")."""
    if path in ADMIN_PATHS or path in _LORA_ADMIN or path == "/dashboard/data":
        return Access.ADMIN
    if path.startswith("/v1/") or path == "/v1" or path in ("/tokenize", "/detokenize"):
        return Access.API
    return Access.OPEN


@dataclass(frozen=True)
class Keys:
    """The resolved keys as sha256 digests (no key is kept), and each key's tenant salt."""

    api: tuple[bytes, ...] = ()
    """Inference keys. Empty: the api paths are open."""
    admin: tuple[bytes, ...] = ()
    """Admin keys. Empty: the admin paths take the inference keys."""
    salts: Mapping[bytes, str] = field(default_factory=dict)
    """digest -> the tenant salt of that key (empty unless --cache-salt-from-api-key)."""

    def __repr__(self) -> str:  # counts only: a digest of a weak key could be searched for
        return f"Keys(api={len(self.api)}, admin={len(self.admin)}, salted={bool(self.salts)})"

    @classmethod
    def of(cls, api: Iterable[str] = (), admin: Iterable[str] = (), salted: bool = False) -> "Keys":
        api, admin = tuple(dict.fromkeys(api)), tuple(dict.fromkeys(admin))
        salts = {_digest(k): tenant_salt(k) for k in (*api, *admin)} if salted else {}
        return cls(tuple(map(_digest, api)), tuple(map(_digest, admin)), salts)


def tenant_salt(key: str) -> str:
    """The prefix-cache salt of one key: the same on every router, useless for finding the key
    (sha256 of a domain tag and the key)."""
    return hashlib.sha256(_SALT_DOMAIN + key.encode("ascii")).hexdigest()


def effective_salt(scope: Mapping, given: str | None) -> str | None:
    """A request's cache salt: the tenant salt of its key joined with the request's own
    `cache_salt` (tenants can still subdivide their own cache), or the request's own."""
    tenant = scope.get(TENANT_SALT)
    if tenant is None:
        return given
    return tenant if given is None else f"{tenant}:{given}"


def authorize(keys: Keys, scope: dict) -> APIError | None:
    """The 401/403 for this HTTP request, or None (then, with tenant salts, the salt of the
    key it presented is in `scope[TENANT_SALT]`, and the digest of an inference key it
    presented in `scope[TENANT]`, for the per-key limits)."""
    need = access_of(scope["path"])
    if need is Access.ADMIN and keys.admin:
        allowed = keys.admin
    elif need is not Access.OPEN and keys.api:
        allowed = keys.api + keys.admin
    else:
        return None  # an open path, or no key for it (open, as vLLM without --api-key)
    presented = _presented(scope)
    if not _matches(presented, allowed):
        if allowed is keys.admin and _matches(presented, keys.api):
            return APIError(
                403,
                "This endpoint needs the admin API key (--admin-api-key); "
                "an inference key is not enough.",
                code="admin_key_required",
            )
        return APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    scope[KEY_CHECKED] = True
    if presented is not None and presented in keys.salts:
        scope[TENANT_SALT] = keys.salts[presented]
    if not _matches(presented, keys.admin):  # an inference key: limited per key (key_limits)
        scope[TENANT] = presented
    return None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("ascii")).digest()


def _presented(scope: dict) -> bytes | None:
    """sha256 of the `Authorization: Bearer <token>` token (scheme case-insensitive, as vLLM)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return hashlib.sha256(token).digest() if scheme.lower() == b"bearer" else None
    return None


def _matches(presented: bytes | None, digests: tuple[bytes, ...]) -> bool:
    """Whether `presented` is one of `digests`, comparing with every one (constant time)."""
    if presented is None:
        return False
    found = False
    for d in digests:
        found |= hmac.compare_digest(presented, d)
    return found


# ---- resolution at start ----------------------------------------------------------------------


def resolve_keys(config: RouterConfig, environ: Mapping[str, str]) -> Keys:
    """The router's keys from its flags and `environ` (module docstring). Raises ValueError
    naming the source of a refused key, or an option that cannot be honoured."""
    api, api_source = _resolve(
        "--api-key", config.api_key, config.api_key_file, API_KEY_ENVS, environ
    )
    admin, admin_source = _resolve(
        "--admin-api-key",
        config.admin_api_key,
        config.admin_api_key_file,
        (ADMIN_KEY_ENV,),
        environ,
    )
    if set(api) & set(admin):
        raise ValueError(
            f"{admin_source}: an admin key is also an API key ({api_source}); "
            "they must differ, or the inference key would reach the admin "
            "endpoints"
        )
    if config.cache_salt_from_api_key:
        if not api:
            raise ValueError(
                "--cache-salt-from-api-key needs an API key (--api-key, "
                "--api-key-file, PDSERVE_API_KEY or VLLM_API_KEY): the salt "
                "is derived from the key a request presents"
            )
        if len(api) > 1 and not admin:
            raise ValueError(
                "--cache-salt-from-api-key with several API keys needs "
                "--admin-api-key: otherwise every tenant's key reaches "
                "/dashboard/data and the admin endpoints"
            )
    _check_key_limits(config, api)
    log.info(
        "API keys: %s; admin keys: %s%s",
        _count(api, api_source),
        _count(admin, admin_source),
        "; tenant cache salts from the API key" if config.cache_salt_from_api_key else "",
    )
    if len(api) > 1 and not admin:
        log.warning(
            "%d API keys and no --admin-api-key: every one of them reaches the admin "
            "endpoints and /dashboard/data",
            len(api),
        )
    return Keys.of(api, admin, salted=config.cache_salt_from_api_key)


def _check_key_limits(config: RouterConfig, api: tuple[str, ...]) -> None:
    """The per-key limits need keys: without them every client is the same tenant, and a
    "per key" limit would silently be one limit shared by all."""
    limits = config.limits
    given = [
        flag
        for flag, value in (
            ("--max-concurrent-requests-per-key", limits.max_concurrent_requests_per_key),
            ("--max-tokens-per-minute-per-key", limits.max_tokens_per_minute_per_key),
        )
        if value
    ]
    if given and not api:
        raise ValueError(
            f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} API keys (--api-key-file, "
            "PDSERVE_API_KEY, VLLM_API_KEY or --api-key): requests are limited "
            "per key, and without keys no client can be told from another (for a "
            "cap on all requests: --limit-concurrency, --max-queued-requests)"
        )


def _count(keys: tuple[str, ...], source: str | None) -> str:
    return f"{len(keys)} from {source}" if keys else "none"


def _resolve(
    flag: str,
    given: tuple[str, ...],
    path: str | None,
    envs: tuple[str, ...],
    environ: Mapping[str, str],
) -> tuple[tuple[str, ...], str | None]:
    """(keys, the source they came from): the flag, else its file, else the first variable
    set in `environ`; ((), None) when none is given."""
    if given and path is not None:
        raise ValueError(f"{flag} and {flag}-file are exclusive: give the keys one way")
    if given:
        return _checked(given, flag), flag
    if path is not None:
        source = f"{flag}-file {path}"
        try:
            text = Path(path).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ValueError(f"{source}: cannot read it ({reason})") from None
        if not text.strip("\r\n"):
            raise ValueError(f"{source}: the file is empty")
        return _checked(_lines(text), source), source
    for name in envs:
        if name in environ:
            return _checked(_lines(environ[name]), name), name
    return (), None


def _lines(text: str) -> tuple[str, ...]:
    """One key per line; one trailing newline (LF or CRLF) is not a line."""
    text = text.removesuffix("\n").removesuffix("\r")
    return tuple(line.removesuffix("\r") for line in text.split("\n"))


def _checked(keys: tuple[str, ...], source: str) -> tuple[str, ...]:
    for i, key in enumerate(keys):
        where = f"{source} (key {i + 1})" if len(keys) > 1 else source
        if not key:
            raise ValueError(
                f"{where}: the API key is empty (an empty key would turn "
                "authentication off; to run without a key, give none)"
            )
        if key.casefold() in PLACEHOLDERS:
            raise ValueError(
                f"{where}: {key!r} is a placeholder, not a key; generate one, "
                "e.g. `openssl rand -hex 32`"
            )
        if not all("!" <= c <= "~" for c in key):
            raise ValueError(
                f"{where}: an API key must be printable ASCII without spaces "
                "(a client could not send it as `Authorization: Bearer <key>`)"
            )
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(
                f"{where}: an API key must have at least {MIN_KEY_CHARS} characters (this one "
                f"has {len(key)}); generate one, e.g. `openssl rand -hex 32`"
            )
    return tuple(dict.fromkeys(keys))
