"""PPO's losses against independent float64 NumPy references written from the papers' formulas.

KL estimators: Schulman, "Approximating KL Divergence" (2020), k1 = -log r, k2 = (log r)^2 / 2,
k3 = (r - 1) - log r, r = p_ref(x) / p(x). GAE: Schulman et al. 2015 (arXiv:1506.02438), eq. 16,
written as the explicit sum A_t = sum_l (gamma lambda)^l delta_{t+l} (the implementation is a
reverse recursion). Clipped surrogate: Schulman et al. 2017 (arXiv:1707.06347), eq. 7; the value
loss is the PPO2 clipped form. The float32 JAX results must be within 1e-6 of the float64 values,
relative to the largest reference magnitude; each check has a negative control (a nearby wrong
formula) that the same bound rejects.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tpulab.train.objectives import ppo_losses as L

RTOL = 1e-6


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


@pytest.fixture
def tokens():
    """Per-token arrays [B, T] with one contiguous reply per row (some rows reach the end)."""
    rng = np.random.default_rng(0)
    b, t = 6, 24
    mask = np.zeros((b, t), np.float32)
    for i, (start, n) in enumerate([(3, 10), (0, 24), (20, 4), (7, 1), (12, 8), (5, 15)]):
        mask[i, start : start + n] = 1
    f32 = lambda x: x.astype(np.float32)  # noqa: E731 - the values both sides see
    logp = f32(-rng.gamma(2.0, 1.0, (b, t)))
    return {
        "mask": mask,
        "logp": logp,
        "ref_logp": f32(logp + rng.normal(0, 0.3, (b, t))),
        "old_logp": f32(logp + rng.normal(0, 0.25, (b, t))),
        "rewards": f32(rng.normal(0, 1, (b, t))),
        "values": f32(rng.normal(0, 1, (b, t))),
        "old_values": f32(rng.normal(0, 1, (b, t))),
        "returns": f32(rng.normal(0, 1, (b, t))),
        "adv": f32(rng.normal(0, 1, (b, t))),
    }


def d(x):
    return np.asarray(x, np.float64)


# --- KL estimators ------------------------------------------------------------------------------


def test_kl_estimators_match_their_definitions(tokens):
    logp, ref = d(tokens["logp"]), d(tokens["ref_logp"])
    log_r = ref - logp  # r = p_ref / p
    refs = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": (np.exp(log_r) - 1.0) - log_r}
    for name, want in refs.items():
        got = L.KL_ESTIMATORS[name](jnp.asarray(tokens["logp"]), jnp.asarray(tokens["ref_logp"]))
        assert rel_err(got, want) <= RTOL, name
    # k3 is never negative; k1 is, on some tokens (its mean, not each sample, is the KL)
    assert (np.asarray(L.kl_k3(tokens["logp"], tokens["ref_logp"])) >= 0).all()
    assert (np.asarray(L.kl_k1(tokens["logp"], tokens["ref_logp"])) < 0).any()
    # negative control: the estimators differ beyond the bound (k1 with r inverted is not k1)
    assert rel_err(L.kl_k1(tokens["logp"], tokens["ref_logp"]), log_r) > 1.0
    assert rel_err(L.kl_k3(tokens["logp"], tokens["ref_logp"]), refs["k2"]) > 1e-3


def test_k1_and_k3_are_unbiased_for_the_kl_of_two_categoricals():
    """E_{x~p}[k] = KL(p || q) for k1 and k3 (exactly, as an expectation over all outcomes)."""
    rng = np.random.default_rng(1)
    p, q = rng.dirichlet(np.ones(7)), rng.dirichlet(np.ones(7))
    kl = float(np.sum(p * np.log(p / q)))
    lp, lq = np.log(p).astype(np.float32), np.log(q).astype(np.float32)
    for est in (L.kl_k1, L.kl_k3):
        mean = float(np.sum(p * d(est(jnp.asarray(lp), jnp.asarray(lq)))))
        assert abs(mean - kl) <= 1e-6 * max(kl, 1.0)
    # control: k2's expectation is not the KL (it is biased)
    assert abs(float(np.sum(p * d(L.kl_k2(jnp.asarray(lp), jnp.asarray(lq))))) - kl) > 1e-3


# --- GAE ----------------------------------------------------------------------------------------


def gae_reference(rewards, values, mask, gamma, lam):
    """Eq. 16 as a sum over each row's reply: delta_t = r_t + gamma V_{t+1} - V_t (V = 0 after the
    last token), A_t = sum_{l >= 0} (gamma lambda)^l delta_{t+l}; returns A + V."""
    r, v, m = d(rewards), d(values), d(mask)
    adv = np.zeros_like(r)
    for b in range(r.shape[0]):
        idx = np.flatnonzero(m[b] > 0)
        vals = [v[b, t] for t in idx] + [0.0]
        deltas = [r[b, t] + gamma * vals[i + 1] - vals[i] for i, t in enumerate(idx)]
        for i, t in enumerate(idx):
            adv[b, t] = sum((gamma * lam) ** k * deltas[i + k] for k in range(len(idx) - i))
    return adv, (adv + v) * m


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_the_sum_of_discounted_td_errors(tokens, gamma, lam):
    adv, ret = L.gae(tokens["rewards"], tokens["values"], tokens["mask"], gamma, lam)
    want_adv, want_ret = gae_reference(
        tokens["rewards"], tokens["values"], tokens["mask"], gamma, lam
    )
    assert rel_err(adv, want_adv) <= RTOL and rel_err(ret, want_ret) <= RTOL
    assert (np.asarray(adv)[tokens["mask"] == 0] == 0).all()
    # negative control: another lambda (or a value that leaks past the reply's end) is caught
    other, _ = gae_reference(tokens["rewards"], tokens["values"], tokens["mask"], gamma, 0.7)
    assert rel_err(adv, other) > 1e-3
    # a mask that runs past the reply lets the values after it leak in (gamma = lambda = 1 alone
    # telescopes them away, so the control uses 0.9 and 0.5)
    r = tokens["rewards"] * tokens["mask"]
    no_mask_adv, _ = L.gae(r, tokens["values"], np.ones_like(tokens["mask"]), 0.9, 0.5)
    fixed, _ = gae_reference(tokens["rewards"], tokens["values"], tokens["mask"], 0.9, 0.5)
    assert rel_err(np.asarray(no_mask_adv) * tokens["mask"], fixed) > 1e-3


def test_gae_with_lambda_1_is_the_return_minus_the_value(tokens):
    """lambda = 1: A_t = sum_l gamma^l r_{t+l} - V_t (the Monte Carlo advantage)."""
    r, v, m = d(tokens["rewards"]), d(tokens["values"]), d(tokens["mask"])
    adv, _ = L.gae(tokens["rewards"], tokens["values"], tokens["mask"], 0.9, 1.0)
    want = np.zeros_like(r)
    for b in range(r.shape[0]):
        idx = np.flatnonzero(m[b] > 0)
        for i, t in enumerate(idx):
            want[b, t] = sum(0.9**k * r[b, u] for k, u in enumerate(idx[i:])) - v[b, t]
    assert rel_err(adv, want) <= RTOL


def test_whitening_is_mean_0_std_1_over_the_reply_tokens(tokens):
    x, m = d(tokens["adv"]) * 3 + 1, d(tokens["mask"])
    sel = x[m > 0]
    want = np.where(m > 0, (x - sel.mean()) / np.sqrt(sel.var() + L.WHITEN_EPS), 0.0)
    got = L.whiten(jnp.asarray(x, jnp.float32), jnp.asarray(tokens["mask"]))
    assert rel_err(got, want) <= RTOL
    # control: whitening over every position (padding included) is another result
    full = (x - x.mean()) / np.sqrt(x.var() + L.WHITEN_EPS) * m
    assert rel_err(got, full) > 1e-3


# --- clipped losses -----------------------------------------------------------------------------


def policy_reference(logp, old_logp, adv, mask, eps):
    ratio = np.exp(d(logp) - d(old_logp))
    a, m = d(adv), d(mask)
    surrogate = np.minimum(ratio * a, np.clip(ratio, 1 - eps, 1 + eps) * a)  # L^CLIP, maximised
    loss = -np.sum(surrogate * m) / np.sum(m)
    clip_frac = np.sum((np.abs(ratio - 1) > eps) * m) / np.sum(m)
    log_r = d(old_logp) - d(logp)
    approx_kl = np.sum(((np.exp(log_r) - 1) - log_r) * m) / np.sum(m)
    return loss, clip_frac, approx_kl


@pytest.mark.parametrize("eps", [0.2, 0.1])
def test_clipped_policy_loss_matches_eq_7(tokens, eps):
    args = [tokens[k] for k in ("logp", "old_logp", "adv", "mask")]
    loss, stats = L.policy_loss(*map(jnp.asarray, args), eps)
    want_loss, want_frac, want_kl = policy_reference(*args, eps)
    assert rel_err(loss, want_loss) <= RTOL
    assert rel_err(stats["clip_frac"], want_frac) <= RTOL and 0 < want_frac < 1
    assert rel_err(stats["approx_kl"], want_kl) <= RTOL
    # negative control: the unclipped surrogate is not this loss on these ratios
    ratio = np.exp(d(args[0]) - d(args[1]))
    unclipped = -np.sum(ratio * d(args[2]) * d(args[3])) / np.sum(d(args[3]))
    assert rel_err(loss, unclipped) > 1e-3


def test_the_ratio_of_a_policy_to_itself_is_exactly_one(tokens):
    _, stats = L.policy_loss(
        jnp.asarray(tokens["logp"]), jnp.asarray(tokens["logp"]), tokens["adv"], tokens["mask"], 0.2
    )
    assert float(stats["log_ratio_max"]) == 0.0 and float(stats["ratio_dev_max"]) == 0.0
    _, moved = L.policy_loss(
        jnp.asarray(tokens["logp"]) + 1e-6,
        jnp.asarray(tokens["logp"]),
        tokens["adv"],
        tokens["mask"],
        0.2,
    )
    assert float(moved["log_ratio_max"]) > 0.0  # control: a 1e-6 move shows


def value_reference(values, old_values, returns, mask, c):
    v, v0, r, m = d(values), d(old_values), d(returns), d(mask)
    clipped = v0 + np.clip(v - v0, -c, c)
    loss = 0.5 * np.sum(np.maximum((v - r) ** 2, (clipped - r) ** 2) * m) / np.sum(m)
    frac = np.sum(((clipped - r) ** 2 > (v - r) ** 2) * m) / np.sum(m)
    return loss, frac


def test_clipped_value_loss_matches_its_formula(tokens):
    args = [tokens[k] for k in ("values", "old_values", "returns", "mask")]
    loss, frac = L.value_loss(*map(jnp.asarray, args), 0.2)
    want, want_frac = value_reference(*args, 0.2)
    assert rel_err(loss, want) <= RTOL and rel_err(frac, want_frac) <= RTOL
    # negative control: the unclipped squared error is another number
    m = d(args[3])
    plain = 0.5 * np.sum((d(args[0]) - d(args[2])) ** 2 * m) / np.sum(m)
    assert rel_err(loss, plain) > 1e-3


def test_entropy_of_the_tempered_distribution():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 3, (3, 5, 11)).astype(np.float32)
    for t in (1.0, 0.7):
        z = d(logits) / t
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = -np.sum(p * np.log(p), -1)
        assert rel_err(L.entropy(jnp.asarray(logits), t), want) <= RTOL
    # control: the temperature matters
    assert rel_err(L.entropy(jnp.asarray(logits), 0.7), L.entropy(jnp.asarray(logits), 1.0)) > 1e-3
