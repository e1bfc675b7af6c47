"""The HTTP layer: thin Starlette routes over `server.serving.Service`.

Contract: `create_app(service)` returns the ASGI app with GET /v1/models (and /v1/models/{id}: any
name, since every name is served by the loaded model), POST /v1/chat/completions,
POST /v1/completions, POST /v1/responses (stateless, over the chat path: server.responses_api),
GET /health, GET /metrics and POST /admin/reload-index (see server.reload; 409 in the error shape
when the rebuilt index is refused). Every error, from validation to an unexpected
exception, is answered in the one OpenAI shape `{"error": {"message", "type", "param", "code"}}`;
an unexpected exception is logged with its trace server-side and the client gets a generic 500.
When `service.settings.api_key` is set, /v1/* and /admin/* require `Authorization: Bearer KEY` (401 otherwise);
/health and /metrics stay open. POST /v1/messages and /v1/messages/count_tokens are Anthropic's Messages API
(server.anthropic_api): there every error, 401 and 404 included, is in Anthropic's shape, and `x-api-key: KEY`
is accepted as well as the Bearer header. With `settings.cors_origins` (`--cors-origins`: comma-separated
origins, or `*`) Starlette's CORSMiddleware wraps everything, authentication included, so a browser's
preflight (OPTIONS, which carries no key) gets a 200 with the CORS headers (methods GET/POST/OPTIONS;
headers Authorization, Content-Type, x-api-key, anthropic-version); without it no CORS header is sent and
OPTIONS is a 405. Tests and benchmarks serve it on a thread with bench.live_server.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from server import anthropic_api
from server.protocol import (MAX_BODY_BYTES, APIError, ChatCompletionRequest, CompletionRequest, error_body,
                             model_entry, model_list, parse_body)
from server.reload import ReloadStatus
from server.responses_api import ResponsesRequest, create_response
from server.serving import Service

log = logging.getLogger("sailfish.app")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CORS_METHODS = ("GET", "POST", "OPTIONS")
CORS_HEADERS = ("Authorization", "Content-Type", "x-api-key", "anthropic-version")


def _error(status: int, message: str, type: str, param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


async def _json_body(request: Request):
    """The decoded body (server.protocol.parse_body), read no further than its size limit."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body has {declared} bytes; the limit is {MAX_BODY_BYTES}", None,
                       "request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(413, f"the request body exceeds the limit of {MAX_BODY_BYTES} bytes", None,
                               "request_too_large")
            chunks.append(chunk)
    except ClientDisconnect as e:   # the client went away mid-upload: its error, not the server's (no 500)
        raise APIError(499, "the client disconnected while sending the request body", None,
                       "client_disconnected") from e
    return parse_body(b"".join(chunks))


def _respond(result) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers=_SSE_HEADERS)


def _openai_error(error: APIError) -> Response:
    return JSONResponse(error.body(), status_code=error.status)


def _guarded(handler, metrics, answer=_openai_error, logger=log):
    """Answer APIError and any unexpected exception in the error shape `answer` gives an APIError
    (OpenAI's; server.anthropic_api passes Anthropic's). Handled here rather than by Starlette's
    server-error middleware, which re-raises and makes uvicorn drop the connection. An unexpected
    exception is logged to `logger` with its traceback, counted (`sailfish_internal_errors_total`)
    and answered with a generic 500."""
    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            response = answer(e)
            response.headers.update(e.headers)
            return response
        except Exception:
            logger.exception("unhandled error on %s %s", request.method, request.url.path)
            metrics.internal_error()
            return answer(APIError(500, "internal server error (details are in the server log)",
                                   code="internal_error", type="server_error"))
    return route


