"""The console's sign-in: the login form, sign-out, and the session's details that the console's
pages read (docs/security.md, "Users and the console's sign-in").

The middleware (:class:`~visionserve.security.HttpSecurity`) has checked ``Host`` and ``Origin``,
and the CSRF token of a sign-out, before these run, and left the request's live session, if any,
in the scope (:func:`session_of`). Passwords are checked off the event loop (argon2 is slow on
purpose), two at a time per process; failed sign-ins are counted per user name and per client
address in the users file, so every front-end process sees them.
"""

from __future__ import annotations

import asyncio
import html
import logging
import math
import time
from datetime import datetime, timezone
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from ..audit import Entry
from ..errors import InvalidInput, UnsupportedMediaType
from ..security import SESSION_COOKIE, SESSION_KEY
from ..users.store import Session, Users
from .common import audit_of, caller_of, parse_json, read_body, settings_of
from .schemas import SESSION_ROUTES, SIGN_IN

log = logging.getLogger("visionserve")

router = APIRouter()

LOGIN_PATH = "/ui/login"
CONSOLE_HOME = "/ui"  # where a browser goes once signed in
MAX_FORM_BYTES = 8192
_FORM = "application/x-www-form-urlencoded"
_HASHING = asyncio.Semaphore(2)  # argon2 takes 64 MiB and tens of ms per check

# the page's words, in one place
WRONG = "wrong user name or password"
TOO_MANY = "too many failed sign-ins: try again in {wait} s"
NOT_SIGNED_IN = f"not signed in: sign in with POST {LOGIN_PATH}"
PAGE_TITLE = "Sign in · visionserve"
LABEL_USER, LABEL_PASSWORD, BUTTON = "User name", "Password", "Sign in"

