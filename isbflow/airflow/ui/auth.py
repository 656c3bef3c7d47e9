"""Who is asking: the caller's Airflow token, checked the way Airflow's own API checks it.

FastAPI apps mounted by a plugin are not behind Airflow's authentication, so every
route of the isbflow UI depends on :func:`require_user`. The token comes from
``Authorization: Bearer <jwt>`` (what ``POST /auth/token`` returns) or, when there is
no such header, from the ``_token`` cookie the Airflow UI keeps after a login (the
iframe of an external view sends it). Airflow's ``get_user`` (the dependency behind
``/api/v2``) validates it with the auth manager's JWT validator (signature,
audience, expiry, revoked ids), so whatever auth manager is configured decides.

A caller without a valid token gets 401 and nothing else; a valid user the auth
manager does not let read DAGs gets 403. Airflow answers an invalid token with 403;
here it is 401 too, since the remedy (log in again) is the same.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.security.utils import get_authorization_scheme_param

FORBIDDEN_DETAIL = "your Airflow user may not read DAGs"


class NotAuthenticated(Exception):
    """No valid Airflow token on the request; ``reason`` says which part failed."""

    def __init__(self, reason: str, status_code: int = 401):
        super().__init__(reason)
        self.reason = reason
        self.status_code = status_code


def auth_manager() -> Any:
    """The api-server's auth manager (created and initialized here when nothing did yet)."""
    # lazy: Airflow's api_fastapi (seconds); tests/airflow/test_ui_app.py builds the app without Airflow
    from airflow.api_fastapi.app import get_auth_manager, init_auth_manager

    try:
        return get_auth_manager()
    except RuntimeError:  # mounted outside Airflow's api-server (e.g. a bare test app)
        return init_auth_manager()


def _bearer(request: Request) -> Any:
    scheme, token = get_authorization_scheme_param(request.headers.get("Authorization"))
    if scheme.lower() == "bearer" and token:
        return HTTPAuthorizationCredentials(scheme=scheme, credentials=token)
    return None


async def require_user(request: Request) -> Any:
    """The authenticated Airflow user allowed to read DAGs; NotAuthenticated (401/403) otherwise."""
    # lazy: Airflow's api_fastapi (seconds); tests/airflow/test_ui_app.py builds the app without Airflow
    from airflow.api_fastapi.core_api.security import get_user

    am = auth_manager()
    try:
        user = await get_user(request, None, _bearer(request))
    except HTTPException as e:
        raise NotAuthenticated(str(e.detail)) from None
    if not am.is_authorized_dag(method="GET", user=user):
        raise NotAuthenticated(FORBIDDEN_DETAIL, 403)
    return user


def login_url(request: Request) -> str:
    """The auth manager's login page, coming back to this page afterwards."""
    try:
        return auth_manager().get_url_login(next_url=str(request.url))
    except Exception:  # an auth manager without a login page: the Airflow UI's root
        return "/"
