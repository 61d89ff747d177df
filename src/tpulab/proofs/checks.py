"""Independent checks of the Transformer: causal attention, valid-token loss, disjoint data.

Each check recomputes what it verifies by a route other than the training code's: the loss of the
run's own jitted eval step against a NumPy log-softmax written here, and its train step's update
compared bitwise with the padded targets changed; causality by perturbing inputs and comparing
logits bitwise; and data disjointness from what the run actually consumed (the loop's window ledger
of sha256 hashes) against windows rebuilt from the validation documents (the pipeline's own dedup
uses blake2b).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpulab.checkpoint.compare import compare_trees
from tpulab.checkpoint.rundir import RunDir, read_json
from tpulab.data.corpus import load_corpus
from tpulab.data.pipeline import build_splits, document_windows, to_batch
from tpulab.data.tokenizer import PAD
from tpulab.errors import TpulabError
from tpulab.evidence.ledger import coverage, read_ledger, window_sha256
from tpulab.evidence.report_kit import table
from tpulab.train.config import RunConfig
from tpulab.train.step import Steps, TrainState, make_mesh, make_steps


def _result(name: str, passed: bool, detail: str) -> dict:
    return {"check": name, "passed": bool(passed), "detail": detail}


def check_causal(model, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """Changing tokens after t leaves logits at <= t bitwise unchanged; changing token t changes
    some logit after t."""
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
            f"max abs diff at positions <= t: {worst:.3g} (must be exactly 0) over {len(cuts)} "
            f"cut points t = {', '.join(map(str, cuts))}",
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


def loss_check_batch(windows: np.ndarray, batch_size: int) -> dict[str, np.ndarray]:
    """A batch of ``batch_size`` windows whose first row is a padded window (the last of a
    document): padding the steps must ignore."""
    padded = windows[(windows[:, 1:] == PAD).any(axis=1)]
    if len(padded) == 0:
        raise TpulabError("no padded window in the data to check the valid-token loss on")
    return to_batch(np.concatenate([padded[:1], windows[: batch_size - 1]]))


def check_loss(steps: Steps, state: TrainState, windows: np.ndarray, batch_size: int) -> list[dict]:
    """The run's own jitted steps on a batch with padding: ``Steps.eval`` equals a float64 NumPy
    reference over valid targets and counts exactly those; one ``Steps.train`` update (gradient,
    clipping, Adam) is bitwise unchanged when the padded targets change, and changed when one valid
    target does. A loss that ignores the mask fails both."""
    batch = loss_check_batch(windows, batch_size)
    mask = batch["mask"]
    scrambled = {**batch, "targets": np.where(mask == 0, 7, batch["targets"]).astype(np.int32)}
    valid = np.argwhere(mask == 1)[-1]  # one valid target, changed for the positive control
    moved = batch["targets"].copy()
    moved[tuple(valid)] = (moved[tuple(valid)] + 1) % 256
    moved = {**batch, "targets": moved}

    logits = np.asarray(steps.model(state.params)(jnp.asarray(batch["inputs"]), deterministic=True))
    ref = numpy_masked_nll(logits, batch["targets"], mask)
    total, count = (float(x) for x in steps.eval(state.params, steps.put_global(batch))["val_loss"])
    ours = total / count
    rel = abs(ours - ref) / abs(ref)
    eval_scrambled = float(steps.eval(state.params, steps.put_global(scrambled))["val_loss"][0])

    def update(b):  # Steps.train donates its state: give it a copy each time
        new, metrics = steps.train(jax.tree.map(jnp.copy, state), steps.put_batch(b))
        return jax.device_get(new), jax.device_get(metrics)

    base, m_base = update(batch)
    _, pad_first = compare_trees(base, update(scrambled)[0])
    _, valid_first = compare_trees(base, update(moved)[0])
    n_pad = int((mask == 0).sum())
    return [
        _result(
            "loss: the eval step's mean NLL over valid tokens equals a NumPy reference",
            rel < 1e-5 and int(count) == int(mask.sum()) and eval_scrambled == total,
            f"Steps.eval {ours:.7f} vs numpy(float64) {ref:.7f}, rel diff {rel:.2e} (tol 1e-5); "
            f"counted {int(count)} targets of {int(mask.sum())} valid ({n_pad} padded); padded "
            f"targets changed -> NLL sum {'unchanged' if eval_scrambled == total else 'CHANGED'}",
        ),
        _result(
            "loss: padded targets change nothing in a train step (gradient and update)",
            pad_first is None and valid_first is not None and int(m_base["tokens"]) == mask.sum(),
            f"Steps.train with the {n_pad} padded targets changed: state "
            + ("bitwise unchanged" if pad_first is None else f"CHANGED at {pad_first}")
            + "; one valid target changed: state "
            + ("changed" if valid_first is not None else "UNCHANGED (the check would be blind)")
            + f"; step counted {int(m_base['tokens'])} target tokens",
        ),
    ]


def check_disjoint(
    splits, recorded_split: dict | None, ledger: dict, *, steps: int, batch_size: int
) -> list[dict]:
    """Compare what the run consumed (its window ledger) with windows rebuilt from the validation
    documents.

    ``ledger`` is ``evidence.ledger.read_ledger(run_dir)``: the sha256 of every window the loop drew
    for training and read for evaluation. A validation window in a training batch, or a training
    window in an evaluation batch, fails a check; so does a run that recorded nothing, a ledger that
    misses a step or a batch row of steps 1..``steps`` (what was not recorded was not checked), and
    an unreadable line that a kill cannot have torn. A window whose text occurs in both splits is no
    leak (the pipeline already dropped it from validation).
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
    cov = coverage(ledger, steps, batch_size)
    gaps = cov["missing_steps"] + cov["wrong_row_count_steps"]
    out = [
        _result(
            "data: train and validation documents are disjoint",
            not doc_overlap,
            f"{len(train_names)} train / {len(val_names)} validation documents, "
            f"{len(doc_overlap)} shared",
        ),
        _result(
            "data: the window ledger records every step and batch row, readably",
            cov["complete"] and not ledger["corrupt"],
            f"steps 1..{steps} x {batch_size} rows: {len(cov['missing_steps'])} steps missing "
            f"{cov['missing_steps'][:5]}, {len(cov['wrong_row_count_steps'])} with another row "
            f"count {cov['wrong_row_count_steps'][:5]}; {len(ledger['corrupt'])} corrupt lines "
            f"{ledger['corrupt'][:3]}, {len(ledger['torn'])} torn by a kill"
            if gaps or ledger["corrupt"]
            else f"steps 1..{steps} x {batch_size} rows all recorded; "
            f"{len(ledger['torn'])} lines torn by a kill, none corrupt",
        ),
        _result(
            "data: no validation window was drawn for training (run's window ledger, sha256)",
            bool(drawn) and not leaked and not foreign,
            f"{len(drawn)} distinct windows drawn over {len(ledger['train'])} steps: "
            f"{len(leaked)} from validation documents only, {len(foreign)} not from training "
            "documents"
            if drawn
            else "the run recorded no training windows",
        ),
        _result(
            "data: validation loss read validation windows only (run's window ledger)",
            bool(evals) and not eval_outside and not (evals & train_hashes),
            f"{len(evals)} distinct evaluation windows, {len(eval_outside)} not from validation "
            "documents"
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
    """All checks on the run's trained state (``run_dir``) or on a fresh init of ``config`` (model
    checks only: the data checks need a run's window ledger)."""

    if run_dir is not None:
        from tpulab.train.restore import load_model

        restored = load_model(run_dir)
        config, state = restored.config, restored.state
        steps = make_steps(config, make_mesh())  # the restore's layout: replicated here
    else:
        steps = make_steps(config)
        state = steps.init()
    splits = build_splits(load_corpus(config.data.path), config.data)
    results = check_causal(
        steps.model(state.params), config.data.seq_len, config.model.vocab_size
    ) + check_loss(steps, state, splits.train_windows, config.data.batch_size)
    if run_dir is not None:
        recorded = read_json(RunDir(run_dir).documents, None)
        results += check_disjoint(
            splits,
            recorded,
            read_ledger(run_dir),
            steps=restored.step,  # every step that trained the checked state
            batch_size=config.data.batch_size,
        )
    return results


def table_markdown(results: list[dict]) -> str:
    return table(
        ["check", "result", "detail"],
        [(r["check"], "PASS" if r["passed"] else "FAIL", r["detail"]) for r in results],
    )


def print_table(results: list[dict]) -> None:
    width = max(len(r["check"]) for r in results)
    for r in results:
        print(f"{'PASS' if r['passed'] else 'FAIL'}  {r['check']:<{width}}  {r['detail']}")
