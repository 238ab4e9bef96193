"""Who may call the server: the API key (`--api-key`) and the browser origins allowed to call it
(`--allowed-origins`), each one ASGI middleware that decides by path, so a route added later is
covered without touching it.

With a key, every path needs `Authorization: Bearer KEY` or `x-api-key: KEY` (the header the
Anthropic SDK sends; llama.cpp's server and vLLM take both) except the open ones: /health (the probes
of load balancers carry no key), /metrics unless `protect_metrics`, and /dashboard (the page holds
no data; it asks for the key and sends it with its /v1/stats reads). Deny by default, as vLLM's
current middleware: the /v1 routes, vLLM's root routes (/tokenize, /detokenize) and any later
route are guarded, and so is a path no route answers (401 before 404). OPTIONS requests pass: a
browser's CORS preflight never carries credentials. The key is compared in constant time, as
SHA-256 digests, so neither its bytes nor its length leak through timing. A 401 on Anthropic's
routes (/v1/messages...) is Anthropic's error object, elsewhere OpenAI's.
"""

import hashlib
import hmac
import re
from dataclasses import dataclass, field

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from infer.server import messages_response
from infer.server.errors import ApiError

OPEN_PATHS = frozenset({"/health", "/dashboard"})
# Anthropic's Messages API: its errors, 401s included, are Anthropic's error object.
ANTHROPIC_PATH_PREFIX = "/v1/messages"
METRICS_PATH = "/metrics"
# What a browser may send cross-origin: the methods of our routes; any header, since the official
# openai JS client adds its own (x-stainless-*) beside Authorization and Content-Type.
CORS_METHODS = ("GET", "POST")
ANY_ORIGIN = "*"
# An origin as browsers send it: scheme://host[:port], no path ("null" is never allowed).
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")
# A key travels in an HTTP header: printable ASCII, no spaces.
_KEY = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True)
class AccessPolicy:
    """The server's access options. `api_key`: None serves everyone; `protect_metrics`: /metrics
    needs the key too; `allowed_origins`: origins whose browsers may call the server ("*": any).
    Raises ValueError for a key or an origin that could never match."""

    api_key: str | None = field(default=None, repr=False)  # never in a log line or a repr
    protect_metrics: bool = False
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self):
        if self.api_key is not None and not _KEY.fullmatch(self.api_key):
            raise ValueError(
                "the API key must be printable ASCII without spaces (it travels in an HTTP header)"
                + (", not empty" if not self.api_key else "")
            )
        for origin in self.allowed_origins:
            if origin != ANY_ORIGIN and not _ORIGIN.fullmatch(origin):
                raise ValueError(
                    f"allowed origin {origin!r} is not scheme://host[:port] as browsers send it "
                    "(lower case, no path), nor *"
                )
        if self.protect_metrics and self.api_key is None:
            raise ValueError("protecting /metrics needs an API key (--api-key or INFER_API_KEY)")

    @property
    def open_paths(self) -> frozenset[str]:
        return OPEN_PATHS if self.protect_metrics else OPEN_PATHS | {METRICS_PATH}


def parse_origins(values: list[str]) -> tuple[str, ...]:
    """--allowed-origins as given (one per value, or comma-separated): lower case, without the
    trailing slash people copy from the address bar, duplicates dropped."""
    origins = (origin.strip().lower().removesuffix("/") for value in values for origin in value.split(","))
    return tuple(dict.fromkeys(filter(None, origins)))


class RequireApiKey:
    """Answers 401 (OpenAI's error shape, or Anthropic's on its routes; `WWW-Authenticate:
    Bearer`) to any request for a path outside the policy's open ones that carries the key in
    neither `Authorization: Bearer <the key>` nor `x-api-key: <the key>`."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy):
        self.app = app
        self.open_paths = policy.open_paths
        self._key_digest = _digest(policy.api_key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        problem = self._problem(headers.get("authorization"), headers.get("x-api-key"))
        if problem is None:
            await self.app(scope, receive, send)
            return
        if scope["path"].startswith(ANTHROPIC_PATH_PREFIX):
            body = messages_response.error_body(401, problem)
        else:
            body = ApiError(401, problem, code="invalid_api_key").body()
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(
            scope, receive, send
        )

    def _problem(self, authorization: str | None, x_api_key: str | None) -> str | None:
        """Why the request is refused (never quoting what it sent), or None when either header
        holds the key."""
        if authorization is None and x_api_key is None:
            return (
                "this server needs an API key: send it as the header `Authorization: Bearer YOUR_KEY` "
                "or `x-api-key: YOUR_KEY`"
            )
        # Both digests are compared whatever the first gives, so the time taken tells nothing.
        bearer = self._is_key(authorization.partition(" ")[2]) if authorization is not None else False
        scheme_ok = authorization is None or authorization.partition(" ")[0].lower() == "bearer"
        header_key = self._is_key(x_api_key) if x_api_key is not None else False
        if (bearer and scheme_ok) or header_key:
            return None
        if x_api_key is not None:
            return "the API key in the x-api-key header is not this server's key"
        if not scheme_ok:
            return "the Authorization header must use the Bearer scheme: `Authorization: Bearer YOUR_KEY`"
        return "the API key in the Authorization header is not this server's key"

    def _is_key(self, sent: str) -> bool:
        # Starlette decodes header values as latin-1, so this gives back the bytes that were sent.
        return hmac.compare_digest(_digest(sent.strip().encode("latin-1")), self._key_digest)


class CorsForAllowedOrigins:
    """Starlette's CORSMiddleware for requests from an allowed origin; any other request passes
    by untouched, so a preflight from another origin gets no CORS header at all (Starlette's own
    would answer it 400 with the allowed methods). Allowed origins may also reach a server on a
    private address (Chrome's Private Network Access): listing them is the consent it asks for."""

    def __init__(self, app: ASGIApp, origins: tuple[str, ...]):
        self.app = app
        self.origins = frozenset(origins)
        self.cors = CORSMiddleware(
            app,
            allow_origins=origins,
            allow_methods=CORS_METHODS,
            allow_headers=["*"],
            allow_private_network=True,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origin = Headers(scope=scope).get("origin") if scope["type"] == "http" else None
        if origin is not None and (ANY_ORIGIN in self.origins or origin in self.origins):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()
