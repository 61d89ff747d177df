"""Layer by layer: where a converted model first parts from its source.

Forward hooks on both sides record each layer's output for one fixed batch: ``torch``'s own
``register_forward_hook`` on the twin, and on the tpulab model the same hook made for NNX
(``flax_hooks``: while it is open, each hooked module's class records what a watched instance's
``__call__`` returns; traced once under ``jax.jit``, so the tpulab side is the program tpulab runs).
Both sides name a layer alike (``layer_names``), in the order the forward finishes them: ``embed``,
then per block ``attn_norm``, ``attn``, ``mlp_norm``, ``mlp`` and the block's output, then
``final_norm`` and ``logits``.

Each layer gets max abs difference, relative L2 (``||b - a|| / ||a||``), cosine and SQNR in dB
(``10 log10(||a||^2 / ||b - a||^2)``), all in float64 with ``a`` the source's output; the final
logits also get the per-token KL(source || converted). ``BOUNDS`` holds the fp32 bound of each, and
the first layer (in that order) over any bound is the one a failed conversion names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import numpy as np
import torch
from flax import nnx

from tpulab.evidence.report_kit import table
from tpulab.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Bounds:
    """fp32 bounds of one conversion. Measured (docs/interop.md): the default model trained 100
    steps gave at most max abs 4.8e-6, rel L2 3.9e-7 (SQNR 128 dB), per-token KL 2.3e-12; each
    bound leaves 20x or more, and the four agree with one another (rel L2 1e-5 is SQNR 100 dB and
    1 - cosine 5e-11; logit differences of 1e-5 relative give KL near 1e-9)."""

    max_abs: float = 1e-4  # |b - a| anywhere in a layer's output (the logits are O(10))
    rel_l2: float = 1e-5
    cosine: float = 1 - 1e-9  # at least
    sqnr_db: float = 100.0  # at least
    kl: float = 1e-9  # nats, the largest per-token KL of the final logits


BOUNDS = Bounds()


def layer_names(cfg: ModelConfig) -> list[str]:
    """Every hooked layer, in the order a forward finishes it."""
    names = ["embed"]
    for i in range(cfg.n_layers):
        b = f"blocks.{i}"
        names += [f"{b}.attn_norm", f"{b}.attn", f"{b}.mlp_norm", f"{b}.mlp", b]
    return names + ["final_norm", "logits"]


def _module(root, name: str):
    """The submodule at a dotted name (``logits``: the model itself), on either side."""
    if name == "logits":
        return root
    m = root
    for part in name.split("."):
        m = m[int(part)] if part.isdigit() else getattr(m, part)
    return m


@contextlib.contextmanager
def flax_hooks(watched: dict[str, nnx.Module]):
    """Forward hooks for NNX modules: yields a dict that fills with ``name -> output`` as each
    watched module's ``__call__`` returns. The classes are patched only while the block runs."""
    by_id = {id(m): n for n, m in watched.items()}
    seen: dict[str, jax.Array] = {}
    classes = {type(m) for m in watched.values()}
    own = {c: c.__dict__.get("__call__") for c in classes}

    def hooked(call):
        def __call__(self, *args, **kwargs):
            out = call(self, *args, **kwargs)
            if id(self) in by_id:
                seen[by_id[id(self)]] = out
            return out

        return __call__

    try:
        for c in classes:
            c.__call__ = hooked(c.__call__)
        yield seen
    finally:
        for c, call in own.items():
            if call is None:
                del c.__call__
            else:
                c.__call__ = call


def flax_outputs(model: nnx.Module, tokens_bt: np.ndarray) -> dict[str, np.ndarray]:
    """Every layer's output of a tpulab Transformer (deterministic), one jitted program."""
    names = layer_names(model.cfg)
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens_bt):
        m = nnx.merge(graphdef, state)
        with flax_hooks({n: _module(m, n) for n in names}) as seen:
            m(tokens_bt, deterministic=True)
        return {n: seen[n] for n in names}

    out = run(state, jax.numpy.asarray(tokens_bt))
    return {n: np.asarray(out[n]) for n in names}  # a returned dict comes back sorted by key


@torch.inference_mode()
def torch_outputs(model: torch.nn.Module, tokens_bt: np.ndarray) -> dict[str, np.ndarray]:
    """Every layer's output of the twin, from forward hooks."""
    seen, handles = {}, []
    for n in layer_names(model.cfg):

        def hook(module, args, out, n=n):
            seen[n] = out.detach().numpy().copy()

        handles.append(_module(model, n).register_forward_hook(hook))
    try:
        model.eval()
        model(torch.from_numpy(np.asarray(tokens_bt, np.int64)))
    finally:
        for h in handles:
            h.remove()
    return {n: seen[n] for n in layer_names(model.cfg)}


