"""Access control of the ingress (docs/failures.md): an optional API key for the OpenAI
routes and a separate admin key for the routes that change the layout.

The YAML names the environment variables that hold the keys
(`ingress.api_key_env`, `ingress.admin_key_env`), never the keys. The app builder
reads them once, on the host that builds the application (`serve run`'s shell), so
a missing variable fails the deployment with the field's name instead of leaving a
route open. Clients send `Authorization: Bearer <key>` (as OpenAI clients do with
`api_key=`); a missing or wrong key is 401 with `WWW-Authenticate: Bearer`.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from enum import Enum

from pydantic import SecretStr
from starlette.requests import Request

from afd_ray.config import IngressConfig

__all__ = ["AccessKeys", "Role"]


class Role(str, Enum):
    """Which key a route needs."""

    USER = "api"
    """The OpenAI routes (`/v1/*`): `ingress.api_key_env`."""
    ADMIN = "admin"
    """`POST /afd/scale`, `/afd/autoscale/*`: `ingress.admin_key_env`."""


@dataclass(frozen=True)
class AccessKeys:
    """The keys of both roles (None: that role's routes are open). `SecretStr` keeps
    them out of reprs and logs."""

    api: SecretStr | None = None
    admin: SecretStr | None = None

    @classmethod
    def from_env(cls, ingress: IngressConfig) -> AccessKeys:
        """The keys from the environment variables `ingress` names.

        Raises:
            ValueError: a named variable is unset or empty (names the field and the variable).
        """
        return cls(
            api=_read(ingress.api_key_env, "ingress.api_key_env"),
            admin=_read(ingress.admin_key_env, "ingress.admin_key_env"),
        )

    def denied(self, request: Request, role: Role) -> str | None:
        """Why `request` may not use a route of `role` (its 401 message), or None."""
        key = self.api if role is Role.USER else self.admin
        if key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return f"this route needs the {role.value} key: send 'Authorization: Bearer <key>'"
        if not hmac.compare_digest(token.strip().encode(), key.get_secret_value().encode()):
            return f"wrong {role.value} key"
        return None


def _read(variable: str | None, field: str) -> SecretStr | None:
    if variable is None:
        return None
    value = os.environ.get(variable, "")
    if not value:
        raise ValueError(f"{field}: the environment variable {variable!r} it names is unset or empty")
    return SecretStr(value)
