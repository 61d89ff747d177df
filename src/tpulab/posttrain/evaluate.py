"""Evaluate an SFT run (full or LoRA) against the base it started from, on the held-out plays.

Three measurements, each on the same held-out pairs (the plays the pretraining split held out for
validation, so nothing measured was seen in training):

- **response loss**: the mean NLL per response byte (the stop byte included: the SFT objective's
  ``masked_xent`` on the deterministic forward) over the held-out pairs, for the base and for the
  run's model; and on the run's own validation batches, through the objective's jitted eval step,
  with the objective's state at step 0 (the base's weights, or zero-B adapters that are the base
  bitwise) and with the run's, so the base starts the run's logged validation curve;
- **stop position**: teacher-forced, how often ETX is the most likely byte right after the
  reference response, and its mean probability there;
- **stop rate**: the share of greedy generations (the compiled batched loop,
  ``tpulab.inference.generate.generate_batch``) that emit the stop byte ETX within ``N`` new bytes,
  ETX included. Each prompt is the held-out pair's ``BOS SOH prompt STX`` with room for ``2N`` new
  bytes (a built-in pair's cue is cut from the left, ``dialogue.fit``, to make it; a JSONL prompt
  that leaves less is skipped). Why ``2N``: every training pair ends within the context, so a model
  learns to emit ETX as the context runs out; a stop within ``N`` comes at least ``N`` positions
  before that, from the answer, not from the context's end. The reference rate is the share of
  held-out responses that are themselves that short (what a model answering like the plays can
  reach); a stop anywhere within the ``2N`` is reported too;
- a few **sample generations** beside the reference responses.

With ``merged`` (a ``tpulab merge-lora`` output of this run) the merged model is measured the same
way and its greedy generations compared with the adapter model's, token for token.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np

from tpulab.checkpoint.store import read_meta
from tpulab.data import dialogue
from tpulab.data.tokenizer import BOS
from tpulab.errors import TpulabError
from tpulab.train.objectives.sft import SFT
from tpulab.train.registry import objective_class

# The record's name of the evaluated run's model (beside base and merged): its objective's kind
TRAINED = SFT.kind
CACHE_POLICY = "fp32"  # generation's KV cache: the model's own precision, no quantisation
MAX_BATCH = 64  # prompts per dispatch of the compiled generation loop


def stop_budget(max_len: int) -> int:
    """N, the new bytes a generation may take to stop: a quarter of the context (32 at the default
    128 positions), so the prompt keeps half of it beside the 2N bytes of room."""
    return max(1, max_len // 4)


def spread(n: int, count: int | None) -> np.ndarray:
    """Indices of ``count`` of ``n`` items spread evenly, first and last included (all: None)."""
    if count is None or count >= n:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, count).round().astype(int))


@dataclasses.dataclass(frozen=True)
class Prompt:
    pair: dialogue.Pair  # the held-out pair (its response is the reference)
    ids: np.ndarray  # BOS SOH prompt STX, leaving the room asked for


def stop_prompts(
    pairs, max_len: int, room: int, count: int, *, cut: bool
) -> tuple[list[Prompt], int]:
    """Up to ``count`` held-out pairs spread evenly over the set (all plays, not the first one),
    as prompts that leave ``room`` positions, and how many were left out because even the
    shortest cut (``cut``: built-in pairs only) leaves less."""
    out, skipped = [], 0
    for i in spread(len(pairs), count):
        p = pairs[i]
        fitted = p if len(p.prompt) + 3 + room <= max_len else None
        if fitted is None and cut:
            # a stand-in response of room - 1 bytes + ETX: fit() cuts the cue to leave the room
            stand_in = dialogue.Pair(p.prompt, b"\0" * (room - 1), p.source)
            fitted = dialogue.fit(stand_in, max_len - 1)
        if fitted is None:
            skipped += 1
            continue
        frame = [BOS, dialogue.PROMPT_START, *fitted.prompt, dialogue.RESPONSE_START]
        out.append(Prompt(p, np.asarray(frame, np.int32)))
    return out, skipped


def greedy(engine, prompts: list[Prompt], max_new: int) -> list[list[int]]:
    """New token ids per prompt (the stop byte included when emitted), greedy, in batches."""
    from tpulab.inference.generate import Request, SamplingConfig, generate_batch

    sampling = SamplingConfig(max_new=max_new, temperature=0.0)
    out = []
    for i in range(0, len(prompts), MAX_BATCH):
        chunk = [Request(p.ids, sampling) for p in prompts[i : i + MAX_BATCH]]
        out += generate_batch(engine, chunk, stop_token=dialogue.STOP)
    return out


def stopped(ids: list[int], max_new: int) -> bool:
    return 0 < len(ids) <= max_new and ids[-1] == dialogue.STOP


def _stop_at(ids: list[int]) -> int | None:
    """How many new bytes it took to emit the stop byte (ETX included), None if it never did."""
    return ids.index(dialogue.STOP) + 1 if dialogue.STOP in ids else None


def text(ids) -> str:
    """Bytes before the stop byte as text (invalid UTF-8 replaced)."""
    from tpulab.inference.generate import decode_text

    ids = list(ids)
    return decode_text(ids[: ids.index(dialogue.STOP)] if dialogue.STOP in ids else ids)


class Engines:
    """Compiled programs per model structure: models with the same parameter names, shapes and
    dtypes (the base, a full SFT model, a merged one) share them, weights passed as the programs'
    argument, so each structure compiles the generation loop and the scoring forward once."""

    def __init__(self):
        self._by_structure = {}

    def _entry(self, model):
        from tpulab.model.decode import Decoder, ModelFns

        fns = ModelFns(model)
        key = tuple((n, x.shape, str(x.dtype)) for n, x in fns.params.items())
        if key not in self._by_structure:
            self._by_structure[key] = (Decoder(fns, CACHE_POLICY), _scorer(fns))
        return fns.params, *self._by_structure[key]

    def decoder(self, model):
        params, dec, _ = self._entry(model)
        dec.params = params
        return dec

    def scores(self, model, batches) -> dict:
        """Over ``batches``: the response loss (mean NLL per masked target, as the SFT objective's
        loss) and, teacher-forced at every pair's stop position (the target after its last
        response byte), how often ETX is the most likely next byte and its mean probability:
        what SFT taught about where to stop, apart from what greedy decoding makes of it."""
        params, _, score = self._entry(model)
        sums = [score(params, *(b[k] for k in ("inputs", "targets", "mask"))) for b in batches]
        total = {k: sum(float(x[k]) for x in sums) for k in sums[0]}
        n = max(total["stops"], 1.0)
        return {
            "response_loss": total["nll"] / max(total["count"], 1.0),
            "stop_accuracy": total["stop_hits"] / n,
            "stop_probability": total["stop_prob"] / n,
        }


def _scorer(fns):
    import jax
    import jax.numpy as jnp

    from tpulab.train.step import masked_xent

    def score(params, inputs_bt, targets_bt, mask_bt):
        logits_btv = fns.full_logits(params, inputs_bt)  # the deterministic training forward
        mean, count = masked_xent(logits_btv, targets_bt, mask_bt)
        at_bt = (targets_bt == dialogue.STOP) & (mask_bt > 0)
        p_stop_bt = jax.nn.softmax(logits_btv.astype(jnp.float32), axis=-1)[..., dialogue.STOP]
        top_bt = jnp.argmax(logits_btv, axis=-1) == dialogue.STOP
        return {
            "nll": mean * count,
            "count": count,
            "stop_hits": jnp.sum(at_bt & top_bt),
            "stop_prob": jnp.sum(jnp.where(at_bt, p_stop_bt, 0.0)),
            "stops": jnp.sum(at_bt),
        }

    return jax.jit(score)


def _verified(run_dir: Path):
    """The SFT run's newest verified checkpoint, and the identities it was trained with."""
    from tpulab.train.restore import load_model

    restored = load_model(run_dir)
    kind = restored.config.objective.kind
    if not issubclass(objective_class(kind), SFT):
        raise TpulabError(
            f"{run_dir} is a {kind} run, not {SFT.kind}: nothing to compare with a base (train "
            f"one with --set objective.kind={SFT.kind} --set objective.init=RUN)"
        )
    return restored, read_meta(restored.checkpoint_dir).get("identities", {})


