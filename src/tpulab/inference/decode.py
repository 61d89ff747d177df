"""Prefill and decode for a trained Transformer, reusing its own blocks, projections and attention.

``forward_cached`` runs T new tokens from position ``start`` through ``Block.apply`` with an
attention that writes this step's keys/values into the cache and attends over the whole
(dequantized) cache under the causal mask. Prefill is that function on a prompt padded to the
cache length (one shape: one compile); decode is that function on one token.

Weights are an *argument* of the pure functions (a flat ``{name: array}`` dict), not constants:
one weights file serves all six exported endpoints, and a checkpoint's weights can be checked
against, or swapped under, the compiled computation.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpulab.inference import cache as kv
from tpulab.model.transformer import Transformer, causal_mask

Params = dict[str, jax.Array]


def _name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")


class Engine(Protocol):
    """What generation needs: jitted here, or deserialized jax.export endpoints (``export.py``)."""

    policy: str
    max_len: int
    batch: int

    def prefill(self, tokens_bs, length) -> tuple[jax.Array, kv.KVCache]: ...

    def decode(self, cache: kv.KVCache, token_b, pos) -> tuple[jax.Array, kv.KVCache]: ...


class ModelFns:
    """Pure functions of (params, ...) for one model structure; the structure is static."""

    def __init__(self, model: Transformer):
        self.cfg, self.prec = model.cfg, model.prec
        self.graphdef, state = nnx.split(model)
        paths, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        self.names = [_name(p) for p, _ in paths]
        self.params: Params = {n: x for n, (_, x) in zip(self.names, paths)}
        self.shape = kv.CacheShape.of(self.cfg)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.prec.compute_dtype)

    def model(self, params: Params) -> Transformer:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, [params[n] for n in self.names]))

    def full_logits(self, params: Params, tokens_bt: jax.Array) -> jax.Array:
        """The training forward (no cache), deterministic: the reference every cached path is judged by."""
        return self.model(params)(tokens_bt)

    def forward_cached(self, params: Params, cache: kv.KVCache, tokens_bt: jax.Array,
                       start) -> tuple[jax.Array, kv.KVCache]:
        """Logits [B, T, V] for tokens at positions start..start+T-1, and the cache with them written."""
        model = self.model(params)
        b, t = tokens_bt.shape
        positions_bt = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
        mask_bts = jnp.broadcast_to(causal_mask(t, self.shape.max_len, start), (b, t, self.shape.max_len))
        x_btd = model.embed(tokens_bt)
        for layer, block in enumerate(model.blocks):
            def attn_fn(h_btd, block=block, layer=layer, cache=cache):
                q, k, v = block.attn.project_qkv(h_btd, positions_bt)
                cache = kv.write(cache, layer, k, v, start)
                k_all, v_all = kv.read(cache, layer, q.dtype)
                return block.attn.attend(q, k_all, v_all, mask_bts, deterministic=True, rngs=None), cache

            x_btd, cache = block.apply(x_btd, attn_fn, deterministic=True, rngs=None)
        return model.logits(x_btd), cache

    def prefill(self, policy: str, params: Params, tokens_bs: jax.Array, length: jax.Array):
        """tokens [B, S] (the prompt in slots 0..length-1, anything after) -> (next-token logits [B, V], cache)."""
        cache = self.shape.init(policy, tokens_bs.shape[0])
        logits_bsv, cache = self.forward_cached(params, cache, tokens_bs, 0)
        return jax.lax.dynamic_index_in_dim(logits_bsv, length - 1, axis=1, keepdims=False), cache

    def decode(self, params: Params, cache: kv.KVCache, token_b: jax.Array, pos: jax.Array):
        """One token at position ``pos`` -> (logits [B, V], cache with slot ``pos`` written)."""
        logits_b1v, cache = self.forward_cached(params, cache, token_b[:, None], pos)
        return logits_b1v[:, 0], cache

    def example_args(self, endpoint: str, policy: str, batch: int) -> tuple:
        """Abstract arguments of an endpoint (for jax.export and input checks)."""
        sds = jax.ShapeDtypeStruct
        params = {n: sds(x.shape, x.dtype) for n, x in self.params.items()}
        scalar = sds((), jnp.int32)
        if endpoint == "prefill":
            return params, sds((batch, self.shape.max_len), jnp.int32), scalar
        cache = jax.eval_shape(functools.partial(self.shape.init, policy, batch))
        return params, cache, sds((batch,), jnp.int32), scalar


class Decoder:
    """Jitted prefill/decode for one model, one cache policy and the model's own weights.

    Each compiles once (fixed shapes); decode donates the cache so XLA updates it in place.
    """

    def __init__(self, fns: ModelFns, policy: str, params: Params | None = None):
        self.fns, self.policy = fns, kv.check_policy(policy)
        self.params = fns.params if params is None else params
        self.max_len = fns.shape.max_len
        self.batch = 1  # generation batch; the jitted functions accept any batch
        self._prefill = jax.jit(functools.partial(fns.prefill, policy))
        self._decode = jax.jit(fns.decode, donate_argnums=(1,))

    @classmethod
    def of(cls, model: Transformer, policy: str) -> "Decoder":
        return cls(ModelFns(model), policy)

    def prefill(self, tokens_bs, length):
        return self._prefill(self.params, jnp.asarray(tokens_bs, jnp.int32), jnp.asarray(length, jnp.int32))

    def decode(self, cache, token_b, pos):
        return self._decode(self.params, cache, jnp.asarray(token_b, jnp.int32), jnp.asarray(pos, jnp.int32))

    def compiled_variants(self) -> dict[str, int]:
        """How many executables each jitted endpoint holds (1 each: no recompiles while decoding)."""
        return {"prefill": self._prefill._cache_size(), "decode": self._decode._cache_size()}


def pad_prompt(ids: np.ndarray, max_len: int, batch: int = 1) -> np.ndarray:
    from tpulab.data.tokenizer import PAD

    out = np.full((batch, max_len), PAD, np.int32)
    out[:, : len(ids)] = ids
    return out
