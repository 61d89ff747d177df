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

from tpulab.errors import TpulabError
from tpulab.model import kvcache as kv
from tpulab.model.transformer import Transformer, causal_mask

Params = dict[str, jax.Array]


def _attend_one(attn, q_b1hd, kt_xds, v_xsd, visible_bs) -> jax.Array:
    """``Attention.attend`` for one query per row over a loop-layout cache (keys [B*H, Dh, S],
    values [B*H, S, Dh], visible where ``visible_bs``): both products are plain batched GEMMs;
    returns [B, 1, D]."""
    acc = attn.prec.accum_dtype
    b, _, h, d = q_b1hd.shape
    scores_x1s = jnp.einsum(
        "xtd,xds->xts", q_b1hd.reshape(b * h, 1, d), kt_xds, preferred_element_type=acc
    )
    e_bhs, sum_bh = attn.softmax_parts(scores_x1s.reshape(b, h, -1), visible_bs)
    out_x1d = jnp.einsum(
        "xts,xsd->xtd",
        e_bhs.reshape(b * h, 1, -1).astype(v_xsd.dtype),
        v_xsd,
        preferred_element_type=acc,
    )
    return attn.project_out(out_x1d / sum_bh.reshape(b * h, 1, 1), b, 1)


def _name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")


class Engine(Protocol):
    """What generation and the service call: ``Decoder`` (jitted here) or ``runner.ExportedEngine``
    (deserialized jax.export endpoints). ``batch`` is the step path's batch; the loop runs any
    batch at ``batch_for(n)`` rows and ``width_for(longest prompt)`` columns."""

    policy: str
    max_len: int
    batch: int

    def prefill(self, tokens_bs, length) -> tuple[jax.Array, kv.KVCache]: ...

    def decode(self, cache: kv.KVCache, token_b, pos) -> tuple[jax.Array, kv.KVCache]: ...

    def generate(
        self, tokens_bs, lengths_b, max_new_b, temperature_b, top_k_b, keys_b2, stop_token
    ) -> tuple[jax.Array, jax.Array]: ...

    def batch_for(self, n: int) -> int: ...

    def width_for(self, n: int) -> int: ...

    def compiled_variants(self) -> dict[str, int]:
        """Executables held, per jitted endpoint name ("generate": one per batch and width
        bucket)."""
        ...


