"""A byte-level Transformer in Flax NNX: a decoder, or with ``model.causal: false`` an encoder.

Pre-norm blocks with RoPE causal self-attention (bidirectional when not causal) and a GELU MLP.
Attention is split into ``project_qkv`` (projections + RoPE) and ``attend`` (scores, mask,
softmax, values) so that the training forward and the KV-cache decode path
(``tpulab.model.decode``) share one implementation.
Norms, softmax and logits run in the accumulation dtype (fp32) whatever the compute dtype.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpulab.model.config import ModelConfig, PrecisionConfig

_INIT_STD = 0.02


@functools.lru_cache(maxsize=32)
def _rope_table(n: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.arange(n, dtype=np.float64)[:, None] * inv_freq
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_tables(
    positions_bt: jax.Array | None, head_dim: int, base: float, max_len: int, t: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables for integer positions [B, T] -> [B, T, head_dim/2]; positions None:
    0..t-1 -> [1, t, head_dim/2].

    Looked up in one fp32 table per shape, computed in float64 on the host, so every path
    (training, full forward, prefill, decode) rotates a position by the same numbers; in a program
    the table is a constant (computed inside the train step, XLA:CPU evaluated sin/cos again in each
    fusion that read them, for every head and batch row: about 6% of a default-config step).
    Positions must lie in [0, max_len).
    """
    cos, sin = _rope_table(max(max_len, t or 0), head_dim, float(base))
    if positions_bt is None:
        return jnp.asarray(cos[None, :t]), jnp.asarray(sin[None, :t])
    idx = positions_bt.astype(jnp.int32)
    return jnp.asarray(cos)[idx], jnp.asarray(sin)[idx]


def apply_rope(x_bthd: jax.Array, cos_bth: jax.Array, sin_bth: jax.Array) -> jax.Array:
    """Rotate channel pairs (first half, second half) of each head by the position angle."""
    x = x_bthd.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos_bth[:, :, None, :], sin_bth[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x_bthd.dtype)


def causal_mask(q_len: int, k_len: int, q_offset: int | jax.Array = 0) -> jax.Array:
    """[q_len, k_len] bool: query i (at absolute position q_offset + i) sees keys 0..q_offset+i."""
    q_pos = jnp.arange(q_len)[:, None] + q_offset
    return jnp.arange(k_len)[None, :] <= q_pos


def mask_bias(mask, dtype) -> jax.Array:
    """0 where ``mask`` is True, the dtype's lowest value elsewhere: added to attention scores it
    hides a key exactly as a select would (exp underflows to 0), and the backward pass of an add is
    the identity where a select's needs a select of its own over every score (measured: about 3% of
    a default step)."""
    return jnp.where(mask, jnp.zeros((), dtype), jnp.finfo(dtype).min)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, prec: PrecisionConfig, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.ones((dim,), dtype=prec.param_dtype))
        self.prec = prec

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(self.prec.accum_dtype)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
        return (y * self.scale[...].astype(self.prec.accum_dtype)).astype(self.prec.compute_dtype)


class Dense(nnx.Linear):
    """``nnx.Linear`` applied to rows ``[N, D]`` (leading axes flattened, then restored).

    Same parameters and math; but on XLA:CPU the weight gradient of a ``[B, T, D]`` input lowers to
    a transposed copy plus a dot over two contracting axes, while ``[N, D]`` gives one plain GEMM
    (measured: about 15% of a default-config train step). ``lora`` is None unless
    ``tpulab.model.lora.add_adapters`` gave this projection an adapter, whose output it adds.
    """

    lora = None  # a tpulab.model.lora.Adapter once adapted (an instance attribute then)

    def __call__(self, x: jax.Array) -> jax.Array:
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        y = super().__call__(rows)
        if self.lora is not None:
            y = y + self.lora(rows).astype(y.dtype)
        return y.reshape(*lead, self.out_features)


