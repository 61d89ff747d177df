"""Independent checks of the Transformer: causal attention, valid-token loss, disjoint data.

Each check recomputes what it verifies by a route other than the training code's: the loss
against a NumPy log-softmax written here, causality by perturbing inputs and comparing logits
bitwise, and data disjointness from what the run actually consumed (the loop's window ledger of
sha256 hashes) against windows rebuilt from the validation documents (the pipeline's own dedup
uses blake2b).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpulab.data.corpus import load_corpus
from tpulab.data.pipeline import build_splits, document_windows, to_batch
from tpulab.data.tokenizer import PAD
from tpulab.errors import TpulabError
from tpulab.evidence.ledger import read_ledger, window_sha256
from tpulab.train.config import RunConfig
from tpulab.train.step import make_steps, masked_xent


def _result(name: str, passed: bool, detail: str) -> dict:
    return {"check": name, "passed": bool(passed), "detail": detail}


def check_causal(model, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """Changing tokens after t leaves logits at <= t bitwise unchanged; changing token t changes some logit after t."""
    forward = nnx.jit(lambda m, x: m(x, deterministic=True))
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(2, seq_len), dtype=np.int32)
    base = np.asarray(forward(model, jnp.asarray(x)))
    future_ok, present_ok, worst = True, True, 0.0
    cuts = sorted({0, seq_len // 3, seq_len // 2, seq_len - 2} & set(range(seq_len - 1)))
    for t in cuts:
        future = x.copy()
        future[:, t + 1 :] = rng.integers(0, 256, size=future[:, t + 1 :].shape)
        out = np.asarray(forward(model, jnp.asarray(future)))
        worst = max(worst, float(np.abs(out[:, : t + 1] - base[:, : t + 1]).max()))
        future_ok &= bool(np.array_equal(out[:, : t + 1], base[:, : t + 1]))
        present = x.copy()
        present[:, t] = (present[:, t] + 1 + rng.integers(0, 255, size=2)) % 256
        out = np.asarray(forward(model, jnp.asarray(present)))
        present_ok &= bool(np.array_equal(out[:, :t], base[:, :t])) and bool(
            np.any(out[:, t:] != base[:, t:])
        )
    return [
        _result(
            "causal: future tokens do not change earlier logits",
            future_ok,
            f"max abs diff at positions <= t: {worst:.3g} (must be exactly 0) over {len(cuts)} cut points "
            f"t = {', '.join(map(str, cuts))}",
        ),
        _result(
            "causal: token t changes logits at >= t only",
            present_ok,
            "logits before t bitwise unchanged, some logit at or after t changed",
        ),
    ]


def numpy_masked_nll(logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> float:
    """Reference loss in float64: log-softmax by max-shift and log-sum-exp, mean over mask == 1."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None].astype(np.int64), axis=-1)[..., 0]
    return float((nll * mask).sum() / mask.sum())


def check_loss(model, windows: np.ndarray) -> list[dict]:
    """The jitted loss matches NumPy on a padded batch; padded targets get exactly zero gradient."""
    padded = windows[(windows[:, 1:] == PAD).any(axis=1)]
    if len(padded) == 0:
        raise TpulabError("no padded window in the data to check the valid-token loss on")
    batch = to_batch(np.concatenate([padded[:1], windows[:3]]))
    logits = np.asarray(
        nnx.jit(lambda m, x: m(x, deterministic=True))(model, jnp.asarray(batch["inputs"]))
    )
    loss_fn = jax.jit(masked_xent)
    ours = float(loss_fn(logits, batch["targets"], batch["mask"])[0])
    ref = numpy_masked_nll(logits, batch["targets"], batch["mask"])
    rel = abs(ours - ref) / abs(ref)
    grad = np.asarray(
        jax.jit(jax.grad(lambda z: masked_xent(z, batch["targets"], batch["mask"])[0]))(logits)
    )
    pad_grad = float(np.abs(grad[batch["mask"] == 0]).max())
    valid_grad = float(np.abs(grad[batch["mask"] == 1]).max())
    scrambled = batch["targets"].copy()
    scrambled[batch["mask"] == 0] = 7
    same = float(loss_fn(logits, scrambled, batch["mask"])[0]) == ours
    n_pad = int((batch["mask"] == 0).sum())
    return [
        _result(
            "loss: jitted mean NLL over valid tokens equals NumPy reference",
            rel < 1e-5,
            f"jax {ours:.7f} vs numpy(float64) {ref:.7f}, rel diff {rel:.2e} (tol 1e-5), {n_pad} padded targets",
        ),
        _result(
            "loss: padded positions contribute zero gradient",
            pad_grad == 0.0 and valid_grad > 0 and same,
            f"max abs dL/dlogits at padding {pad_grad:g} (must be 0), at valid tokens {valid_grad:.3g}; "
            f"padded targets changed -> loss {'unchanged' if same else 'CHANGED'}",
        ),
    ]