def _merged(merged: Path, source):
    import json

    from tpulab.train.restore import load_model

    try:
        record = json.loads((Path(merged) / "merge.json").read_text())
    except (OSError, ValueError):
        raise TpulabError(f"{merged} holds no readable merge.json (tpulab merge-lora)") from None
    if record.get("source_checkpoint_digest") != source.checkpoint_digest:
        raise TpulabError(
            f"{merged} was merged from checkpoint "
            f"{str(record.get('source_checkpoint_digest'))[:12]}…, not from "
            f"{source.checkpoint_dir} ({source.checkpoint_digest[:12]}…)"
        )
    return load_model(merged), record


def evaluate_sft(
    run_dir: str | Path,
    *,
    merged: str | Path | None = None,
    with_base: bool = True,
    max_new: int | None = None,
    prompts: int = 64,
    samples: int = 3,
    loss_pairs: int | None = None,
) -> dict:
    """The evaluation record of ``run_dir`` (an SFT run) against its base; see the module doc.

    ``with_base=False`` leaves the base out (a second run from the same base: its numbers are
    the first's). ``max_new`` is N (default ``stop_budget``), ``prompts`` how many held-out
    prompts are generated from, ``loss_pairs`` how many held-out pairs the response loss covers
    (None: all; either spread evenly over the set). Refuses a run whose base or dataset is no
    longer the one it trained on.
    """
    import jax

    from tpulab.evidence.provenance import describe_hardware, environment
    from tpulab.train.loop import evaluate
    from tpulab.train.step import make_mesh

    run_dir = Path(run_dir)
    restored, trained_ids = _verified(run_dir)
    config = restored.config
    objective = objective_class(config.objective.kind)(config)  # reads the base and the data
    for name, digest in objective.identities().items():
        if trained_ids.get(name) != digest:
            raise TpulabError(
                f"{run_dir} was trained on {name} {str(trained_ids.get(name))[:12]}…, but its "
                f"objective now gives {digest[:12]}… ({config.objective.init}); refusing to "
                "compare against another model or dataset"
            )
    models = {"base": objective.base.model} if with_base else {}
    models[TRAINED] = restored.model
    merge_record = None
    if merged is not None:
        if restored.base is None:
            raise TpulabError(f"{run_dir} is not a LoRA run: there is no merged model to compare")
        merged_model, merge_record = _merged(Path(merged), restored)
        models["merged"] = merged_model.model
    pairs = objective.dialogue.eval
    rows = dialogue.encode(pairs, config.data.seq_len)[spread(len(pairs), loss_pairs)]
    bs = config.data.batch_size
    batches = dialogue.eval_batches(rows, bs, math.ceil(len(rows) / bs))
    t0 = time.perf_counter()
    engines = Engines()
    scores = {name: engines.scores(model, batches) for name, model in models.items()}
    # The objective's own eval step on the run's validation batches (what the loop logged as
    # val_loss): the base's (the objective's state at step 0) starts that curve, the run's equals
    # its last logged val_loss (same program, parameters and batches).
    steps = objective.steps(make_mesh())  # every device here, whatever mesh trained the run
    run_batches = objective.data().eval_batches
    trained = {TRAINED: restored.state.params}
    if with_base:
        trained["base"] = steps.init().params
    for name, params in trained.items():
        scores[name]["val_loss"] = evaluate(steps, params, run_batches)["val_loss"]
    loss_s = time.perf_counter() - t0

    max_len = config.model.max_seq_len
    n_new = stop_budget(max_len) if max_new is None else int(max_new)
    room = 2 * n_new
    if not 0 < room < max_len:
        raise TpulabError(
            f"max_new={n_new} leaves no prompt: 2 x max_new must be under the model's {max_len} "
            "positions"
        )
    cut = objective.dialogue.params.get("source") == "plays"
    chosen, skipped = stop_prompts(pairs, max_len, room, prompts, cut=cut)
    t0 = time.perf_counter()
    generated = {
        name: greedy(engines.decoder(model), chosen, room) if chosen else []
        for name, model in models.items()
    }
    generate_s = time.perf_counter() - t0
    reference = [list(p.pair.response) + [dialogue.STOP] for p in chosen]

    def rate(gens, within):
        return float(np.mean([stopped(g, within) for g in gens])) if gens else None

    def stop_lengths(gens):
        return [len(g) for g in gens if stopped(g, room)]

    per_model = {
        name: {
            **scores[name],
            "stop_rate": rate(generated[name], n_new),
            "stop_rate_in_room": rate(generated[name], room),
            "median_stop_bytes": float(np.median(stop_lengths(generated[name])))
            if stop_lengths(generated[name])
            else None,
        }
        for name in models
    }
    env = environment()
    record = {
        "run_dir": str(run_dir),
        "checkpoint": {"step": restored.step, "digest": restored.checkpoint_digest},
        "base": {
            "run_dir": str(config.objective.init),
            "step": objective.base.step,
            "digest": objective.base.checkpoint_digest,
        },
        "lora": dataclasses.asdict(config.objective.lora) if restored.base is not None else None,
        "dataset": {
            "identity": objective.dialogue.identity,
            "eval_pairs": len(pairs),
            "loss_pairs": len(rows),
            "val_pairs": int(sum(float((b["mask"].sum(axis=1) > 0).sum()) for b in run_batches)),
            "eval_sources": sorted({p.source for p in pairs}),
            "response_tokens": int(sum(float(b["mask"].sum()) for b in batches)),
        },
        "models": per_model,
        "stop": {
            "max_new": n_new,
            "room": room,
            "stop_byte": dialogue.STOP,
            "prompts": len(chosen),
            "skipped_prompts": skipped,
            "reference_rate": rate(reference, n_new),
            "cache_policy": CACHE_POLICY,
            "decoding": "greedy",
        },
        "samples": [
            {
                "source": p.pair.source,
                "prompt": text(p.ids[2:-1]),
                "reference": p.pair.response.decode("utf-8", errors="replace"),
                **{name: text(generated[name][i]) for name in models},
                **{f"{name}_stop_bytes": _stop_at(generated[name][i]) for name in models},
            }
            for i, p in enumerate(chosen[:samples])
        ],
        "seconds": {"response_loss": round(loss_s, 3), "generation": round(generate_s, 3)},
        "provenance": {
            "hardware": describe_hardware(env),
            "backend": env["backend"],
            "device_kind": env["device_kind"],
            "device_count": env["device_count"],
            "packages": env["packages"],
            "git_commit": env["git_commit"],
            "time_utc": env["time_utc"],
            "dtypes": dataclasses.asdict(config.precision),
            "shapes": {
                "eval_batch": bs,
                "seq_len": config.data.seq_len,
                "max_seq_len": max_len,
                "d_model": config.model.d_model,
                "n_layers": config.model.n_layers,
                "n_heads": config.model.n_heads,
            },
            "jax_devices": [str(d) for d in jax.devices()],
        },
    }
    if merge_record is not None:
        same = [a == b for a, b in zip(generated["merged"], generated[TRAINED])]
        record["merged"] = {
            "run_dir": str(merged),
            "digest": merge_record["merged_checkpoint_digest"],
            "identical_generations": int(sum(same)),
            "generations": len(same),
            "max_relative_logit_diff": merge_record["max_relative_logit_diff"],
            "bound": merge_record["bound"],
        }
    return record


