"""The KV cache: per-layer keys and values in a fixed-length buffer, stored fp32, bf16 or int8.

Layout ``[L, B, S, H, Dh]`` with ``S = model.max_seq_len``: every prefill and decode step sees the
same shapes, so each compiles once. Slots are written with ``dynamic_update_slice`` (in place when
the buffer is donated). Slots past the current position may hold stale values; the causal mask
(key s visible to query at position p iff s <= p) never reads them.

INT8 is symmetric with one fp32 scale per (layer, batch, token, head): ``scale = max|x| / 127``
over the head dim, ``q = clip(round(x / scale), -127, 127)``. An all-zero vector gets scale 1 (not
0/0), so it round-trips to exact zeros.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tpulab.errors import TpulabError
from tpulab.model.policies import POLICIES, Policy  # noqa: F401 - re-exported

_STORAGE = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8}
SCALE_DTYPE = jnp.float32
INT8_MAX = 127


class KVCache(NamedTuple):
    """Keys/values ``[L, B, S, H, Dh]`` in the storage dtype; int8 adds fp32 scales
    ``[L, B, S, H, 1]``."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None


# Exported endpoints take and return a KVCache; registering it lets a fresh process deserialize
# them. The serialized name predates the move to the model layer: artifacts written before load.
jax.export.register_namedtuple_serialization(KVCache, serialized_name="tpulab.inference.KVCache")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise TpulabError(f"cache policy {policy!r} is not one of {', '.join(POLICIES)}")
    return policy


def describe_policy(policy: str) -> dict:
    """What a cache policy stores, for manifests and reports."""
    out = {
        "name": policy,
        "storage_dtype": jnp.dtype(_STORAGE[check_policy(policy)]).name,
        "layout": "k, v: [layers, batch, max_seq_len, heads, head_dim]",
    }
    if policy == "int8":
        out["scales"] = (
            f"symmetric, one {jnp.dtype(SCALE_DTYPE).name} scale per (layer, batch, token, head) "
            f"for k and for v; max|x|/{INT8_MAX}, all-zero vectors get scale 1"
        )
    return out