class ModelFns:
    """Pure functions of (params, ...) for one model structure; the structure is static."""

    def __init__(self, model: Transformer):
        if not model.cfg.causal:  # an encoder's position t saw t+1..: it has no next-byte logits
            raise TpulabError(
                "model.causal=false: this model attends both ways (a masked-byte encoder) and "
                "cannot generate"
            )
        self.cfg, self.prec = model.cfg, model.prec
        self.graphdef, state = nnx.split(model)
        paths, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        self.names = [_name(p) for p, _ in paths]
        self.params: Params = {n: x for n, (_, x) in zip(self.names, paths)}
        self.shape = kv.CacheShape.of(self.cfg)

    def flat(self, state) -> Params:
        """This structure's ``{name: array}`` weights from an ``nnx.State`` of the same model (a
        training state's parameters), by name."""
        return {_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}

    @property
    def compute_dtype(self):
        return jnp.dtype(self.prec.compute_dtype)

    def model(self, params: Params) -> Transformer:
        return nnx.merge(
            self.graphdef, jax.tree.unflatten(self.treedef, [params[n] for n in self.names])
        )

    def full_logits(self, params: Params, tokens_bt: jax.Array) -> jax.Array:
        """The training forward (no cache), deterministic: the reference every cached path is
        judged by."""
        return self.model(params)(tokens_bt)

    def forward_cached(
        self,
        params: Params,
        cache: kv.KVCache,
        tokens_bt: jax.Array,
        start,
        last_b: jax.Array | None = None,
    ) -> tuple[jax.Array, kv.KVCache]:
        """Logits [B, T, V] for tokens at positions start..start+T-1, and the cache with them
        written; with ``last_b`` (one index per row) only those positions' logits, [B, V].

        Each block's attention writes its keys and values into the cache and attends over exactly
        what the cache stores (so every cache precision attends over what it keeps), masked
        causally. A prefill (``start`` the constant 0) attends over its own T keys only, since no
        query sees past them (a 64-token prompt on a 512-slot cache: 8x less than T x S), as
        computed, not read back from the buffer it just wrote (``kv.as_stored``: the same values
        without the round trip)."""
        b, t = tokens_bt.shape
        prefill = isinstance(start, int) and start == 0
        positions_bt = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
        s = t if prefill else self.shape.max_len
        mask_bts = jnp.broadcast_to(causal_mask(t, s, start), (b, t, s))
        model = self.model(params)
        x_btd = model.embed(tokens_bt)
        for layer, block in enumerate(model.blocks):

            def attn_fn(h_btd, block=block, layer=layer, cache=cache):
                q, k, v = block.attn.project_qkv(h_btd, positions_bt)
                cache = kv.write(cache, layer, k, v, start)
                if prefill:
                    k_all, v_all = kv.as_stored(cache, k, q.dtype), kv.as_stored(cache, v, q.dtype)
                else:
                    k_all, v_all = kv.read(cache, layer, q.dtype)
                return block.attn.attend(
                    q, k_all, v_all, mask_bts, deterministic=True, rngs=None
                ), cache

            x_btd, cache = block.apply(x_btd, attn_fn, deterministic=True, rngs=None)
        if last_b is not None:
            x_btd = jnp.take_along_axis(x_btd, last_b.astype(jnp.int32)[:, None, None], axis=1)
            return model.logits(x_btd)[:, 0], cache
        return model.logits(x_btd), cache

    def decode_rows(
        self, params: Params, cache: kv.KVCache, token_b: jax.Array, pos_b: jax.Array
    ) -> tuple[jax.Array, kv.KVCache]:
        """One token per row, row b at position ``pos_b[b]``, on a loop-layout cache
        (``kv.to_loop_layout``): logits [B, V] and the cache with each row's keys and values written
        at its slot.

        ``forward_cached``'s math for T = 1 (write this token's key and value, attend over slots <=
        pos) with a cache laid out for it: per layer, keys [B*H, Dh, S] and values [B*H, S, Dh], so
        attention is two plain batched GEMMs on the buffers where they lie and each update is in
        place (no per-step copy or transposition of any layer; see ``kv.to_loop_layout``).
        """
        model = self.model(params)
        positions_b1 = pos_b.astype(jnp.int32)[:, None]
        upto_bs = jnp.arange(self.shape.max_len)[None, :] <= positions_b1
        x_b1d = model.embed(token_b[:, None])
        for layer, block in enumerate(model.blocks):

            def attn_fn(h_b1d, block=block, layer=layer, cache=cache):
                q, k, v = block.attn.project_qkv(h_b1d, positions_b1)
                cache = kv.write_loop(cache, layer, k[:, 0], v[:, 0], pos_b)
                kt_all, v_all = kv.read(cache, layer, q.dtype)
                return _attend_one(block.attn, q, kt_all, v_all, upto_bs), cache

            x_b1d, cache = block.apply(x_b1d, attn_fn, deterministic=True, rngs=None)
        return model.logits(x_b1d)[:, 0], cache

    def prefill_rows(self, policy: str, params: Params, tokens_bs: jax.Array, lengths_b: jax.Array):
        """Ragged prefill: row b holds its prompt in slots 0..lengths_b[b]-1 (right-padded,
        positions from 0, causal mask), so each row computes exactly what it would alone; logits at
        each row's end."""
        cache = self.shape.init(policy, tokens_bs.shape[0])
        return self.forward_cached(params, cache, tokens_bs, 0, last_b=lengths_b - 1)

    def generate(
        self,
        policy: str,
        params: Params,
        tokens_bs: jax.Array,
        lengths_b: jax.Array,
        max_new_b: jax.Array,
        temperature_b: jax.Array,
        top_k_b: jax.Array,
        keys_b2: jax.Array,
        stop_token: jax.Array,
        *,
        logprobs: bool = False,
    ) -> tuple[jax.Array, ...]:
        """Prefill and every decode step as one program: a ``lax.while_loop`` sampling on device.

        ``tokens_bs`` is [B, P] with any P <= S (prompts right-padded to a width bucket, so prefill
        computes P positions, not S). Returns tokens [B, S] (row b's new tokens in columns 0..n_b-1,
        PAD after) and n [B]. A row stops after ``max_new_b`` tokens or after emitting
        ``stop_token`` (pass -1 for none); the loop ends when every row has stopped. Callers bound
        ``lengths_b + max_new_b <= S`` on the host; positions are clamped here so a stopped row can
        never write out of range.

        With ``logprobs`` (a trainer's rollouts; the exported endpoint never asks) it also returns
        [B, S] float32: each emitted token's log-probability under the distribution it was drawn
        from (``sampling.token_logprobs`` of the same logits), 0 after a row's last token.
        """
        from tpulab.data.tokenizer import PAD
        from tpulab.model.sampling import sample_tokens, token_logprobs

        s = self.shape.max_len
        logits_bv, cache = self.prefill_rows(policy, params, tokens_bs, lengths_b)
        cache = kv.to_loop_layout(
            cache
        )  # the loop's own layout; the step endpoints keep the exported one
        b = tokens_bs.shape[0]
        # outs: the token buffer [B, S], and with ``logprobs`` the log-probability buffer [B, S]
        outs = (jnp.full((b, s), PAD, jnp.int32),)
        if logprobs:
            outs += (jnp.zeros((b, s), jnp.float32),)

        def emit(i, logits_bv, outs, n_b, done_b):
            tok_b = sample_tokens(logits_bv, keys_b2, i, temperature_b, top_k_b)
            tok_b = jnp.where(done_b, PAD, tok_b)
            put = lambda buf, x_b: jax.lax.dynamic_update_index_in_dim(buf, x_b, i, axis=1)  # noqa: E731
            new = (put(outs[0], tok_b),)
            if logprobs:
                lp_b = token_logprobs(logits_bv, tok_b, temperature_b)
                new += (put(outs[1], jnp.where(done_b, 0.0, lp_b)),)
            n_b = n_b + (~done_b).astype(jnp.int32)
            done_b = done_b | (tok_b == stop_token) | (n_b >= max_new_b)
            return tok_b, new, n_b, done_b

        done0 = max_new_b <= 0
        tok_b, outs, n_b, done_b = emit(0, logits_bv, outs, jnp.zeros((b,), jnp.int32), done0)

        def cond(carry):
            i, _, _, _, _, done_b = carry
            return (i < s) & ~jnp.all(done_b)

        def body(carry):
            i, cache, tok_b, outs, n_b, done_b = carry
            pos_b = jnp.minimum(lengths_b + i - 1, s - 1)
            logits_bv, cache = self.decode_rows(params, cache, tok_b, pos_b)
            tok_b, outs, n_b, done_b = emit(i, logits_bv, outs, n_b, done_b)
            return i + 1, cache, tok_b, outs, n_b, done_b

        carry = (jnp.int32(1), cache, tok_b, outs, n_b, done_b)
        _, _, _, outs, n_b, _ = jax.lax.while_loop(cond, body, carry)
        return (outs[0], n_b, *outs[1:])

    def prefill(self, policy: str, params: Params, tokens_bs: jax.Array, length: jax.Array):
        """tokens [B, S] (the prompt in slots 0..length-1, anything after) ->
        (next-token logits [B, V], cache)."""
        b = tokens_bs.shape[0]
        last_b = jnp.broadcast_to(jnp.asarray(length, jnp.int32) - 1, (b,))
        return self.forward_cached(params, self.shape.init(policy, b), tokens_bs, 0, last_b=last_b)

    def decode(self, params: Params, cache: kv.KVCache, token_b: jax.Array, pos: jax.Array):
        """One token at position ``pos`` -> (logits [B, V], cache with slot ``pos`` written)."""
        logits_b1v, cache = self.forward_cached(params, cache, token_b[:, None], pos)
        return logits_b1v[:, 0], cache

    def example_args(self, endpoint: str, policy: str, batch, prompt_width=None) -> tuple:
        """Abstract arguments of an endpoint (for jax.export and input checks); ``batch`` and the
        loop's ``prompt_width`` may be symbolic dimensions."""
        sds = jax.ShapeDtypeStruct
        params = {n: sds(x.shape, x.dtype) for n, x in self.params.items()}
        scalar = sds((), jnp.int32)
        if endpoint == "prefill":
            return params, sds((batch, self.shape.max_len), jnp.int32), scalar
        if endpoint == "generate":
            row = lambda dt: sds((batch,), dt)  # noqa: E731
            width = self.shape.max_len if prompt_width is None else prompt_width
            return (
                params,
                sds((batch, width), jnp.int32),
                row(jnp.int32),
                row(jnp.int32),
                row(jnp.float32),
                row(jnp.int32),
                sds((batch, 2), jnp.uint32),
                scalar,
            )
        cache = jax.eval_shape(functools.partial(self.shape.init, policy, batch))
        return params, cache, sds((batch,), jnp.int32), scalar


