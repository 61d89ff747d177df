"""The HTTP face of the service: routes, request ids, and the uvicorn server that runs it.

Every response carries ``X-Request-ID`` (the client's, when it sent a sane one) and every JSON
body its ``request_id``. ``run_server`` listens at once (``/livez`` 200 from the first moment)
and stops on SIGTERM/SIGINT (drained: ``Service.begin_drain``; uvicorn re-raises the signal after
its graceful shutdown, which made a drained stop exit 143, so ``Server`` keeps it), when the
service's bring-up failed (exit 1 at once: nothing would make it ready) or when it is not ready
``ready_timeout_s`` after start (exit 1).

The stop, in order: readiness turns 503; the listener stays open ``LINGER_S`` longer, so that
every connection the kernel has accepted is read and answered (503 with Retry-After, or the
answer of a request already running) rather than closed unread (uvicorn closes a connection
whose request it has not parsed: 2 of 8 concurrent requests were dropped that way); then it
closes and the requests in flight drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tpulab.errors import ExitCode, TpulabError
from tpulab.inference.config import LINGER_S
from tpulab.inference.serve import Service
from tpulab.inference.serve_stop import StopSignals
from tpulab.inference.serve_telemetry import CLIENT_CLOSED

if TYPE_CHECKING:
    import uvicorn

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")

_ROUTES = ("/livez", "/readyz", "/healthz", "/metrics", "/v1/model", "/v1/stats", "/v1/generate")


def request_id(scope) -> str:
    return scope["tpulab.request_id"]


class _Edge:
    """ASGI middleware: a request id on every request (the client's ``X-Request-ID`` when it is
    1-64 of [A-Za-z0-9._:-], else a fresh uuid4), echoed in the response header, and the request
    counter by path and status."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope["tpulab.request_id"] = rid
        status = [CLIENT_CLOSED]  # what is counted when no response starts (the client left)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = scope["path"] if scope["path"] in _ROUTES else "other"
            self.service.metrics.requests.labels(path, str(status[0])).inc()


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        yield
        service.close()

    app = FastAPI(title="tpulab generate", lifespan=lifespan)
    app.add_middleware(_Edge, service=service)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, exc: StarletteHTTPException):
        return JSONResponse(
            {"detail": exc.detail, "request_id": request_id(request.scope)},
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.get("/livez")
    async def livez(request: HttpRequest):
        return {"status": "live", "request_id": request_id(request.scope)}

    def readiness(request: HttpRequest):
        rid = request_id(request.scope)
        if service.ready.is_set() and not service.draining:
            return {"status": "ready", **service.readiness_report(), "request_id": rid}
        status = "stopping" if service.draining else f"not ready: {service.not_ready_reason()}"
        return JSONResponse(
            {"status": status, "stage": service.stage, "request_id": rid},
            status_code=503,
            headers={"Retry-After": str(service.cfg.retry_after_s)},
        )

    app.get("/readyz")(readiness)
    app.get("/healthz")(readiness)  # the older name, kept for its callers

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/model")
    async def model(request: HttpRequest):
        rid = request_id(request.scope)
        if service.model is None:
            return JSONResponse(
                {"detail": f"no model loaded: {service.not_ready_reason()}", "request_id": rid},
                status_code=503,
            )
        return {**service.model_info(), "request_id": rid}

    @app.get("/v1/stats")
    async def stats(request: HttpRequest):
        return {
            "batches": {str(k): v for k, v in sorted(service.batcher.batches.items())},
            "queued": len(service.batcher.queue),
            "compiled_variants": service.compiled_variants(),
            "request_id": request_id(request.scope),
        }

    @app.post("/v1/generate")
    async def generate(request: HttpRequest):
        return await service.generate(request, request_id(request.scope))

    return app


def _server_class():  # built on first use: uvicorn is imported only by a server
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a drained stop is a success (uvicorn re-raises the caught
        signal after its graceful shutdown: the process died of SIGTERM, exit 143), the service
        learns when the drain begins, and a server whose bring-up failed, or that is not ready in
        time, stops."""

        def __init__(self, config: uvicorn.Config, service: Service, stop: StopSignals):
            super().__init__(config)
            self.service, self.stop = service, stop
            self.overdue = self.failed = False

        @contextlib.contextmanager
        def capture_signals(self):
            """The caller's latch, already installed, now tells this server; a signal that came
            before it ran stops it at once."""
            self.stop.on_signal = self._on_signal
            if self.stop.received:
                self.should_exit = True
            try:
                yield
            finally:  # a signal while the process leaves is recorded, never "at once"
                self.stop.on_signal = lambda sig: None

        def _on_signal(self, sig):
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting
            self.should_exit = True

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                host, port = self.config.host, self.servers[0].sockets[0].getsockname()[1]
                cache = self.service.cache_dir
                print(
                    f"listening on http://{host}:{port} (live now; ready once "
                    f"{self.service.describe} is verified, its first path compiled and has "
                    f"answered a probe; compilation cache {cache or 'off'})",
                    flush=True,
                )

        async def on_tick(self, counter: int) -> bool:
            if not self.should_exit and self.service.failed():
                self.failed = self.should_exit = True
            elif not self.should_exit and self.service.overdue():
                self.overdue = self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None):
            self.service.begin_drain(self.service.cfg.drain_timeout_s)
            await asyncio.sleep(LINGER_S)  # readiness is 503; what the kernel accepted is read
            await super().shutdown(sockets)

    return Server


def run_server(
    service: Service, host: str = "127.0.0.1", port: int = 8000, stop: StopSignals | None = None
) -> None:
    """Serve until SIGTERM/SIGINT (drained: returns), until bring-up fails (TpulabError, exit 1,
    at once) or until the ready deadline passes unready (TpulabError, exit 1); the service is
    closed after. ``stop``: the caller's signal latch, installed early (``serve_stop``); without
    one, a latch is installed here in the main thread and no signal is caught in another."""
    import uvicorn

    own = stop is None
    stop = stop or StopSignals().install()
    try:
        if stop.received:
            print(f"stopped before listening ({stop.names()})", flush=True)
            return
        _run(uvicorn, service, host, port, stop)
    finally:
        service.close()
        if own:
            stop.restore()


def _run(uvicorn, service: Service, host: str, port: int, stop: StopSignals) -> None:

    config = uvicorn.Config(
        create_app(service),
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=service.cfg.http_drain_s(),
    )
    server = _server_class()(config, service, stop)
    server.run()
    if server.failed:
        raise TpulabError(
            f"not ready ({service.describe}): {service.failure}", exit_code=ExitCode.FAILED
        )
    if server.overdue:
        raise TpulabError(
            f"not ready within {service.cfg.ready_timeout_s:g} s: {service.not_ready_reason()}",
            exit_code=ExitCode.FAILED,
        )
    d = service.drain
    print(
        f"stopped ({stop.names() or 'shutdown'}, {service.stage}): {d['answered']} request(s) "
        f"answered and {d['cut']} cut at the bound while draining ({d['in_flight_at_stop']} in "
        "flight at the signal)",
        flush=True,
    )
