"""A /v1/generate request, from bytes to a validated generation request.

The body is read with a bound (``read_body``: more than ``MAX_BODY_BYTES`` is refused without
reading it all), parsed here (UTF-8, JSON without NaN/Infinity/overflowing numbers), typed by a
pydantic contract (``GenerateBody``) and validated by ``sampling`` (the bounds the CLI uses too);
every refusal is a ``TpulabError`` the service answers as a 4xx with the reason.
"""

from __future__ import annotations

import json
import math
from typing import Annotated

from fastapi import Request as HttpRequest
from pydantic import BaseModel, ConfigDict, StringConstraints, ValidationError

from tpulab.errors import TpulabError
from tpulab.inference.config import MAX_BODY_BYTES
from tpulab.inference.generate import Request as GenerationRequest
from tpulab.model.policies import Policy
from tpulab.model.sampling import SamplingConfig


class GenerateBody(BaseModel):
    """POST /v1/generate body: types only (the bounds are sampling's); unknown fields refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    prompt: str
    max_new: int = 32
    temperature: float = 0.8
    top_k: int = 0
    seed: int = 0
    cache: Policy = "fp32"
    # The registered prompt template version the prompt was rendered from, when the client names
    # one: recorded in the trace next to the sha256 of the prompt actually served.
    prompt_version: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = None


def _reject_constant(name: str):
    raise TpulabError(f"request holds the non-finite number {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise TpulabError(f"request holds the number {text[:32]}, which is not finite in float64")
    return value


def too_large(n: int) -> str:
    return f"request body is {n} bytes, at most {MAX_BODY_BYTES}"


def parse_request(body: bytes, max_len: int) -> tuple[GenerateBody, GenerationRequest]:
    """POST body -> (its typed fields, the validated generation request); TpulabError says why."""
    if len(body) > MAX_BODY_BYTES:
        raise TpulabError(too_large(len(body)))
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TpulabError(f"request body is not UTF-8 (bad byte at offset {e.start})") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # bad JSON, huge ints, nesting past the stack
        raise TpulabError(
            f"request body is not valid JSON ({str(e).splitlines()[0][:120]})"
        ) from None
    try:
        req = GenerateBody.model_validate(obj)
    except ValidationError as e:
        errs = e.errors(include_url=False, include_input=False, include_context=False)
        reasons = [f"{'.'.join(map(str, x['loc'])) or 'body'}: {x['msg']}" for x in errs[:4]]
        raise TpulabError("; ".join(reasons)) from None
    sampling = SamplingConfig(
        max_new=req.max_new, temperature=req.temperature, top_k=req.top_k, seed=req.seed
    )
    return req, GenerationRequest.of(req.prompt, sampling, max_len)


class BodyTooLarge(Exception):
    pass


async def read_body(request: HttpRequest) -> bytes:
    """The request body, refusing more than MAX_BODY_BYTES without reading them all."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLarge(int(declared))
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > MAX_BODY_BYTES:
            raise BodyTooLarge(n)
        chunks.append(chunk)
    return b"".join(chunks)