class Buckets:
    """The request batch and prompt width an Engine runs ``n`` rows or tokens at: the buckets,
    each compiled once, that both engines share (``batch_bucket``, ``width_bucket``)."""

    max_len: int

    @staticmethod
    def batch_for(n: int) -> int:
        return batch_bucket(n)

    def width_for(self, n: int) -> int:
        return width_bucket(n, self.max_len)


class Decoder(Buckets):
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
        self._generate = jax.jit(functools.partial(fns.generate, policy))

    @classmethod
    def of(cls, model: Transformer, policy: str) -> Decoder:
        return cls(ModelFns(model), policy)

    def prefill(self, tokens_bs, length):
        return self._prefill(
            self.params, jnp.asarray(tokens_bs, jnp.int32), jnp.asarray(length, jnp.int32)
        )

    def decode(self, cache, token_b, pos):
        return self._decode(
            self.params, cache, jnp.asarray(token_b, jnp.int32), jnp.asarray(pos, jnp.int32)
        )

    def generate(
        self, tokens_bs, lengths_b, max_new_b, temperature_b, top_k_b, keys_b2, stop_token
    ):
        return self._generate(
            self.params,
            *(
                jnp.asarray(x)
                for x in (
                    tokens_bs,
                    lengths_b,
                    max_new_b,
                    temperature_b,
                    top_k_b,
                    keys_b2,
                    stop_token,
                )
            ),
        )

    def compiled_variants(self) -> dict[str, int]:
        """Executables each jitted endpoint holds (1 each; generate: one per batch and width
        bucket)."""
        return {
            "prefill": self._prefill._cache_size(),
            "decode": self._decode._cache_size(),
            "generate": self._generate._cache_size(),
        }