def _linear(
    d_in: int, d_out: int, prec: PrecisionConfig, rngs: nnx.Rngs, std: float = _INIT_STD
) -> Dense:
    return Dense(
        d_in,
        d_out,
        use_bias=False,
        dtype=prec.compute_dtype,
        param_dtype=prec.param_dtype,
        kernel_init=nnx.initializers.normal(std),
        rngs=rngs,
    )


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, prec: PrecisionConfig, *, rngs: nnx.Rngs):
        self.cfg, self.prec = cfg, prec
        self.qkv = _linear(cfg.d_model, 3 * cfg.d_model, prec, rngs)
        self.out = _linear(
            cfg.d_model, cfg.d_model, prec, rngs, std=_INIT_STD / math.sqrt(2 * cfg.n_layers)
        )
        self.attn_dropout = nnx.Dropout(cfg.dropout)

    def project_qkv(
        self, x_btd: jax.Array, positions_bt: jax.Array | None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k, v as [B, T, H, Dh]; RoPE already applied to q and k (positions None: 0..T-1 in
        every row)."""
        b, t, _ = x_btd.shape
        qkv = self.qkv(x_btd).reshape(b, t, 3, self.cfg.n_heads, self.cfg.head_dim)
        q_bthd, k_bthd, v_bthd = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        cos, sin = rope_tables(
            positions_bt, self.cfg.head_dim, self.cfg.rope_base, self.cfg.max_seq_len, t
        )
        return apply_rope(q_bthd, cos, sin), apply_rope(k_bthd, cos, sin), v_bthd

    def attend(
        self,
        q_bthd: jax.Array,
        k_bshd: jax.Array,
        v_bshd: jax.Array,
        mask_bts: jax.Array | None,
        *,
        deterministic: bool,
        rngs: nnx.Rngs | None,
    ) -> jax.Array:
        """Softmax attention in fp32; ``mask_bts`` is True where query t may see key s (None: every
        query sees every key). Returns [B, T, D]."""
        acc = self.prec.accum_dtype
        scores_bhts = jnp.einsum("bthd,bshd->bhts", q_bthd, k_bshd, preferred_element_type=acc)
        e_bhts, sum_bht = self.softmax_parts(scores_bhts, mask_bts)
        e_bhts = self.attn_dropout(e_bhts, deterministic=deterministic, rngs=rngs)
        out_bthd = jnp.einsum(
            "bhts,bshd->bthd", e_bhts.astype(v_bshd.dtype), v_bshd, preferred_element_type=acc
        )
        return self.project_out(
            out_bthd / jnp.swapaxes(sum_bht, 1, 2)[..., None], *out_bthd.shape[:2]
        )

    def softmax_parts(
        self, scores: jax.Array, mask: jax.Array | None
    ) -> tuple[jax.Array, jax.Array]:
        """Softmax over the last axis of raw q.k products [B, H, ..., S] (accumulation dtype),
        scaled by 1/sqrt(Dh), left unnormalized: ``exp(z - max z)`` and its sum over S. ``mask``
        [B, ..., S] (no head axis) is True where a key is visible (None: every key is). Callers
        divide by the sum after the product with the values, on Dh elements per query instead of
        S (as flash attention does): dividing the probabilities first made XLA:CPU write the sum
        broadcast to every score, per layer, forward and backward (measured: a default-config step
        97 -> 88-90 ms). Shared with the decode loop's attention (``tpulab.model.decode``), which
        lays its products out differently."""
        scale = 1.0 / math.sqrt(self.cfg.head_dim)
        z = scores * scale
        if mask is not None:
            z = z + mask_bias(mask, self.prec.accum_dtype)[:, None]
        e = jnp.exp(z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True)))
        return e, jnp.sum(e, axis=-1)

    def project_out(self, heads: jax.Array, b: int, t: int) -> jax.Array:
        """Per-head outputs (accumulation dtype, B*T*D elements in [B, T, H, Dh] order) -> [B, T, D]
        through the output projection."""
        return self.out(heads.astype(self.prec.compute_dtype).reshape(b, t, self.cfg.d_model))

    def __call__(self, x_btd, positions_bt, *, deterministic: bool, rngs: nnx.Rngs | None):
        q, k, v = self.project_qkv(x_btd, positions_bt)
        t = x_btd.shape[1]
        mask_bts = (
            jnp.broadcast_to(causal_mask(t, t), (x_btd.shape[0], t, t)) if self.cfg.causal else None
        )
        return self.attend(q, k, v, mask_bts, deterministic=deterministic, rngs=rngs)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, prec: PrecisionConfig, *, rngs: nnx.Rngs):
        hidden = cfg.mlp_ratio * cfg.d_model
        self.up = _linear(cfg.d_model, hidden, prec, rngs)
        self.down = _linear(
            hidden, cfg.d_model, prec, rngs, std=_INIT_STD / math.sqrt(2 * cfg.n_layers)
        )

    def __call__(self, x_btd):
        return self.down(jax.nn.gelu(self.up(x_btd)))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, prec: PrecisionConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, prec, rngs=rngs)
        self.attn = Attention(cfg, prec, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, prec, rngs=rngs)
        self.mlp = MLP(cfg, prec, rngs=rngs)
        self.resid_dropout = nnx.Dropout(cfg.dropout)

    def residual(self, x_btd, branch_btd, *, deterministic, rngs):
        return x_btd + self.resid_dropout(branch_btd, deterministic=deterministic, rngs=rngs)

    def apply(self, x_btd, attn_fn, *, deterministic: bool, rngs: nnx.Rngs | None):
        """The block around any attention: ``attn_fn(normed x) -> (out [B, T, D], aux)``; returns
        (x, aux).

        Training passes full causal attention; the KV-cache path passes attention that also writes
        its cache (returned as ``aux``), so both share this one block structure.
        """
        h, aux = attn_fn(self.attn_norm(x_btd))
        x_btd = self.residual(x_btd, h, deterministic=deterministic, rngs=rngs)
        x_btd = self.residual(
            x_btd, self.mlp(self.mlp_norm(x_btd)), deterministic=deterministic, rngs=rngs
        )
        return x_btd, aux

    def __call__(self, x_btd, positions_bt, *, deterministic: bool, rngs: nnx.Rngs | None):
        def attn_fn(h_btd):
            return self.attn(h_btd, positions_bt, deterministic=deterministic, rngs=rngs), None

        return self.apply(x_btd, attn_fn, deterministic=deterministic, rngs=rngs)[0]


class Transformer(nnx.Module):
    """tokens [B, T] int32 -> logits [B, T, V] in the accumulation dtype."""

    def __init__(self, cfg: ModelConfig, prec: PrecisionConfig, *, rngs: nnx.Rngs):
        self.cfg, self.prec = cfg, prec
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=prec.compute_dtype,
            param_dtype=prec.param_dtype,
            embedding_init=nnx.initializers.normal(_INIT_STD),
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(cfg, prec, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, prec, rngs=rngs)
        self.head = None if cfg.tie_embeddings else _linear(cfg.d_model, cfg.vocab_size, prec, rngs)

    def logits(self, x_btd: jax.Array) -> jax.Array:
        """Final norm and output head; logits in the accumulation dtype."""
        h_btd = self.final_norm(x_btd)
        if self.head is None:
            table = self.embed.embedding[...].astype(self.prec.compute_dtype)
            return jnp.einsum(
                "btd,vd->btv", h_btd, table, preferred_element_type=self.prec.accum_dtype
            )
        return self.head(h_btd).astype(self.prec.accum_dtype)

    def __call__(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array | None = None,
        *,
        deterministic: bool = True,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        x_btd = self.embed(tokens_bt)
        apply_block = _REMAT[self.cfg.remat]
        for block in self.blocks:
            x_btd = apply_block(block, x_btd, positions_bt, deterministic, rngs)
        return self.logits(x_btd)


def _call_block(block: Block, x_btd, positions_bt, deterministic: bool, rngs):
    return block(x_btd, positions_bt, deterministic=deterministic, rngs=rngs)


# ``model.remat``: how the train step's backward pass gets each block's activations. "none" is the
# plain call (the default program, unchanged); the others wrap the block in ``nnx.remat``
# (``jax.checkpoint``, with the policy named), so the forward keeps less and the backward
# recomputes the rest. ``deterministic`` is a Python bool and stays static.
_REMAT = {
    "none": _call_block,
    "block": nnx.remat(_call_block, static_argnums=(3,)),
    "dots_saveable": nnx.remat(
        _call_block, static_argnums=(3,), policy=jax.checkpoint_policies.dots_saveable
    ),
}


def built_param_count(model: nnx.Module) -> int:
    """Parameters of a built (or ``eval_shape``d) module: its ``nnx.Param`` leaves, LoRA adapters
    included (``model.config.param_count`` counts a config's, from the shapes alone)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
