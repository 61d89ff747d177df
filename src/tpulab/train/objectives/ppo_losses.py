"""PPO's pure pieces: KL estimators, GAE, whitening, the clipped policy and value losses, entropy.

Each is a small function of arrays, checked against a float64 NumPy transcription of its paper's
formula in ``tests/test_ppo_losses.py`` (1e-6 relative). Per-token arrays are [B, T] over target
positions with a float ``mask`` that is 1 on the reply's tokens; every mean is over the masked
tokens of the whole (global) batch, never per row.

- KL estimators (Schulman, "Approximating KL Divergence", 2020), for a token x sampled from the
  policy p, with log r = log p_ref(x) - log p(x): k1 = -log r, k2 = (log r)^2 / 2,
  k3 = (r - 1) - log r. k1 and k3 are unbiased for KL(p || p_ref); k3 is never negative.
- GAE (Schulman et al. 2015, arXiv:1506.02438, eq. 16): delta_t = r_t + gamma V_{t+1} - V_t,
  A_t = sum_l (gamma lambda)^l delta_{t+l}, with V = 0 past the reply's last token; returns
  R_t = A_t + V_t (the value target).
- Clipped surrogate (Schulman et al. 2017, arXiv:1707.06347, eq. 7), minimised:
  L = mean max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps)), ratio = exp(log p - log p_old).
- Clipped value loss (the PPO2 baselines form): 1/2 mean max((V - R)^2, (V_clip - R)^2),
  V_clip = V_old + clip(V - V_old, -c, c).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WHITEN_EPS = 1e-8  # added to the variance before the square root (TRL's masked_whiten uses 1e-8)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def kl_k1(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    return logp - ref_logp


def kl_k2(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    return 0.5 * jnp.square(ref_logp - logp)


def kl_k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    log_r = ref_logp - logp
    return jnp.expm1(log_r) - log_r  # expm1: r - 1 without cancellation where r is near 1


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def gae(
    rewards_bt: jax.Array, values_bt: jax.Array, mask_bt: jax.Array, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
    """(advantages, returns) [B, T], 0 off the mask: a reverse scan over T. A reply's tokens are
    contiguous, so the value after its last token is the masked next value, 0."""
    m = mask_bt.astype(jnp.float32)
    v = values_bt * m
    r = rewards_bt * m
    next_v = jnp.concatenate([v[:, 1:], jnp.zeros_like(v[:, :1])], axis=1)
    next_m = jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)
    delta = r + gamma * next_v - v

    def back(carry_b, xs):
        delta_b, next_m_b = xs
        adv_b = delta_b + gamma * lam * next_m_b * carry_b
        return adv_b, adv_b

    _, adv_tb = jax.lax.scan(back, jnp.zeros_like(delta[:, 0]), (delta.T, next_m.T), reverse=True)
    adv = adv_tb.T * m
    return adv, (adv + v) * m


def whiten(x: jax.Array, mask: jax.Array) -> jax.Array:
    """(x - mean) / sqrt(var + eps) over the masked entries (population variance), 0 off them."""
    mean = masked_mean(x, mask)
    var = masked_mean(jnp.square(x - mean), mask)
    return (x - mean) * jax.lax.rsqrt(var + WHITEN_EPS) * mask


def policy_loss(
    logp: jax.Array, old_logp: jax.Array, adv: jax.Array, mask: jax.Array, clip: float
) -> tuple[jax.Array, dict]:
    """The clipped surrogate, and what it did: clip fraction, approximate KL(old || new) by k3,
    and the largest |log ratio| (exactly 0 where the policy still is the one that sampled)."""
    log_ratio = logp - old_logp
    ratio = jnp.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip, 1.0 + clip)
    loss = masked_mean(jnp.maximum(unclipped, clipped), mask)
    on = mask > 0
    stats = {
        "clip_frac": masked_mean((jnp.abs(ratio - 1.0) > clip).astype(jnp.float32), mask),
        "approx_kl": masked_mean(kl_k3(logp, old_logp), mask),
        "log_ratio_max": jnp.max(jnp.where(on, jnp.abs(log_ratio), 0.0)),
        "ratio_dev_max": jnp.max(jnp.where(on, jnp.abs(ratio - 1.0), 0.0)),
    }
    return loss, stats


def value_loss(
    values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array, clip: float
) -> tuple[jax.Array, jax.Array]:
    """(the clipped value loss, the share of tokens where the clipped term was the larger)."""
    clipped = old_values + jnp.clip(values - old_values, -clip, clip)
    err, err_clipped = jnp.square(values - returns), jnp.square(clipped - returns)
    loss = 0.5 * masked_mean(jnp.maximum(err, err_clipped), mask)
    return loss, masked_mean((err_clipped > err).astype(jnp.float32), mask)


def entropy(logits_btv: jax.Array, temperature) -> jax.Array:
    """[B, T] entropy of softmax(logits / t), the distribution the sampler draws from."""
    logp = jax.nn.log_softmax(logits_btv.astype(jnp.float32) / temperature, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