def init_cache(
    policy: str, n_layers: int, batch: int, max_len: int, n_heads: int, head_dim: int
) -> KVCache:
    shape = (n_layers, batch, max_len, n_heads, head_dim)
    zeros = jnp.zeros(shape, _STORAGE[check_policy(policy)])
    if policy != "int8":
        return KVCache(zeros, zeros)
    ones = jnp.ones(shape[:-1] + (1,), SCALE_DTYPE)
    return KVCache(zeros, zeros, ones, ones)


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., Dh] -> (int8 values in [-127, 127], fp32 scale [..., 1]) with x ~= values * scale."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0).astype(SCALE_DTYPE)
    q = jnp.clip(jnp.round(xf / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def dequantize_int8(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    return (q.astype(jnp.float32) * scale).astype(dtype)


def _put(buf: jax.Array, layer: int, x_bt: jax.Array, start) -> jax.Array:
    zero = jnp.zeros((), jnp.int32)
    idx = (jnp.asarray(layer, jnp.int32), zero, jnp.asarray(start, jnp.int32)) + (zero,) * (
        buf.ndim - 3
    )
    return jax.lax.dynamic_update_slice(buf, x_bt[None].astype(buf.dtype), idx)


def write(cache: KVCache, layer: int, k_bthd: jax.Array, v_bthd: jax.Array, start) -> KVCache:
    """Store T new keys/values at slots start..start+T-1 of one layer (start must keep them in
    range: dynamic_update_slice clamps rather than fails, so callers bound positions on the
    host)."""
    if cache.k_scale is None:
        return KVCache(_put(cache.k, layer, k_bthd, start), _put(cache.v, layer, v_bthd, start))
    (qk, sk), (qv, sv) = quantize_int8(k_bthd), quantize_int8(v_bthd)
    return KVCache(
        _put(cache.k, layer, qk, start),
        _put(cache.v, layer, qv, start),
        _put(cache.k_scale, layer, sk, start),
        _put(cache.v_scale, layer, sv, start),
    )


# The compiled decode loop's own layout (``to_loop_layout``): per layer, batch and heads merged into
# one leading axis (row b, head h at b*H + h), keys transposed [B*H, Dh, S], values [B*H, S, Dh];
# int8 scales [B*H, 1, S] and [B*H, S, 1] (they broadcast over Dh).
_LOOP_AXES = {
    "k": (0, 2, 3, 1),
    "v": (0, 2, 1, 3),
    "k_scale": (0, 2, 3, 1),
    "v_scale": (0, 2, 1, 3),
}


def to_loop_layout(cache: KVCache) -> KVCache:
    """[L, B, S, H, Dh] -> the compiled decode loop's layout, once per request: each field a tuple
    of L per-layer arrays, keys as [B*H, Dh, S] and values as [B*H, S, Dh]. Then both attention
    products are plain batched GEMMs over one batch axis that read the cache where it lies: in the
    exported order XLA:CPU transposed every layer's keys and values per step, slicing a layer out of
    the stacked buffer copied it, and a size-1 batch axis made it update the buffer twice (together
    most of a decode step at the demo size). The exported endpoints keep the [L, B, S, H, Dh]
    contract."""

    def per_layer(f, a):
        return tuple(
            jnp.transpose(a[i], _LOOP_AXES[f]).reshape(-1, *_loop_tail(f, a.shape))
            for i in range(a.shape[0])
        )

    return KVCache(
        *(None if a is None else per_layer(f, a) for f, a in zip(KVCache._fields, cache))
    )


def _loop_tail(field: str, shape) -> tuple[int, int]:
    _, _, s, _, d = shape  # [L, B, S, H, Dh]
    return (d, s) if field.startswith("k") else (s, d)


def write_loop(
    cache: KVCache, layer: int, k_bhd: jax.Array, v_bhd: jax.Array, pos_b: jax.Array
) -> KVCache:
    """Store one token per row, row b at slot ``pos_b[b]``, into one layer of a loop-layout cache:
    one scatter of B*H rows into that layer's own buffers, in place inside the loop (callers keep
    positions in range)."""
    b, h = k_bhd.shape[:2]
    pos_b = pos_b.astype(jnp.int32)

    def put(bufs, field, x_bhd):
        buf = bufs[layer]
        x = x_bhd.reshape(b * h, -1).astype(buf.dtype)  # [B*H, Dh] (scales: [B*H, 1])
        rows, slots = jnp.arange(b * h), jnp.repeat(pos_b, h)
        at = buf.at[rows, :, slots] if field == "k" else buf.at[rows, slots]
        new = at.set(x, mode="promise_in_bounds")
        return bufs[:layer] + (new,) + bufs[layer + 1 :]

    if cache.k_scale is None:
        return KVCache(put(cache.k, "k", k_bhd), put(cache.v, "v", v_bhd))
    (qk, sk), (qv, sv) = quantize_int8(k_bhd), quantize_int8(v_bhd)
    return KVCache(
        put(cache.k, "k", qk),
        put(cache.v, "v", qv),
        put(cache.k_scale, "k", sk),
        put(cache.v_scale, "v", sv),
    )


def read(cache: KVCache, layer: int, dtype) -> tuple[jax.Array, jax.Array]:
    """All S slots of one layer's keys and values, dequantized to ``dtype``: [B, S, H, Dh] each; in
    the loop layout keys [B*H, Dh, S] and values [B*H, S, Dh]."""
    if cache.k_scale is None:
        return cache.k[layer].astype(dtype), cache.v[layer].astype(dtype)
    return (
        dequantize_int8(cache.k[layer], cache.k_scale[layer], dtype),
        dequantize_int8(cache.v[layer], cache.v_scale[layer], dtype),
    )


def as_stored(cache: KVCache, x: jax.Array, dtype) -> jax.Array:
    """What ``read`` returns for values ``x`` once ``write`` has stored them in this cache (cast, or
    quantized and dequantized), without the round trip through the buffer."""
    if cache.k_scale is None:
        return x.astype(cache.k.dtype).astype(dtype)
    return dequantize_int8(*quantize_int8(x), dtype)


def bytes_per_token(cache: KVCache) -> float:
    """Bytes of the actual buffers (all layers, keys, values and scales) per (sequence, token
    slot)."""
    leaves = jax.tree.leaves(cache)
    _, b, s = cache.k.shape[:3]
    return float(sum(np.dtype(x.dtype).itemsize * x.size for x in leaves)) / (b * s)


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """The static shape of a model's cache (from its ModelConfig)."""

    n_layers: int
    max_len: int
    n_heads: int
    head_dim: int

    @classmethod
    def of(cls, model_cfg) -> CacheShape:
        return cls(model_cfg.n_layers, model_cfg.max_seq_len, model_cfg.n_heads, model_cfg.head_dim)

    def init(self, policy: str, batch: int) -> KVCache:
        return init_cache(policy, self.n_layers, batch, self.max_len, self.n_heads, self.head_dim)

    def nbytes(self, policy: str, batch: int) -> int:
        """Bytes of the cache for ``batch`` sequences of ``max_len`` slots (all layers, keys, values
        and scales), from the shapes alone."""
        return int(
            bytes_per_token(jax.eval_shape(lambda: self.init(policy, 1))) * batch * self.max_len
        )
