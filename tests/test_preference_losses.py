"""The preference losses against float64 NumPy transcriptions of the papers' formulas, at 1e-6
relative (the anchors' own tests tolerate 1e-4 to 0.2).

- Bradley & Terry 1952: P(w > l) = sigmoid(r_w - r_l); the loss is -log P, with Llama 2's margin
  (Touvron et al. 2023, eq. 2) and the centring term of Eisenstein et al. 2023 (arXiv:2312.09244).
- DPO, Rafailov et al. 2023 (arXiv:2305.18290), eq. 7; conservative DPO (Mitchell 2023).
- IPO, Azar et al. 2023 (arXiv:2310.12036), eq. 17.

Each reference is written from the formula, not from the implementation (log-sigmoid as
-log1p(exp(-x)) in float64), and each comparison has a negative control: the same reference with a
plausible slip (beta left out, the margin's sign flipped, IPO's 1/(2 beta) target halved) is
refused by the same tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpulab.train.objectives import losses

RTOL = 1e-6
rng = np.random.default_rng(0)
N = 64
# Log-probs of whole replies (tens of nats) and rewards of order 1, as the objectives see them.
PI_W, PI_L, REF_W, REF_L = (rng.normal(-40.0, 8.0, N) for _ in range(4))
R_W, R_L = rng.normal(0.3, 1.0, N), rng.normal(-0.2, 1.0, N)
WEIGHT = np.ones(N)
WEIGHT[-5:] = 0.0  # padding pairs of an evaluation batch count for nothing


def log_sigmoid(x):
    x = np.asarray(x, np.float64)
    return np.where(x >= 0, -np.log1p(np.exp(-x)), x - np.log1p(np.exp(x)))


def mean(x):
    return float(np.sum(np.asarray(x, np.float64) * WEIGHT) / WEIGHT.sum())


def f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


def close(got, want, scale: float = 0.0) -> bool:
    """Within RTOL of ``want``; a mean of differences that cancel is held to RTOL of ``scale``, the
    size of what it sums (float32 rounds each term, not the small result)."""
    return abs(float(got) - want) <= RTOL * max(abs(want), scale, 1e-30)


def np_bradley_terry(r_w, r_l, margin=0.0, centering=0.0):
    return mean(-log_sigmoid(r_w - r_l - margin) + centering * (r_w + r_l) ** 2)


def np_dpo(beta, pi_w, pi_l, ref_w, ref_l, eps=0.0):
    h = (pi_w - ref_w) - (pi_l - ref_l)
    return mean(-(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h))


def np_ipo(tau, pi_w, pi_l, ref_w, ref_l):
    h = (pi_w - ref_w) - (pi_l - ref_l)
    return mean((h - 1.0 / (2.0 * tau)) ** 2)


# The float32 inputs, read back in float64: the reference sees exactly what the kernel sees.
PW, PL, RW, RL, CW, CL = (
    np.asarray(x, np.float64) for x in f32(PI_W, PI_L, REF_W, REF_L, R_W, R_L)
)


@pytest.mark.parametrize("margin, centering", [(0.0, 0.0), (0.5, 0.0), (0.0, 0.01), (1.0, 0.1)])
def test_bradley_terry_matches_numpy(margin, centering):
    got, m = losses.bradley_terry(*f32(R_W, R_L, WEIGHT), margin, centering)
    assert close(got, np_bradley_terry(CW, CL, margin, centering))
    assert close(m["accuracy"], mean(CW > CL)) and close(m["margin"], mean(CW - CL))
    # negative control: the margin with its sign flipped is another loss
    if margin:
        assert not close(got, np_bradley_terry(CW, CL, -margin, centering))


@pytest.mark.parametrize("beta", [0.01, 0.1, 0.5, 2.0])
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_dpo_and_label_smoothed_dpo_match_numpy(beta, eps):
    got, m = losses.dpo(*f32(PI_W, PI_L, REF_W, REF_L, WEIGHT), beta, "sigmoid", eps)
    assert close(got, np_dpo(beta, PW, PL, RW, RL, eps))
    assert close(m["reward_chosen"], mean(beta * (PW - RW)))
    scale = beta * mean(np.abs(PW) + np.abs(PL))
    assert close(m["reward_margin"], mean(beta * ((PW - RW) - (PL - RL))), scale)
    assert close(m["kl_ref"], mean(-0.5 * ((PW - RW) + (PL - RL))), scale / beta)
    assert close(m["reward_accuracy"], mean((PW - RW) > (PL - RL)))
    assert not close(got, np_dpo(1.0, PW, PL, RW, RL, eps))  # control: beta left out


@pytest.mark.parametrize("tau", [0.05, 0.1, 1.0])
def test_ipo_matches_numpy(tau):
    got, _ = losses.dpo(*f32(PI_W, PI_L, REF_W, REF_L, WEIGHT), tau, "ipo")
    assert close(got, np_ipo(tau, PW, PL, RW, RL))
    assert not close(got, np_ipo(2 * tau, PW, PL, RW, RL))  # control: target 1/(4 tau)


def test_sequence_logprobs_match_numpy():
    logits = rng.normal(0.0, 3.0, (6, 12, 258))
    targets = rng.integers(0, 258, (6, 12))
    mask = (rng.random((6, 12)) < 0.6).astype(np.float32)
    got = np.asarray(losses.sequence_logprobs(*f32(logits), jnp.asarray(targets), *f32(mask)))
    z = np.asarray(jnp.asarray(logits, jnp.float32), np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    want = (np.take_along_axis(logp, targets[..., None], -1)[..., 0] * mask).sum(-1)
    assert np.all(np.abs(got - want) <= RTOL * np.abs(want))
    # control: the unmasked sum is another number
    assert not np.all(
        np.abs(got - np.take_along_axis(logp, targets[..., None], -1)[..., 0].sum(-1))
        <= RTOL * np.abs(want)
    )


def test_at_equal_policy_and_reference_every_loss_is_its_zero_point():
    """h = 0: DPO and cDPO give ln 2, IPO (1 / (2 tau))^2, whatever the log-probs."""
    w = jnp.ones(N)
    for eps in (0.0, 0.2):
        v, m = losses.dpo(*f32(PI_W, PI_L, PI_W, PI_L), w, 0.1, "sigmoid", eps)
        assert float(v) == np.float32(np.log(2.0)) and float(m["reward_margin"]) == 0.0
    v, _ = losses.dpo(*f32(PI_W, PI_L, PI_W, PI_L), w, 0.1, "ipo")
    assert float(v) == pytest.approx(25.0, rel=RTOL)
    assert jax.tree.all(jax.tree.map(np.isfinite, m))
