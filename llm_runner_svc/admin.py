"""The admin gate of the Stage service's admin calls (LoadAdapter, UnloadAdapter).

A stage started with an admin token (the LLM_RUNNER_ADMIN_TOKEN environment variable of the
process) accepts an admin call whose metadata carries `authorization: Bearer <token>`; any
other call, and every admin call of a stage started without a token, is PERMISSION_DENIED.
The token is compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable

from llm_runner_svc.errors import PermissionDenied

ADMIN_TOKEN_ENV = "LLM_RUNNER_ADMIN_TOKEN"


def admin_token_from_env() -> str | None:
    """The token this process was started with (None: admin calls are off)."""
    return os.environ.get(ADMIN_TOKEN_ENV) or None


def check_admin(token: str | None, metadata: Iterable[tuple[str, str | bytes]] | None,
                call: str) -> None:
    """PermissionDenied unless `metadata` carries `authorization: Bearer <token>`."""
    if token is None:
        raise PermissionDenied(f"{call} is an admin call and this stage takes none (start it "
                               f"with {ADMIN_TOKEN_ENV} set)")
    given = next((v for k, v in metadata or () if k.lower() == "authorization"), None)
    if isinstance(given, bytes):
        given = given.decode("utf-8", "replace")
    if given is None or not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise PermissionDenied(f"{call} is an admin call: send 'authorization: Bearer "
                               "<admin token>' metadata")