def measures(a: np.ndarray, b: np.ndarray) -> dict:
    """How far ``b`` (converted) is from ``a`` (source), in float64."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    d = b - a
    na, nb, nd = (float(np.linalg.norm(x)) for x in (a, b, d))
    return {
        "max_abs": float(np.max(np.abs(d))) if d.size else 0.0,
        "rel_l2": nd / na if na > 0 else (0.0 if nd == 0 else math.inf),
        "cosine": float(a @ b) / (na * nb) if na > 0 and nb > 0 else float(na == nb),
        "sqnr_db": math.inf
        if nd == 0
        else (10 * math.log10(na**2 / nd**2) if na > 0 else -math.inf),
    }


def token_kl(src_btv: np.ndarray, dst_btv: np.ndarray) -> np.ndarray:
    """KL(softmax(src) || softmax(dst)) per token, in float64 nats; >= 0."""

    def log_softmax(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lp, lq = log_softmax(src_btv), log_softmax(dst_btv)
    return np.maximum(np.sum(np.exp(lp) * (lp - lq), axis=-1), 0.0)


def over(m: dict, bounds: Bounds) -> list[str]:
    """The measures of one row over their bounds, each as ``name value (bound)``."""
    out = []
    if not m["max_abs"] <= bounds.max_abs:
        out.append(f"max abs {m['max_abs']:.3g} > {bounds.max_abs:g}")
    if not m["rel_l2"] <= bounds.rel_l2:
        out.append(f"relative L2 {m['rel_l2']:.3g} > {bounds.rel_l2:g}")
    if not m["cosine"] >= bounds.cosine:
        out.append(f"cosine {m['cosine']:.12f} < {bounds.cosine:.12f}")
    if not m["sqnr_db"] >= bounds.sqnr_db:
        out.append(f"SQNR {m['sqnr_db']:.1f} dB < {bounds.sqnr_db:g} dB")
    return out


def compare(
    src: dict[str, np.ndarray], dst: dict[str, np.ndarray], bounds: Bounds = BOUNDS
) -> dict:
    """The per-layer table of ``dst`` against ``src`` (same names, same order), the per-token KL of
    the logits, and the first layer over a bound (None when every one holds)."""
    rows, first = [], None
    for name, a in src.items():
        m = {"layer": name, **measures(a, dst[name])}
        m["over"] = over(m, bounds)
        rows.append(m)
        if m["over"] and first is None:
            first = {"layer": name, "over": m["over"]}
    kl = token_kl(src["logits"], dst["logits"])
    kl_rec = {"max": float(kl.max()), "mean": float(kl.mean()), "tokens": int(kl.size)}
    if first is None and not kl_rec["max"] <= bounds.kl:
        first = {"layer": "logits", "over": [f"per-token KL {kl_rec['max']:.3g} > {bounds.kl:g}"]}
    return {
        "layers": rows,
        "kl": kl_rec,
        "bounds": dataclasses.asdict(bounds),
        "first_failure": first,
        "passed": first is None,
    }


def failure_line(result: dict) -> str:
    f = result["first_failure"]
    return f"first layer over its fp32 bound: {f['layer']} ({'; '.join(f['over'])})"


def markdown(result: dict) -> str:
    """The table, one row per layer, and the KL line."""
    cells = [
        (
            r["layer"],
            f"{r['max_abs']:.3g}",
            f"{r['rel_l2']:.3g}",
            f"{r['cosine']:.12f}",
            "inf" if math.isinf(r["sqnr_db"]) else f"{r['sqnr_db']:.1f}",
            "ok" if not r["over"] else "OVER",
        )
        for r in result["layers"]
    ]
    b, kl = result["bounds"], result["kl"]
    head = ["layer", "max abs", "rel L2", "cosine", "SQNR dB", "bound"]
    return (
        table(head, cells)
        + f"\n\nPer-token KL of the final logits: max {kl['max']:.3g}, mean {kl['mean']:.3g} "
        f"nats over {kl['tokens']} tokens. Bounds (fp32): max abs <= {b['max_abs']:g}, rel L2 <= "
        f"{b['rel_l2']:g}, cosine >= {b['cosine']:.12f}, SQNR >= {b['sqnr_db']:g} dB, "
        f"KL <= {b['kl']:g}.\n"
    )
