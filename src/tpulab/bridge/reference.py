"""The bridge MLP's training written out in float64 NumPy: the independent reference of `compare`.

Every backend, torch included, is compared with this rather than torch with itself: forward
Linear-ReLU-Linear, MSE, its gradients by hand, and Adam as torch.optim.Adam computes it (betas 0.9
and 0.999, eps 1e-8 added to the bias-corrected sqrt of the second moment), from the same initial
weights (the torch model's) and data. Dropout masks and augmentation noise have no NumPy twin, so a
config with either has no reference.
"""

from __future__ import annotations

import numpy as np

from tpulab.bridge.config import BridgeConfig

B1, B2, EPS = 0.9, 0.999, 1e-8  # torch.optim.Adam's defaults, which every bridge method uses


def float64_curve(cfg: BridgeConfig) -> dict[int, float] | None:
    """step -> the loss logged at that step (before its update), in float64; None with dropout or
    augmentation."""
    if cfg.dropout or cfg.augment:
        return None
    from tpulab.bridge.backends import build_model
    from tpulab.bridge.loop import make_data

    x_t, y_t = make_data(cfg)
    x, y = x_t.double().numpy(), y_t.double().numpy()
    sd = build_model(cfg).state_dict()
    p = {k: v.double().numpy().copy() for k, v in sd.items()}  # 0.weight, 0.bias, 2.weight, ...
    w1, w2 = (k for k in p if k.endswith("weight"))  # first and last Linear, in model order
    b1, b2 = (k for k in p if k.endswith("bias"))
    names = (w1, b1, w2, b2)
    m = {k: np.zeros_like(p[k]) for k in names}
    v = {k: np.zeros_like(p[k]) for k in names}
    curve = {}
    n = x.shape[0]
    for step in range(1, cfg.steps + 1):
        pre = x @ p[w1].T + p[b1]
        h = np.maximum(pre, 0.0)
        out = h @ p[w2].T + p[b2]
        r = out - y
        curve[step] = float(np.mean(r**2))
        d_out = 2.0 * r / n
        d_h = (d_out @ p[w2]) * (pre > 0)
        grads = {w2: d_out.T @ h, b2: d_out.sum(0), w1: d_h.T @ x, b1: d_h.sum(0)}
        c1, c2 = 1.0 - B1**step, 1.0 - B2**step
        for k in names:
            m[k] = B1 * m[k] + (1 - B1) * grads[k]
            v[k] = B2 * v[k] + (1 - B2) * grads[k] ** 2
            p[k] = p[k] - (cfg.lr / c1) * m[k] / (np.sqrt(v[k]) / np.sqrt(c2) + EPS)
    return curve


def rel_diffs(curve: dict[int, float], ref: dict[int, float]) -> dict:
    """Largest relative difference over the common steps, and at the last one."""
    steps = sorted(set(curve) & set(ref))
    rel = [abs(curve[s] - ref[s]) / abs(ref[s]) for s in steps]
    return {"max": max(rel), "final": rel[-1], "steps": len(steps)}