def create_app(service: Service) -> Starlette:
    async def chat_completions(request: Request) -> Response:
        req = ChatCompletionRequest.parse(await _json_body(request), service.sampling_defaults)
        return _respond(await service.chat(req, request.receive))

    async def completions(request: Request) -> Response:
        req = CompletionRequest.parse(await _json_body(request), service.sampling_defaults)
        return _respond(await service.complete(req, request.receive))

    async def responses(request: Request) -> Response:
        req = ResponsesRequest.parse(await _json_body(request), service.sampling_defaults)
        return _respond(await create_response(service, req, request.receive))

    async def models(request: Request) -> Response:
        return JSONResponse(model_list(service.model_id, service.created, service.engine.max_context))

    async def model(request: Request) -> Response:
        # Every model name is served by the loaded model (requests' `model` only labels the reply), so
        # any name a client retrieves is the loaded model under that name.
        return JSONResponse(model_entry(request.path_params["model_id"], service.created, service.engine.max_context))

    async def health(request: Request) -> Response:
        return JSONResponse(service.health())

    async def metrics(request: Request) -> Response:
        text = service.metrics.render(service.scheduler.waiting, service.scheduler.running,
                                      service.engine.prefix_summary(), service.engine.batch_summary(),
                                      service.prompt_tokens.summary())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def reload_index(request: Request) -> Response:
        result = await asyncio.to_thread(service.reload_index)
        if result.status is ReloadStatus.REFUSED:
            return _error(409, result.message, "invalid_request_error", None, "index_refused")
        return JSONResponse({"reloaded": result.status is ReloadStatus.RELOADED, "message": result.message})

    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if anthropic_api.serves(request.url.path):
            return anthropic_api.error_response(exc.status_code, message)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, message, kind)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.scheduler.start()
        try:
            yield
        finally:
            service.scheduler.stop()

    guard = lambda handler: _guarded(handler, service.metrics)
    routes = [
        Route("/v1/models", guard(models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", guard(model), methods=["GET"]),
        Route("/v1/chat/completions", guard(chat_completions), methods=["POST"]),
        Route("/v1/completions", guard(completions), methods=["POST"]),
        Route("/v1/responses", guard(responses), methods=["POST"]),
        Route("/health", guard(health), methods=["GET"]),
        Route("/metrics", guard(metrics), methods=["GET"]),
        Route("/admin/reload-index", guard(reload_index), methods=["POST"]),
        *anthropic_api.routes(service, _json_body, functools.partial(_guarded, metrics=service.metrics)),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error})
    return _with_cors(_BearerAuth(app, service.settings.api_key), service.settings.cors_origins)


def cors_origin_list(setting: str | None) -> list[str]:
    """`--cors-origins` as a list: comma-separated origins (blanks dropped), `*` for any; [] for none."""
    return [origin.strip() for origin in (setting or "").split(",") if origin.strip()]


def _with_cors(app, setting: str | None):
    """`app` wrapped in CORSMiddleware for the configured origins (outermost, so preflights need no key);
    `app` itself when none are configured."""
    origins = cors_origin_list(setting)
    if not origins:
        return app
    return CORSMiddleware(app, allow_origins=origins, allow_methods=list(CORS_METHODS),
                          allow_headers=list(CORS_HEADERS))


class _BearerAuth:
    """ASGI wrapper: /v1/* needs `Authorization: Bearer KEY` when a key is configured; the Messages API
    also takes `x-api-key: KEY` (Anthropic's header) and answers a 401 in its own shape."""

    def __init__(self, app, api_key: str | None):
        self.app, self.expected = app, f"Bearer {api_key}".encode() if api_key else None
        self.key = api_key.encode() if api_key else None

    def _authorized(self, headers: dict, messages_api: bool) -> bool:
        if hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            return True
        return messages_api and hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if self.expected and scope["type"] == "http" and path.startswith(("/v1/", "/admin/")):
            messages_api = anthropic_api.serves(path)
            if not self._authorized(dict(scope["headers"]), messages_api):
                response = (anthropic_api.error_response(401, "invalid x-api-key: send `x-api-key: KEY` or "
                                                              "`Authorization: Bearer KEY`") if messages_api else
                            _error(401, "Incorrect or missing API key: send `Authorization: Bearer KEY`.",
                                   "invalid_request_error", None, "invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