def metrics_of(record: dict) -> dict[str, float]:
    """The record's numbers as flat MLflow metric names (``eval.sft.stop_rate``, ...)."""
    out = {
        f"eval.{name}.{k}": float(v)
        for name, m in record["models"].items()
        for k, v in m.items()
        if v is not None  # a rate over no prompts
    }
    out["eval.stop.max_new"] = float(record["stop"]["max_new"])
    if record["stop"]["reference_rate"] is not None:
        out["eval.stop.reference_rate"] = record["stop"]["reference_rate"]
    if "merged" in record:
        m = record["merged"]
        out["eval.merged.identical_generation_share"] = m["identical_generations"] / max(
            m["generations"], 1
        )
    return out


def log_to_run(run_dir: str | Path, record: dict, files: list[Path] = ()) -> bool:
    """Add the evaluation's numbers (at the run's checkpoint step) and ``files`` to the MLflow run
    ``run_dir`` logged to. False, with one warning line, when it has none or the store fails."""
    from tpulab.tracking.store import cause, log_files_to_run, open_store, read_run_link

    link = read_run_link(run_dir)
    if not link:
        print(f"warning: {run_dir} has no MLflow run to log the evaluation to", file=sys.stderr)
        return False
    try:
        from mlflow.entities import Metric

        client, _ = open_store(link["tracking_uri"])
        now = int(time.time() * 1000)
        step = int(record["checkpoint"]["step"])
        client.log_batch(
            link["run_id"],
            metrics=[Metric(k, v, now, step) for k, v in sorted(metrics_of(record).items())],
        )
    except Exception as e:  # noqa: BLE001 - any store failure: one line, the evaluation stands
        print(
            f"warning: could not log the evaluation to MLflow run {link.get('run_id')}: {cause(e)}",
            file=sys.stderr,
        )
        return False
    return log_files_to_run(run_dir, list(files), "posttrain") if files else True
