"""``tpulab win-rate``: the gold-reward win rate of a policy's greedy replies against another's.

On the held-out plays' prompts (the pretraining validation documents, cut as ``tpulab pairs``
cuts them), both policies reply greedily through the compiled generation loop; each reply is
scored by the gold reward r* (``tpulab.data.preference.gold_reward``, stop byte included when the
reply stopped). The win rate counts a tie as half a win: (wins + ties / 2) / prompts, so two equal
policies score 0.5. Greedy decoding is deterministic on one platform: the same two checkpoints
give the same number.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tpulab.data import dialogue, preference
from tpulab.data.corpus import load_corpus
from tpulab.data.pipeline import split_documents
from tpulab.errors import TpulabError
from tpulab.evidence.provenance import environment
from tpulab.posttrain.pairs import PairsConfig, load_policy, prompts_of, sample


def greedy_rewards(policy, prompts: list[bytes], seq_len: int) -> list[tuple[float, bytes, bool]]:
    replies = sample(policy, prompts, [0] * len(prompts), PairsConfig(temperature=0.0), seq_len)
    return [
        (preference.gold_reward(p, preference.replied(r, stops)), r, stops)
        for p, (r, stops, _) in zip(prompts, replies)
    ]


def win_rate(policy_dir: str | Path, against_dir: str | Path, max_prompts: int = 0) -> dict:
    policy, against = load_policy(policy_dir), load_policy(against_dir)
    cfg = policy.config.data
    if against.config.data.seq_len != cfg.seq_len:
        raise TpulabError(
            f"{against_dir} has data.seq_len={against.config.data.seq_len}, {policy_dir} "
            f"{cfg.seq_len}: their replies would get different room"
        )
    corpus = load_corpus(cfg.path)
    dialogue.check_no_delimiters(corpus)
    prompts = prompts_of(split_documents(corpus, cfg)[1], cfg.seq_len)
    if max_prompts:
        prompts = prompts[:max_prompts]
    if not prompts:
        raise TpulabError(f"no held-out prompt fits data.seq_len={cfg.seq_len}")
    ours = greedy_rewards(policy, prompts, cfg.seq_len)
    theirs = greedy_rewards(against, prompts, cfg.seq_len)
    a = np.array([r for r, _, _ in ours])
    b = np.array([r for r, _, _ in theirs])
    wins, ties = int((a > b).sum()), int((a == b).sum())
    return {
        "policy": _record(policy_dir, policy),
        "against": _record(against_dir, against),
        "prompts": len(prompts),
        "wins": wins,
        "ties": ties,
        "losses": len(prompts) - wins - ties,
        "win_rate": (wins + 0.5 * ties) / len(prompts),
        "gold_mean": {"policy": float(a.mean()), "against": float(b.mean())},
        "stop_rate": {
            "policy": float(np.mean([s for _, _, s in ours])),
            "against": float(np.mean([s for _, _, s in theirs])),
        },
        "replies": [  # per prompt: both replies and their r*
            {
                "prompt": p.decode(),
                "policy": ours[i][1].decode(),
                "policy_gold": ours[i][0],
                "against": theirs[i][1].decode(),
                "against_gold": theirs[i][0],
            }
            for i, p in enumerate(prompts)
        ],
        "decoding": "greedy, compiled generation loop, fp32 KV cache",
        "environment": environment(),
    }


def _record(run_dir, restored) -> dict:
    return {
        "run_dir": str(run_dir),
        "objective": restored.config.objective.kind,
        "step": restored.step,
        "checkpoint_digest": restored.checkpoint_digest,
    }
