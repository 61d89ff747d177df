"""The preference chain from an SFT run: `tpulab pairs` -> reward model -> DPO and PPO, at the
demo's size, and its report section (`tpulab posttrain`, the capstone's "preference chain" stage).

Every training stage is a real `tpulab train` child (the one loop; the caller's MLflow store and
compilation cache reach it through the environment and ``--compile-cache``), its config written
beside its run dir. PPO scores with the chain's reward run; its reference is the SFT run (the
default: the init checkpoint, loaded as a separate frozen copy). DPO is also run through the
kill/resume proof (`prove-resume`'s driver, the chain's DPO run as the uninterrupted reference).

The section shows: one curve figure per stage (``report.curves_section``, from metrics.jsonl),
PPO's proxy and gold reward against its KL at every evaluation (the over-optimisation curve of
Gao et al., arXiv:2210.10760, as a table), the gold win rates of DPO's and PPO's greedy replies
against SFT's, the identity table (every digest a run's newest checkpoint recorded, recomputed
now from its source run or dataset) and the resume verdict. Sizes are the demo's (``DEMO``), so
the section is labelled a mechanics check and shows the committed default-size results beside
its own (``default_size``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

from tpulab.checkpoint import rundir
from tpulab.checkpoint.files import (
    atomic_write_bytes,
    atomic_write_json,
    check_out,
    manifest_digest,
)
from tpulab.checkpoint.rundir import RunDir
from tpulab.checkpoint.store import read_meta
from tpulab.config import from_dict, load, to_dict
from tpulab.errors import TpulabError
from tpulab.evidence.metrics import read_records
from tpulab.evidence.report_kit import table
from tpulab.orchestrate import default_size, report
from tpulab.proofs.driver import run_to_completion
from tpulab.proofs.transformer import prove_transformer_resume, train_child_argv, write_child_config
from tpulab.train.config import RunConfig
from tpulab.train.restore import checkpoint_dir


@dataclasses.dataclass(frozen=True)
class ChainSizes:
    """How much each stage trains. The demo's: 48 + 16 prompts for the pairs, 16 steps of 4 pairs
    for the reward model and DPO (checkpoints every 4: the proof kills after step 9, resumes from
    8), PPO 3 rounds of 8 rollouts, 2 epochs x 2 minibatches (12 steps), evaluated every 3 steps."""

    train_prompts: int = 48
    eval_prompts: int = 16
    batch: int = 4
    steps: int = 16
    save_every: int = 4
    ppo_rounds: int = 3
    ppo_rollouts: int = 8
    win_prompts: int = 16
    reward_lr: float = 1e-3
    dpo_lr: float = 3e-4
    ppo_lr: float = 3e-4
    beta: float = 0.1


DEMO = ChainSizes()
STAGES = ("reward", "dpo", "ppo")
# what the demo-size section does prove (``default_size.mechanics_label``)
PROVES = (
    "pairs, a reward model, DPO and PPO all train from the SFT run through the one loop as real "
    "child processes; DPO killed and resumed in a fresh process matches its uninterrupted run "
    "bitwise; every identity a checkpoint recorded recomputes unchanged from its source; the "
    "frozen reference and reward model are bitwise unchanged at the end; the gold win rate and "
    "PPO's proxy-against-gold curve are measured end to end."
)


def chain_configs(sft_config: RunConfig, sft: Path, pairs: Path, reward: Path, s: ChainSizes):
    """name -> RunConfig of the chain's reward, DPO and PPO runs, from the SFT run's config."""
    lora = {**to_dict(sft_config)["objective"]["lora"], "rank": 0}  # full fine-tuning

    def cfg(objective: dict, steps: int, lr: float, eval_every: int, save_every: int, batch: int):
        d = to_dict(sft_config)
        d["objective"] = {"init": str(Path(sft).absolute()), "lora": lora, **objective}
        d["data"].update(batch_size=batch)
        d["optim"].update(lr=lr, warmup_steps=max(1, steps // 8), schedule_steps=steps)
        d["train"].update(steps=steps, eval_every=eval_every, eval_batches=2)
        # synchronous saves: the proof's kill must find the previous checkpoint committed (an
        # async save still in flight at load ~20 made a resume start from scratch)
        d["checkpoint"].update(save_every=save_every, keep=2, async_save=False)
        return from_dict(RunConfig, d)

    data = str(Path(pairs).absolute())
    pref = dict(steps=s.steps, eval_every=s.steps // 2, save_every=s.save_every, batch=s.batch)
    ppo_steps = s.ppo_rounds * 4  # 2 epochs x 2 minibatches a round
    # a quarter of the context for the reply: 32 bytes at seq 128 (the SFT stop budget), 8 at 32
    max_new = min(32, sft_config.data.seq_len // 4)
    return {
        "reward": cfg({"kind": "reward", "data": data}, lr=s.reward_lr, **pref),
        "dpo": cfg({"kind": "dpo", "data": data, "dpo": {"beta": s.beta}}, lr=s.dpo_lr, **pref),
        "ppo": cfg(
            {
                "kind": "ppo",
                "data": None,
                "reward_model": str(Path(reward).absolute()),
                "ppo": {
                    "rollouts": s.ppo_rollouts,
                    "max_new": max_new,
                    "epochs": 2,
                    "minibatches": 2,
                },
            },
            steps=ppo_steps,
            lr=s.ppo_lr,
            eval_every=3,
            save_every=4,
            batch=s.batch,
        ),
    }


def run_chain(
    sft: str | Path,
    out: str | Path,
    sizes: ChainSizes = DEMO,
    compile_cache: Path | None = None,
    rel: str = ".",
    env: dict | None = None,
) -> str:
    """Run the chain from the SFT run ``sft`` into ``out`` (new or empty), write ``out/chain.md``
    and ``out/chain.json`` and return the section (its links: ``rel``, the path of ``out`` from
    where the section is read; ``env``: added to every child's environment, the capstone's
    MLflow store). Raises TpulabError (after writing both) when an identity changed or the resume
    is not bitwise."""
    from tpulab.posttrain.pairs import PairsConfig, make_pairs
    from tpulab.posttrain.winrate import win_rate

    sft, out = Path(sft), check_out(out)
    if not RunDir(sft).config.is_file():
        raise TpulabError(f"{sft} is not a run dir (no {rundir.CONFIG}); give an SFT run's dir")
    sft_config = load(RunConfig, RunDir(sft).config)
    if sft_config.objective.kind != "sft":
        raise TpulabError(f"{sft} is a {sft_config.objective.kind} run, not sft")
    out.mkdir(parents=True, exist_ok=True)
    runs = {"sft": sft, "pairs": out / "pairs", **{k: out / k for k in STAGES}}
    runs["dpo_resumed"] = RunDir(out / "dpo-resume").proof.interrupted.root
    configs = chain_configs(sft_config, sft, runs["pairs"], runs["reward"], sizes)
    seconds: dict[str, float] = {}

    def timed(name, fn, *args, **kwargs):
        t0 = time.monotonic()
        result = fn(*args, **kwargs)
        seconds[name] = round(time.monotonic() - t0, 1)
        return result

    pairs_cfg = PairsConfig(train_prompts=sizes.train_prompts, eval_prompts=sizes.eval_prompts)
    pairs = timed("pairs", make_pairs, sft, runs["pairs"], pairs_cfg)
    for name in STAGES:
        path = write_child_config(configs[name], out / f"{name}.yaml")
        argv = train_child_argv(path, runs[name], compile_cache=compile_cache)
        timed(
            name,
            run_to_completion,
            argv,
            out / f"{name}.log",
            {**os.environ, **(env or {})},
            1800,
            f"{name} run",
        )
    timed(
        "dpo resume proof",
        prove_transformer_resume,
        configs["dpo"],
        out / "dpo-resume",
        reference_dir=runs["dpo"],
        compile_cache=compile_cache,
        env=env,
        # the capstone's own proof resumes on a cold cache; this one shares the chain's, which
        # saves the resumed process its compiles (the verdict records which)
        warm_resume_cache=True,
    )
    wins = {
        name: timed(f"{name} win rate", win_rate, runs[name], sft, sizes.win_prompts)
        for name in ("dpo", "ppo")
    }
    identities = identity_rows(runs, configs)
    record = {
        "sizes": dataclasses.asdict(sizes),
        "pairs": {"counts": pairs["counts"], "identity": pairs["identity"]},
        "identities": identities,
        "win_rate": {k: {f: w[f] for f in WIN_FIELDS} for k, w in wins.items()},
        "resume": {"dpo": str(RunDir(out / "dpo-resume").proof.verdict)},
        "seconds": seconds,
    }
    atomic_write_json(out / "chain.json", record)
    section = chain_section(out, runs, pairs, wins, identities, seconds, rel)
    atomic_write_bytes(out / "chain.md", section.encode())
    problems = changed(identities)
    resume = RunDir(out / "dpo-resume").proof.read_verdict()
    if not resume.identical:
        problems.append(f"the DPO resume is not identical: {resume.summary}")
    if problems:
        raise TpulabError(f"preference chain: {'; '.join(problems)} (see {out})")
    return section


def changed(rows: list[dict]) -> list[str]:
    """One line per identity whose recomputed digest is not the one recorded."""
    return [
        f"{r['run']}'s {r['name']} changed ({r['recorded'][:12]}… recorded, "
        f"{r['recomputed'][:12]}… now)"
        for r in rows
        if not r["unchanged"]
    ]


WIN_FIELDS = ("prompts", "wins", "ties", "losses", "win_rate", "gold_mean", "stop_rate")


def identity_rows(runs: dict[str, Path], configs: dict[str, RunConfig]) -> list[dict]:
    """Every identity the SFT, reward, DPO and PPO runs' newest checkpoints recorded, each beside
    its digest recomputed now from where it came from: a model's, the sha256 of its source run's
    newest checkpoint manifest; the pairs', ``preference.read_dir`` of the pairs dir (which also
    re-checks every file's sha256); PPO's prompts', rebuilt from the SFT data."""
    from tpulab.data import dialogue, preference
    from tpulab.data.contract import load_checked
    from tpulab.train.objectives.ppo_prompts import build_prompts

    sft_config = load(RunConfig, RunDir(runs["sft"]).config)
    model = lambda run: manifest_digest(checkpoint_dir(run))  # noqa: E731
    ppo = configs["ppo"]

    def ppo_prompts() -> str:
        source = dialogue.from_plays(load_checked(ppo.data), ppo.data)
        return build_prompts(source, ppo.data.seq_len, ppo.objective.ppo.max_new).identity

    sft, pairs, reward = runs["sft"], runs["pairs"], runs["reward"]
    sources = {
        "sft": {
            "base": (Path(sft_config.objective.init), "the pretrained run"),
            "dataset": (None, "the dialogue pairs of the training plays"),
        },
        "reward": {"base": (sft, "the SFT run (init)"), "dataset": (pairs, "`tpulab pairs`")},
        "dpo": {
            "base": (sft, "the SFT run (init)"),
            "reference": (sft, "the SFT run, a separate frozen copy"),
            "dataset": (pairs, "`tpulab pairs`"),
            "reference_logprobs": (
                runs["dpo_resumed"],
                "the reference's log-probs of the pairs, computed at the run's start",
            ),
        },
        "ppo": {
            "init": (sft, "the SFT run"),
            "reference": (sft, "the SFT run, a separate frozen copy"),
            "reward_model": (reward, "the chain's reward run"),
            "dataset": (None, "PPO's prompts from the SFT dialogue set"),
        },
    }
    recompute = {
        ("sft", "dataset"): lambda: (
            dialogue.from_plays(load_checked(sft_config.data), sft_config.data).identity
        ),
        ("ppo", "dataset"): ppo_prompts,
        ("reward", "dataset"): lambda: preference.read_dir(pairs, sft_config.data).identity,
        ("dpo", "dataset"): lambda: preference.read_dir(pairs, sft_config.data).identity,
        # recomputed by the resume proof's fresh processes from the reference and the pairs (the
        # loop refuses a resume whose table differs from the one its checkpoint names)
        ("dpo", "reference_logprobs"): lambda: read_meta(checkpoint_dir(runs["dpo_resumed"]))[
            "identities"
        ]["reference_logprobs"],
    }
    rows = []
    for run, names in sources.items():
        recorded = read_meta(checkpoint_dir(runs[run]))["identities"]
        if set(recorded) - {"data"} != set(names):
            raise TpulabError(
                f"{runs[run]} records identities {sorted(recorded)}; the chain expects "
                f"{sorted(names)}"
            )
        for name, (src, what) in names.items():
            now = recompute[(run, name)]() if (run, name) in recompute else model(src)
            rows.append(
                {
                    "run": run,
                    "name": name,
                    "recorded": recorded[name],
                    "source": what,
                    "source_dir": None if src is None else str(src),
                    "recomputed": now,
                    "unchanged": now == recorded[name],
                }
            )
    return rows


