"""Who is calling: API keys (REST `Authorization: Bearer KEY`, gRPC `authorization`
metadata), the tenant each key names, and the prefix-cache salt of a tenant.

Keys are compared as SHA-256 digests with hmac.compare_digest, against every
configured key with no early exit, so neither a key's length nor which key
nearly matched shows in the time an answer takes.  Tenants are named by a
fingerprint of their key, so keys never appear in metrics, logs or errors.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from services.frontend.errors import APIError

_SALT_LABEL = b"splitserve cache salt v1\0"


@dataclass(frozen=True)
class Tenant:
    name: str  # "key-" + a fingerprint of the key
    secret: bytes = b""  # derived from the key; the prefix-cache salt is keyed with it

    def cache_salt(self, client_salt: str) -> str:
        """The key's own cache namespace, with the client's salt inside it: two keys
        never share a block, one key still sees its own hits."""
        return "t-" + hmac.new(self.secret, client_salt.encode(), hashlib.sha256).hexdigest()[:32]


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` value."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip() or None
    return None


def unauthorized(message: str) -> APIError:
    return APIError(401, message, None, "invalid_api_key")


class Auth:
    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = [(hashlib.sha256(k.encode()).digest(), _tenant(k)) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """-> the caller's tenant; None when no keys are configured.  APIError 401 otherwise."""
        if not self._keys:
            return None
        token = bearer(authorization)
        if token is None:
            raise unauthorized("no API key: send 'Authorization: Bearer <key>'")
        digest = hashlib.sha256(token.encode()).digest()
        found: Tenant | None = None
        for key_digest, tenant in self._keys:  # all of them, whichever matches
            if hmac.compare_digest(digest, key_digest):
                found = tenant
        if found is None:
            raise unauthorized("the API key is not valid")
        return found


def _tenant(key: str) -> Tenant:
    fingerprint = hashlib.sha256(b"splitserve tenant\0" + key.encode()).hexdigest()[:12]
    return Tenant(f"key-{fingerprint}", hmac.new(key.encode(), _SALT_LABEL, hashlib.sha256).digest())