def check_disjoint(splits, recorded_split: dict | None, ledger: dict) -> list[dict]:
    """Compare what the run consumed (its window ledger) with windows rebuilt from the validation documents.

    ``ledger`` is ``evidence.ledger.read_ledger(run_dir)``: the sha256 of every window the loop drew for
    training and read for evaluation. A validation window in a training batch, or a training window in
    an evaluation batch, fails a check; so does a run that recorded nothing.
    """
    train_names = {d.name for d in splits.train_docs}
    val_names = {d.name for d in splits.val_docs}
    doc_overlap = (train_names & val_names) | (
        {d.sha256 for d in splits.train_docs} & {d.sha256 for d in splits.val_docs}
    )
    seq_len = splits.train_windows.shape[1] - 1
    val_hashes = set(
        window_sha256(np.concatenate([document_windows(d, seq_len) for d in splits.val_docs]))
    )
    train_hashes = set(window_sha256(splits.train_windows))
    drawn = {h for hashes in ledger["train"].values() for h in hashes}
    leaked = drawn & (val_hashes - train_hashes)  # text that occurs in both splits is not a leak
    foreign = drawn - train_hashes
    evals = ledger["eval"]
    eval_outside = evals - val_hashes
    out = [
        _result(
            "data: train and validation documents are disjoint",
            not doc_overlap,
            f"{len(train_names)} train / {len(val_names)} validation documents, {len(doc_overlap)} shared",
        ),
        _result(
            "data: no validation window was drawn for training (run's window ledger, sha256)",
            bool(drawn) and not leaked and not foreign,
            f"{len(drawn)} distinct windows drawn over {len(ledger['train'])} steps: {len(leaked)} from validation "
            f"documents, {len(foreign)} not from training documents"
            if drawn
            else "the run recorded no training windows",
        ),
        _result(
            "data: validation loss read validation windows only (run's window ledger)",
            bool(evals) and not eval_outside and not (evals & train_hashes),
            f"{len(evals)} distinct evaluation windows, {len(eval_outside)} not from validation documents"
            if evals
            else "the run recorded no evaluation windows",
        ),
    ]
    if recorded_split is not None:
        same = recorded_split.get("identity") == splits.corpus.identity and [
            d["name"] for d in recorded_split.get("validation_documents", [])
        ] == [d.name for d in splits.val_docs]
        out.append(
            _result(
                "data: run dir's recorded split matches the corpus now",
                same,
                f"corpus identity {splits.corpus.identity[:16]}…",
            )
        )
    return out


def run_checks(config: RunConfig, run_dir: Path | None = None) -> list[dict]:
    """All checks on the run's trained weights (``run_dir``) or on a fresh init of ``config`` (model checks only:
    the data checks need a run's window ledger)."""
    import json

    if run_dir is not None:
        from tpulab.train.restore import load_model

        restored = load_model(run_dir)
        config, model = restored.config, restored.model
    else:
        steps = make_steps(config)
        model = steps.model(steps.init().params)
    splits = build_splits(load_corpus(config.data.path), config.data)
    results = check_causal(model, config.data.seq_len, config.model.vocab_size) + check_loss(
        model, splits.train_windows
    )
    if run_dir is not None:
        docs = Path(run_dir) / "documents.json"
        recorded = json.loads(docs.read_text()) if docs.exists() else None
        results += check_disjoint(splits, recorded, read_ledger(run_dir))
    return results


def table_markdown(results: list[dict]) -> str:
    lines = ["| check | result | detail |", "|---|---|---|"]
    lines += [
        f"| {r['check']} | {'PASS' if r['passed'] else 'FAIL'} | {r['detail']} |" for r in results
    ]
    return "\n".join(lines)


def print_table(results: list[dict]) -> None:
    width = max(len(r["check"]) for r in results)
    for r in results:
        print(f"{'PASS' if r['passed'] else 'FAIL'}  {r['check']:<{width}}  {r['detail']}")