def _evals(run: Path) -> list[dict]:
    return [r for r in read_records(run) if r.get("event") == "eval"]


def chain_section(
    out: Path,
    runs: dict[str, Path],
    pairs: dict,
    wins: dict[str, dict],
    identities: list[dict],
    seconds: dict[str, float],
    rel: str,
) -> str:
    """The Markdown section (``rel``: the path of ``out`` in its links); plots each stage's
    curves."""
    c = pairs["counts"]
    rm, dpo = _evals(runs["reward"])[-1], _evals(runs["dpo"])[-1]
    dpo_first = next(r for r in read_records(runs["dpo"]) if r.get("step") == 1 and "loss" in r)
    ppo_evals = _evals(runs["ppo"])
    proof = RunDir(out / "dpo-resume").proof
    v = proof.read_verdict()
    curves = []
    for name, title in (("reward", "reward model"), ("dpo", "DPO"), ("ppo", "PPO")):
        text = report.curves_section(
            runs[name], out / f"{name}-curves.png", f"{rel}/{name}-curves.png"
        )
        curves += [f"### {title}", "", text.split("\n\n", 1)[1], ""]

    def win_row(name):
        w = wins[name]
        return [
            f"{name.upper()} vs SFT",
            w["prompts"],
            f"{w['win_rate']:.3f}",
            f"{w['wins']} / {w['ties']} / {w['losses']}",
            f"{w['gold_mean']['policy']:.3f} / {w['gold_mean']['against']:.3f}",
            f"{w['stop_rate']['policy']:.3f} / {w['stop_rate']['against']:.3f}",
        ]

    results = table(
        ["stage", "result"],
        [
            [
                f"reward model, accuracy on {c['eval']['pairs']} held-out pairs",
                f"{rm['val_accuracy']:.3f} (gold-optimal {rm['val_gold_optimal_accuracy']:.3f}; "
                f"margin {rm['val_margin']:.3f})",
            ],
            ["DPO step-1 loss", f"{dpo_first['loss']!r} (ln 2 = {math.log(2)!r})"],
            [
                "DPO held-out pair accuracy, KL(ref || pi) per reply (a sample estimate)",
                f"{dpo['val_reward_accuracy']:.3f}, {dpo['val_kl_ref']:.3f} nats",
            ],
            [
                "PPO, last evaluation: proxy / gold reward, KL",
                f"{ppo_evals[-1]['val_reward']:.3f} / {ppo_evals[-1]['val_gold_reward']:.3f}, "
                f"{ppo_evals[-1]['val_kl']:.3f} nats",
            ],
        ],
    )
    win_table = table(
        [
            "policy",
            "prompts",
            "win rate",
            "wins / ties / losses",
            "mean r*: policy / SFT",
            "stop rate: policy / SFT",
        ],
        [win_row("dpo"), win_row("ppo")],
    )
    curve_table = table(
        ["step", "KL to the reference (nats per reply)", "proxy reward", "gold reward r*"]
        + ["reply bytes"],
        (
            [
                e["step"],
                f"{e['val_kl']:.4f}",
                f"{e['val_reward']:.4f}",
                f"{e['val_gold_reward']:.4f}",
                f"{e['val_response_length']:.1f}",
            ]
            for e in ppo_evals
        ),
    )
    identity_table = table(
        ["run", "identity", "recorded digest", "from", "recomputed", "unchanged"],
        (
            [
                r["run"],
                r["name"],
                f"`{r['recorded'][:16]}`",
                r["source"],
                f"`{r['recomputed'][:16]}`",
                "yes" if r["unchanged"] else "**NO**",
            ]
            for r in identities
        ),
    )
    unchanged = sum(r["unchanged"] for r in identities)
    return "\n".join(
        [
            "## Preference chain: reward model, DPO and PPO from the SFT run",
            "",
            f"From `{runs['sft'].name}/` (the SFT run): `tpulab pairs` ({c['train']['pairs']} "
            f"training and {c['eval']['pairs']} held-out pairs sampled from SFT, labelled "
            f"Bradley-Terry on the gold reward r*; dataset `{pairs['identity'][:16]}`), then a "
            "reward model and DPO on those pairs and PPO scored by that reward model, each a "
            "`tpulab train` child of the one loop.",
            "",
            default_size.mechanics_label(PROVES, "beside this run's in the table below"),
            "",
            default_size.comparison(
                default_size.headline(rm["val_accuracy"], c["eval"]["pairs"], wins)
            ),
            "",
            results,
            "",
            "Gold win rate of greedy replies against SFT's on the first held-out prompts "
            "(ties count half):",
            "",
            win_table,
            "",
            "PPO's proxy reward (the reward model's score) and gold reward r* of its replies to "
            "held-out prompts against the KL to the reference, at every evaluation (Gao et al., "
            "arXiv:2210.10760: the proxy can rise while the gold falls):",
            "",
            curve_table,
            "",
            f"Identities: every digest the runs' newest checkpoints recorded, recomputed now from "
            f"its source: **{unchanged} of {len(identities)} unchanged**. The frozen reference "
            "and reward model were also checked bitwise at the end of each run by the loop "
            f"(`frozen_sha256` in each {rundir.SUMMARY}).",
            "",
            identity_table,
            "",
            f"Resume: DPO killed with {v.signal} after step {v.kill_step}, resumed from "
            f"step {v.resumed_from_step} in a fresh process, against the chain's DPO run: "
            f"**{'bitwise identical' if v.identical else 'NOT identical'}** "
            f"({v.summary}).",
            "",
            f"![DPO resume]({rel}/dpo-resume/{rundir.PROOF}/overlay.png)",
            "",
            "Training curves (train loss per step; validation loss where the objective has one):",
            "",
            *curves,
            "Stage seconds: " + ", ".join(f"{k} {x:g}" for k, x in seconds.items()) + ".",
            "",
            f"Evidence: `{rel}/chain.json`, the runs `{rel}/reward/`, `{rel}/dpo/`, `{rel}/ppo/` "
            f"(configs beside them), the pairs `{rel}/pairs/`, the proof "
            f"`{rel}/dpo-resume/{rundir.PROOF}/{rundir.VERDICT}`.",
        ]
    )


def chain_stage(
    sft: Path, out: Path, compile_cache: Path | None = None, env: dict | None = None
) -> str:
    """The capstone's stage: the chain from the post-training stage's SFT run into
    ``out/posttrain/chain`` (``env``: the capstone's MLflow store for every child)."""
    chain = Path(out) / "posttrain" / "chain"
    return run_chain(sft, chain, DEMO, compile_cache, "posttrain/chain", env)