#: the login page loads nothing: no script, no style sheet, no font, no frame around it; its
#: referrer policy is same-origin, as the console's: under no-referrer a browser sends the form
#: with ``Origin: null``, which the cross-site check refuses
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY", "Referrer-Policy": "same-origin", "Cache-Control": "no-store",
}
_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body {{ font: 16px/1.5 system-ui, sans-serif; color: #1a1a1a; background: #f4f4f4; margin: 0; }}
main {{ max-width: 22rem; margin: 12vh auto; background: #fff; padding: 2rem;
        border: 1px solid #767676; border-radius: 4px; }}
h1 {{ font-size: 1.4rem; margin: 0 0 1rem; }}
label {{ display: block; margin-top: 1rem; font-weight: 600; }}
input {{ width: 100%; box-sizing: border-box; padding: .5rem; font: inherit;
         border: 1px solid #595959; border-radius: 3px; }}
button {{ margin-top: 1.5rem; width: 100%; padding: .6rem; font: inherit; font-weight: 600;
          color: #fff; background: #0b4f8a; border: 0; border-radius: 3px; cursor: pointer; }}
:focus-visible {{ outline: 3px solid #1a1a1a; outline-offset: 2px; }}
.error {{ color: #a30000; font-weight: 600; margin: 0; }}
</style></head>
<body><main>
<h1>visionserve</h1>
<form method="post" action="{action}">
{error}<label for="user">{label_user}</label>
<input id="user" name="user" autocomplete="username" required autofocus value="{user}">
<label for="password">{label_password}</label>
<input id="password" name="password" type="password" autocomplete="current-password" required>
<button type="submit">{button}</button>
</form>
</main></body></html>
"""


def session_of(request: Request) -> Session | None:
    """The request's live console session, as the middleware found it."""
    return request.scope.get(SESSION_KEY)


def users_of(request: Request) -> Users:
    return request.app.state.users


def login_page(error: str = "", user: str = "", status: int = 200,
               headers: dict[str, str] | None = None) -> HTMLResponse:
    alert = f'<p class="error" role="alert">{html.escape(error)}</p>\n' if error else ""
    page = _PAGE.format(title=PAGE_TITLE, action=LOGIN_PATH, error=alert, user=html.escape(user),
                        label_user=LABEL_USER, label_password=LABEL_PASSWORD, button=BUTTON)
    return HTMLResponse(page, status_code=status, headers={**_PAGE_HEADERS, **(headers or {})})


@router.get(LOGIN_PATH, include_in_schema=False)
async def login_form() -> HTMLResponse:
    return login_page()


@router.post(LOGIN_PATH, summary="Sign in to the console",
             description="A form (application/x-www-form-urlencoded: user, password) or a JSON "
                         "object of the same fields. Sets the session cookie; a browser's form is "
                         f"sent on to {CONSOLE_HOME}, other clients get the session as "
                         "GET /ui/session does. 401 for a wrong user name or password (never "
                         "which), 429 with Retry-After after repeated failures.",
             responses=SIGN_IN)
async def login(request: Request) -> Response:
    browser = "text/html" in request.headers.get("accept", "")
    user, password = await _credentials(request)
    store = users_of(request).store()
    client = request.client.host if request.client else "?"
    keys = (f"user:{user[:64]}", f"addr:{client}")
    wait = await asyncio.to_thread(store.login_wait, keys) if store is not None else 0.0
    if wait > 0:
        seconds = math.ceil(wait)
        log.warning("console: sign-in from %s refused for %d s after repeated failures",
                    client, seconds)
        return _refused(browser, TOO_MANY.format(wait=seconds), user, 429,
                        {"Retry-After": str(seconds)})
    found = None
    if store is not None:
        async with _HASHING:
            found = await asyncio.to_thread(store.authenticate, user, password)
    if store is None or found is None:
        if store is not None:
            await asyncio.to_thread(store.login_failed, keys)
        # the audit file keeps the name tried, never the password; the log line names neither
        # (Entry.log_fields)
        entry = Entry("sign-in-failed", "user", user[:64], caller=caller_of(request))
        await audit_of(request).arecord(entry, "console: failed sign-in from %s", client,
                                        level=logging.WARNING)
        return _refused(browser, WRONG, user, 401)
    await asyncio.to_thread(store.login_succeeded, keys[0])
    ttl = settings_of(request).session_ttl_s
    token, session = await asyncio.to_thread(store.open_session, found.name, ttl)
    entry = Entry("sign-in", "user", found.name, None, {"role": found.role},
                  {**caller_of(request), "operator": found.name})
    await audit_of(request).arecord(entry, "console: %s (%s) signed in from %s", found.name,
                                    found.role, client)
    response: Response = (Response(status_code=303, headers={"Location": CONSOLE_HOME})
                          if browser else JSONResponse(_described(session)))
    response.headers["Cache-Control"] = "no-store"
    response.set_cookie(SESSION_COOKIE, token, max_age=int(ttl), path="/", httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")
    return response


@router.post("/ui/logout", summary="Sign out of the console",
             description="Ends the session in every front-end process and clears the cookie; "
                         "needs the session's CSRF token (X-CSRF-Token).",
             responses=SESSION_ROUTES)
async def logout(request: Request) -> JSONResponse:
    session = session_of(request)
    store = users_of(request).store()
    if session is not None and store is not None:
        await asyncio.to_thread(store.end_session, session.key)
        entry = Entry("sign-out", "user", session.user,
                      caller={**caller_of(request), "operator": session.user})
        await audit_of(request).arecord(entry, "console: %s signed out", session.user)
    response = JSONResponse({"signed_out": session.user if session is not None else None})
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict",
                           secure=request.url.scheme == "https")
    return response


@router.get("/ui/session", summary="The console session",
            description="The signed-in user, their role, the CSRF token every change must carry "
                        "(X-CSRF-Token) and the session's expiry; 401 without a session.",
            responses=SESSION_ROUTES)
async def session_details(request: Request) -> JSONResponse:
    session = session_of(request)
    if session is None:
        return JSONResponse({"error": NOT_SIGNED_IN}, status_code=401,
                            headers={"Cache-Control": "no-store"})
    return JSONResponse(_described(session), headers={"Cache-Control": "no-store"})


def _described(session: Session) -> dict:
    expires = datetime.fromtimestamp(session.expires, timezone.utc)
    return {"user": session.user, "role": session.role, "csrf_token": session.csrf_token,
            "expires": expires.isoformat(timespec="seconds"),
            "expires_in_s": max(0, int(session.expires - time.time()))}


def _refused(browser: bool, message: str, user: str, status: int,
             headers: dict[str, str] | None = None) -> Response:
    if browser:
        return login_page(message, user, status, headers)
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def _credentials(request: Request) -> tuple[str, str]:
    """(user, password) of a sign-in: a form or a JSON object (415 for another body, 400 for
    missing fields)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind not in (_FORM, "application/json"):
        raise UnsupportedMediaType(f"a sign-in is a form ({_FORM}) or JSON (application/json); "
                                   f"got Content-Type {kind or 'none'}")
    body = await read_body(request, MAX_FORM_BYTES, settings_of(request).body_timeout_s)
    if kind == _FORM:
        try:
            form = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=8)
        except (UnicodeDecodeError, ValueError) as exc:
            raise InvalidInput(f"the sign-in form is not one this server reads: {exc}") from None
        fields: dict = {k: v[0] for k, v in form.items()}
    else:
        fields = parse_json(body)
        if not isinstance(fields, dict):
            raise InvalidInput("the sign-in body must be a JSON object: user, password")
    user, password = fields.get("user"), fields.get("password")
    if not isinstance(user, str) or not isinstance(password, str) or not user or not password:
        raise InvalidInput("a sign-in needs the fields user and password")
    return user, password

