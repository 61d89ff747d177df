"""HTTP generation service over verified exported endpoints (FastAPI + uvicorn).

Startup refuses artifacts that fail the hash/platform/pairing checks or lack a passing
``verify-export`` record for this exact manifest. Warm-up (one prefill and decode per cache
policy, which compiles them) runs in the background; /healthz answers 503 until it is done.
Requests are validated by a pydantic contract (4xx with a reason otherwise) and run one at a
time under a lock: generation is a host loop over one device, so queuing is the honest schedule.
"""

from __future__ import annotations

import sys
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tpulab.data.tokenizer import VOCAB_SIZE
from tpulab.errors import TpulabError
from tpulab.inference import cache as kv
from tpulab.inference.export import open_artifacts, require_verified
from tpulab.inference.generate import SamplingConfig, generate_ids, generate_text, prompt_ids

MAX_PROMPT_CHARS = 4096  # coarse bound before encoding; the real bound is the model's positions


class GenerateRequest(BaseModel):
    """POST /v1/generate body. Unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(max_length=MAX_PROMPT_CHARS)
    max_new: int = Field(32, ge=1)
    temperature: float = Field(0.8, ge=0.0, le=10.0)
    top_k: int = Field(0, ge=0, le=VOCAB_SIZE)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    cache: Literal["fp32", "bf16", "int8"] = "fp32"


class Service:
    """The loaded artifact set, one engine per cache policy, and readiness."""

    def __init__(self, artifacts: str | Path):
        self.art = open_artifacts(artifacts)
        self.verification = require_verified(self.art)
        self.engines = {p: self.art.engine(p) for p in kv.POLICIES}
        self.ready = threading.Event()
        self.lock = threading.Lock()
        self.warmup_error: str | None = None

    def warm_up(self) -> None:
        try:
            with self.lock:
                for engine in self.engines.values():
                    list(generate_ids(engine, "", SamplingConfig(max_new=2, temperature=0.0)))
            self.ready.set()
        except Exception as e:  # not swallowed: logged, and /healthz reports it while staying not-ready
            self.warmup_error = f"{type(e).__name__}: {e}"
            print(f"error: warm-up failed: {self.warmup_error}", file=sys.stderr, flush=True)

    def generate(self, req: GenerateRequest) -> dict:
        try:
            cfg = SamplingConfig(max_new=req.max_new, temperature=req.temperature, top_k=req.top_k, seed=req.seed)
            prompt_ids(req.prompt, self.art.max_len, req.max_new)
        except TpulabError as e:
            raise HTTPException(status_code=422, detail=str(e)) from None
        with self.lock:
            text = "".join(generate_text(self.engines[req.cache], req.prompt, cfg))
        return {"text": text, "prompt": req.prompt, "max_new": req.max_new, "cache": req.cache,
                "seed": req.seed, "manifest_sha256": self.art.manifest_sha256}


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=service.warm_up, name="warm-up", daemon=True).start()
        yield

    app = FastAPI(title="tpulab generate", lifespan=lifespan)

    @app.get("/healthz")
    def healthz():
        if service.ready.is_set():
            return {"status": "ready"}
        status = f"warm-up failed: {service.warmup_error}" if service.warmup_error else "warming up"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/v1/model")
    def model():
        return service.art.identity()

    @app.post("/v1/generate")
    def generate(req: GenerateRequest):
        if not service.ready.is_set():
            raise HTTPException(status_code=503, detail="warming up")
        return service.generate(req)

    return app


def serve(artifacts: str | Path, host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    service = Service(artifacts)  # raises TpulabError before anything listens
    print(f"serving {service.art.root} (manifest {service.art.manifest_sha256[:12]}, "
          f"checkpoint step {service.art.manifest['source']['checkpoint_step']}) on http://{host}:{port}", flush=True)
    uvicorn.run(create_app(service), host=host, port=port, log_level="warning")
