"""The FastAPI application: routes, error handlers, middleware, and the engine thread's lifetime.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id},
POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter (LoRA adapters, see lora_routes),
GET /health (200 while the engine runs and the server accepts work, else 503), GET /metrics
(Prometheus text format), and vLLM's POST /tokenize, POST /detokenize, GET /version.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from octavo import __version__
from octavo.errors import WorkerFailedError
from octavo.serve import chat, completions, lora_routes, tokenize_routes
from octavo.serve.async_engine import AsyncEngine, EngineDeadError
from octavo.serve.context import ServerContext, ServerSettings
from octavo.serve.errors import APIError, install_error_handlers
from octavo.serve.middleware import RequestBodyLimit, ServerMiddleware

logger = logging.getLogger(__name__)


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The server for `engine`; the engine thread starts and stops with the app's lifespan."""
    context = ServerContext(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await engine.stop()
            context.encoder.shutdown()

    app = FastAPI(title="Octavo", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions over an Octavo artifact.")
    app.state.context = context
    install_error_handlers(app)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, error: EngineDeadError) -> JSONResponse:
        return APIError(503, str(error), "service_unavailable", headers={"Retry-After": "1"}).response()

    @app.exception_handler(WorkerFailedError)
    async def worker_failed(request: Request, error: WorkerFailedError) -> JSONResponse:
        # A rank died while a command of this request ran on the engine thread (not inside a step).
        return APIError(503, str(error), "service_unavailable", headers={"Retry-After": "1"}).response()

    app.add_middleware(RequestBodyLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(ServerMiddleware, metrics=context.metrics, api_key=settings.api_key)  # outermost
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(tokenize_routes.router)
    app.include_router(lora_routes.router)
    _add_service_routes(app, context)
    return app


def _add_service_routes(app: FastAPI, context: ServerContext) -> None:
    engine = context.engine

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.is_alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        if context.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(context.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_card(context), *lora_routes.adapter_cards(context)]})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> JSONResponse:
        adapter = context.check_model(model)
        if adapter is not None:
            return JSONResponse(next(card for card in lora_routes.adapter_cards(context) if card["id"] == adapter))
        return JSONResponse(_model_card(context))


def _model_card(context: ServerContext) -> dict:
    """OpenAI's model object, plus vLLM's `max_model_len` and the vocabulary size (for load generators)."""
    engine = context.engine.engine
    return {"id": context.settings.model_name, "object": "model", "created": context.created,
            "owned_by": "octavo", "root": context.settings.model_name, "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size}


def begin_drain(app: FastAPI, grace_period_s: float) -> None:
    """Stop admitting requests; abort those still running after `grace_period_s`. Call on the loop."""
    context: ServerContext = app.state.context
    if context.draining:
        return
    context.draining = True
    logger.warning("shutting down: finishing in-flight requests (grace period %.0fs)", grace_period_s)
    asyncio.get_running_loop().call_later(grace_period_s, context.engine.abort_all)
