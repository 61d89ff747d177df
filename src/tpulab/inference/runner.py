"""The Engine over deserialized jax.export endpoints: what ``generate`` and ``serve`` run.

Built by ``ArtifactSet.engine`` from a set that ``artifacts.open_artifacts`` has checked; every
call's inputs are checked against the endpoint's signature first (``check_inputs``), so a wrong
shape or dtype is one line, not an XLA error.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np

from tpulab.inference.artifact_format import LOOP, artifact_name, check_inputs
from tpulab.model.decode import Buckets


class ExportedEngine(Buckets):
    """The Engine interface (``decode.Engine``) over one cache policy's three endpoints."""

    def __init__(
        self,
        root: Path,
        policy: str,
        exported: Mapping[str, jax.export.Exported],
        params: dict[str, np.ndarray],
        max_len: int,
        batch: int,
    ):
        self.root, self.policy, self.max_len, self.batch = root, policy, max_len, batch
        self._prefill = exported[artifact_name("prefill", policy)]
        self._decode = exported[artifact_name("decode", policy)]
        self._loop = exported[artifact_name(LOOP, policy)]
        self._loop_jit = jax.jit(self._loop.call)  # one executable per batch bucket
        self._host_params = params  # what inputs are checked against (no device round trip)
        self._params = jax.device_put(params)

    def _call(self, exp, name, *args):
        check_inputs(self.root, name, exp, (self._host_params, *args))
        return exp.call(self._params, *args)

    def prefill(self, tokens_bs, length):
        return self._call(self._prefill, artifact_name("prefill", self.policy), tokens_bs, length)

    def decode(self, cache, token_b, pos):
        return self._call(self._decode, artifact_name("decode", self.policy), cache, token_b, pos)

    def generate(
        self, tokens_bs, lengths_b, max_new_b, temperature_b, top_k_b, keys_b2, stop_token
    ):
        args = (tokens_bs, lengths_b, max_new_b, temperature_b, top_k_b, keys_b2, stop_token)
        check_inputs(
            self.root, artifact_name(LOOP, self.policy), self._loop, (self._host_params, *args)
        )
        return self._loop_jit(self._params, *args)

    def compiled_variants(self) -> dict[str, int]:
        """Executables the jitted loop holds (one per batch and width bucket); prefill and decode
        run through ``Exported.call`` and are not counted."""
        return {LOOP: self._loop_jit._cache_size()}
