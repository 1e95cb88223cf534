"""The HTTP surface (FastAPI): the app, its middleware and error handlers, and every
endpoint's routes (one serving module per endpoint, under router/endpoints/).

Every error leaves as an OpenAI error body (router/http/errors.py). A request is prepared
(validated, tokenized) before any worker is involved; a streamed response starts only once
its first update has arrived (router/generation/run.py: `answer`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.call import WorkerFailed
from router.endpoints.admin.serving import add_admin_routes, dev_endpoints_enabled
from router.endpoints.chat.serving import add_chat_routes
from router.endpoints.completions.serving import add_completion_routes
from router.endpoints.embeddings.serving import add_embedding_routes
from router.endpoints.loras.serving import add_lora_routes, runtime_updates_allowed
from router.endpoints.models.serving import add_model_routes
from router.endpoints.responses.serving import add_responses_routes
from router.endpoints.tokenize.serving import add_tokenize_routes
from router.http.dashboard import add_dashboard_routes
from router.http.errors import REQUEST_ID, APIError, worker_failed
from router.http.limits import RequestLimits
from router.http.middleware import AuthAndCount
from router.http.openapi import install_openapi
from router.services import Services

log = logging.getLogger(__name__)


def create_app(services: Services) -> FastAPI:
    app = FastAPI(title="pdserve router", lifespan=services.lifespan)
    app.add_middleware(RequestLimits, limits=services.config.limits)  # inside the next one
    app.add_middleware(AuthAndCount, services=services)
    install_openapi(app)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(WorkerFailed)  # a route's workers failed: details to the log only
    async def _worker_failed(request: Request, exc: WorkerFailed) -> Response:
        return worker_failed(request.scope.get(REQUEST_ID, "-"), exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)  # the detail stays here
        return APIError(500, "internal server error").response()

    add_model_routes(app, services)
    add_tokenize_routes(app, services)
    add_embedding_routes(app, services)
    add_dashboard_routes(app, services)
    add_responses_routes(app, services)
    add_lora_routes(app, services.loras, runtime_updates_allowed(services.config.enable_lora))
    if dev_endpoints_enabled(services.config.enable_dev_endpoints):
        add_admin_routes(app, services.admin)
    add_completion_routes(app, services)
    add_chat_routes(app, services)
    return app