MAX_BATCH = 256  # the largest request batch any endpoint or the service is asked to run


WIDTH_STEP = 64  # past 2 * WIDTH_STEP tokens, prompt widths grow in steps of this, not by doubling


def width_bucket(n: int, max_len: int, smallest: int = 16) -> int:
    """The prompt width a batch whose longest prompt has ``n`` tokens is padded to, at most the
    cache length: a power of two (at least ``smallest``) up to 128, then the next multiple of 64.
    Prefill cost follows the prompt (a 448-token prompt padded to 512 cost a third more prefill: its
    attention part grows with the square) while compiles stay few (10 widths for a 512-slot cache, 4
    for 128)."""
    w = (
        max(smallest, batch_bucket(n))
        if n <= 2 * WIDTH_STEP
        else -(-int(n) // WIDTH_STEP) * WIDTH_STEP
    )
    return min(max_len, w)


def batch_bucket(n: int) -> int:
    """The batch a request batch of ``n`` runs at: the next power of two, so a handful of batch
    shapes (1, 2, 4, 8, ...) covers every batch and each compiles once."""
    return 1 << max(0, int(n) - 1).bit_length()


def pad_prompt(ids: np.ndarray, max_len: int, batch: int = 1) -> np.ndarray:
    from tpulab.data.tokenizer import PAD

    out = np.full((batch, max_len), PAD, np.int32)
    out[:, : len(ids)] = ids
    return out
