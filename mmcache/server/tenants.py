"""API keys and tenants: who a request is, and the salt that keeps its cache entries its own.

Rules:

* With no key configured every request is the one anonymous tenant; otherwise a request must carry
  ``Authorization: Bearer KEY`` with one of the keys. Keys are compared with ``hmac.compare_digest`` against
  every configured key (no early exit), so the time taken says nothing about how close a guess was.
* Each key is its own tenant. Its salt is derived on the server (HMAC-SHA256 of the server's secret and the key,
  32 bytes), never sent by a client, so no request can name another tenant's salt.
* A request's ``cache_salt`` subdivides its own tenant: the salt handed to the engine is the tenant's salt, a
  separator and the SHA-256 of the caller's salt. Every tenant salt has one length, so no (tenant, cache_salt)
  pair can spell another's, and every engine salt has a fixed length within the core's bound
  (``names.MAX_SALT_BYTES``) whatever the caller sent. The anonymous tenant without a cache_salt uses the empty
  salt, the one the engine uses by default.
* Queues are shared by share: ``share(limit)`` is a tenant's part of a server-wide ``limit`` (an equal part,
  at least 1), so the parts of all tenants add up to at most the limit (when it is at least the tenant count)
  and a tenant within its part is never refused because another filled the queue.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class Tenant:
    name: str  # "anonymous" or "key-N" (the key's index; the key itself is never echoed)
    salt: bytes


ANONYMOUS = Tenant("anonymous", b"")


class Tenants:
    """The configured keys; ``authenticate`` finds a request's tenant, ``salt`` combines its cache salt."""

    def __init__(self, api_keys: tuple[str, ...] = (), secret: bytes | None = None):
        secret = secret or secrets.token_bytes(32)
        self._keys = [k.encode("utf-8") for k in api_keys]
        self._tenants = [Tenant(f"key-{i}", hmac.new(secret, k, hashlib.sha256).digest())
                         for i, k in enumerate(self._keys)]

    @property
    def required(self) -> bool:
        return bool(self._keys)

    @property
    def count(self) -> int:
        """How many tenants there are (1, the anonymous one, when no key is configured)."""
        return max(1, len(self._tenants))

    def share(self, limit: int) -> int:
        """One tenant's part of a server-wide ``limit`` (module docstring)."""
        return max(1, limit // self.count)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``Authorization`` header, or None when a key is required and this one is missing
        or wrong."""
        if not self._keys:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        given = token.strip().encode("utf-8", "surrogatepass")
        found = None
        for key, tenant in zip(self._keys, self._tenants):
            if hmac.compare_digest(given, key) and found is None:  # every key is compared
                found = tenant
        return found

    @staticmethod
    def salt(tenant: Tenant, cache_salt: str | None) -> bytes:
        """The engine salt of a request of ``tenant`` with ``cache_salt`` (None or "": the tenant's own)."""
        if not cache_salt:
            return tenant.salt
        return tenant.salt + b"\x00" + hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).digest()


def metrics_key_matches(request, key: str) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer KEY`` with the metrics ``key`` (compared in constant
    time)."""
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    given = token.strip().encode("utf-8", "surrogatepass")
    return scheme.lower() == "bearer" and hmac.compare_digest(given, key.encode("utf-8"))
