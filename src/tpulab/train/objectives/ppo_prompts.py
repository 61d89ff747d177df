"""PPO's prompts: the SFT prompts (``tpulab.data.dialogue``) as rows the rollouts start from.

Each prompt is cut from the left (built-in pairs, as ``dialogue.fit`` cuts them; a user's prompt is
kept whole or left out) to leave ``objective.ppo.max_new`` reply bytes in ``data.seq_len``. The
data source gives every step a batch, each prompt batch repeated for the ``epochs x minibatches``
steps of its round: a round's steps all see the prompts it sampled from (only its first reads
them), no prompt is skipped, and the data position stays exactly the loop step.
"""

from __future__ import annotations

import grain
import numpy as np

from tpulab.data import dialogue
from tpulab.data.config import DataConfig
from tpulab.data.heldout import HeldOutSet, identity_hash
from tpulab.data.pipeline import READ_OPTIONS, process_batches
from tpulab.data.tokenizer import BOS, PAD
from tpulab.errors import TpulabError

PROMPT_BUILDER = "tpulab-ppo-prompts-v1"


class Prompts(HeldOutSet):
    """Prompt rows [P, W + 1]: BOS SOH prompt STX, PAD to width W, then the length."""

    builder, unit = PROMPT_BUILDER, "prompts"


def prompt_rows(pairs, seq_len: int, max_new: int, cut: bool) -> np.ndarray:
    """Distinct prompts that leave ``max_new`` reply tokens in ``seq_len`` positions (built-in
    pairs are cut from the left, as ``dialogue.fit`` cuts them; a user's prompt is kept whole or
    left out)."""
    width = seq_len - max_new
    rows, seen = [], set()
    for pair in pairs:
        room = dialogue.Pair(pair.prompt, b"x" * (max_new - 1), pair.source)
        fitted = dialogue.fit(room, seq_len - 1) if cut else room
        if fitted is None or fitted.prompt in seen:
            continue
        ids = [BOS, dialogue.PROMPT_START, *fitted.prompt, dialogue.RESPONSE_START]
        if len(ids) > width:
            continue
        seen.add(fitted.prompt)
        row = np.full(width + 1, PAD, np.int32)
        row[: len(ids)], row[-1] = ids, len(ids)
        rows.append(row)
    return np.stack(rows) if rows else np.zeros((0, width + 1), np.int32)


def build_prompts(source: dialogue.Dialogue, seq_len: int, max_new: int) -> Prompts:
    cut = source.params.get("source") == "plays"
    train = prompt_rows(source.train, seq_len, max_new, cut)
    evals = prompt_rows(source.eval, seq_len, max_new, cut)
    params = {"dialogue_identity": source.identity, "seq_len": seq_len, "max_new": max_new}
    for part, rows in (("training", train), ("evaluation", evals)):
        if not len(rows):
            raise TpulabError(
                f"no {part} prompt leaves objective.ppo.max_new={max_new} reply bytes in "
                f"data.seq_len={seq_len}"
            )
    h = identity_hash(PROMPT_BUILDER, params)
    for rows in (train, evals):
        h.update(rows.tobytes())
    return Prompts(train, evals, params, h.hexdigest())


def prompt_batch(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Prompt rows -> ``inputs`` [B, W] (BOS SOH prompt STX, PAD after) and ``length`` [B]."""
    return {"inputs": rows[:, :-1], "length": rows[:, -1]}


def prompt_dataset(
    rows: np.ndarray, cfg: DataConfig, per_round: int, index: int = 0, count: int = 1
) -> grain.IterDataset:
    """Shuffled, repeated prompt batches, each given to the ``per_round`` steps of its round; each
    process its own rows of every batch (``tpulab.data.pipeline.process_batches``)."""
    batches = process_batches(rows, cfg, index, count)
    steps = grain.MapDataset.range(len(batches)).map(lambda i: batches[i // per_round])
    return steps.map(prompt_batch).to_iter_dataset(READ_OPTIONS)


def eval_prompt_batches(rows: np.ndarray, batch_size: int, max_batches: int) -> list[dict]:
    """The first ``max_batches`` batches of held-out prompts, with ``mask`` [B, W] 1 on each
    prompt's tokens; a short last batch is filled with idle rows (mask 0: nothing sampled, nothing
    counted)."""
    rows = rows[: batch_size * max_batches]
    live = np.ones(len(rows), np.float32)
    short = -len(rows) % batch_size
    if short:
        filler = np.full((short, rows.shape[1]), PAD, np.int32)
        filler[:, 0], filler[:, -1] = BOS, 1
        rows, live = np.concatenate([rows, filler]), np.concatenate([live, np.zeros(short)])
    out = []
    for i in range(0, len(rows), batch_size):
        b = prompt_batch(rows[i : i + batch_size])
        on = np.arange(b["inputs"].shape[1])[None] < b["length"][:, None]
        out.append({**b, "mask": (on * live[i : i + batch_size, None]).astype(np.float32)})
    return out


def check_prompt_batch(batch: dict[str, np.ndarray]) -> None:
    width = batch["inputs"].shape[1]
    lengths = batch["length"]
    if (lengths < 4).any() or (lengths > width).any() or (batch["inputs"][:, 0] != BOS).any():
        raise TpulabError(
            f"a PPO prompt batch holds a row that is not BOS SOH prompt STX <= {width}"
        )
