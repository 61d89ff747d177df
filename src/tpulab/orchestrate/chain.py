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
from tpulab.config import load
from tpulab.errors import TpulabError
from tpulab.evidence.metrics import read_records
from tpulab.evidence.report_kit import table
from tpulab.orchestrate import default_size, recipe, report
from tpulab.proofs.transformer import prove_transformer_resume
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
# what the demo-size section does prove (``default_size.mechanics_label``)
PROVES = (
    "pairs, a reward model, DPO and PPO all train from the SFT run through the one loop as real "
    "child processes; DPO killed and resumed in a fresh process matches its uninterrupted run "
    "bitwise; every identity a checkpoint recorded recomputes unchanged from its source; the "
    "frozen reference and reward model are bitwise unchanged at the end; the gold win rate and "
    "PPO's proxy-against-gold curve are measured end to end."
)


def chain_configs(sft_config: RunConfig, sft: Path, pairs: Path, reward: Path, s: ChainSizes):
    """stage name -> RunConfig of the chain's stages (the recipe's, ``recipe.chain``), each laid
    over the source run's config; ``reward``: the run dir of the stage that scores."""
    rl = recipe.chain()["stages"][recipe.chain()["rl"]]["config"]["objective"]
    rl_steps = s.ppo_rounds * rl[rl["kind"]]["epochs"] * rl[rl["kind"]]["minibatches"]  # a round
    values = {
        "source": str(Path(sft).absolute()),
        "pairs": str(Path(pairs).absolute()),
        recipe.chain()["scorer"]: str(Path(reward).absolute()),
        "batch": s.batch,
        "steps": s.steps,
        "warmup": max(1, s.steps // 8),
        "eval_every": s.steps // 2,
        "save_every": s.save_every,
        "rl_steps": rl_steps,
        "rl_warmup": max(1, rl_steps // 8),
        "rollouts": s.ppo_rollouts,
        # a quarter of the context for the reply: 32 bytes at seq 128 (the SFT stop budget), 8 at 32
        "max_new": min(32, sft_config.data.seq_len // 4),
        **{f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name.endswith("_lr")},
        "beta": s.beta,
    }
    stages = recipe.chain()["stages"]
    return {name: recipe.stage_config(sft_config, stage, values) for name, stage in stages.items()}


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
    if sft_config.objective.kind != recipe.source_kind():
        raise TpulabError(f"{sft} is a {sft_config.objective.kind} run, not {recipe.source_kind()}")
    out.mkdir(parents=True, exist_ok=True)
    c = recipe.chain()
    proof = c["resume_proof"]
    runs = chain_runs(sft, out)
    configs = chain_configs(sft_config, sft, runs["pairs"], runs[c["scorer"]], sizes)
    seconds: dict[str, float] = {}

    def timed(name, fn, *args, **kwargs):
        t0 = time.monotonic()
        result = fn(*args, **kwargs)
        seconds[name] = round(time.monotonic() - t0, 1)
        return result

    pairs_cfg = PairsConfig(train_prompts=sizes.train_prompts, eval_prompts=sizes.eval_prompts)
    pairs = timed("pairs", make_pairs, sft, runs["pairs"], pairs_cfg)
    for name in c["stages"]:
        timed(name, recipe.train_stage, name, configs[name], out, compile_cache, env)
    timed(
        f"{proof} resume proof",
        prove_transformer_resume,
        configs[proof],
        out / f"{proof}-resume",
        reference_dir=runs[proof],
        compile_cache=compile_cache,
        env=env,
        # the capstone's own proof resumes on a cold cache; this one shares the chain's, which
        # saves the resumed process its compiles (the verdict records which)
        warm_resume_cache=True,
    )
    wins = {
        name: timed(f"{name} win rate", win_rate, runs[name], sft, sizes.win_prompts)
        for name in c["win_rate"]
    }
    identities = identity_rows(runs, configs)
    record = {
        "sizes": dataclasses.asdict(sizes),
        "pairs": {"counts": pairs["counts"], "identity": pairs["identity"]},
        "identities": identities,
        "win_rate": {k: {f: w[f] for f in WIN_FIELDS} for k, w in wins.items()},
        "resume": {proof: str(RunDir(out / f"{proof}-resume").proof.verdict)},
        "seconds": seconds,
    }
    atomic_write_json(out / "chain.json", record)
    section = chain_section(out, runs, pairs, wins, identities, seconds, rel)
    atomic_write_bytes(out / "chain.md", section.encode())
    problems = changed(identities)
    resume = RunDir(out / f"{proof}-resume").proof.read_verdict()
    if not resume.identical:
        problems.append(f"the {proof.upper()} resume is not identical: {resume.summary}")
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


def chain_runs(sft: Path, out: Path) -> dict[str, Path]:
    """The chain's run dirs by name: its source run, the pairs, each stage's, and the resume
    proof's killed-and-resumed run (``<stage>_resumed``)."""
    c = recipe.chain()
    runs = {c["source"]: Path(sft), "pairs": out / "pairs", **{k: out / k for k in c["stages"]}}
    proof = c["resume_proof"]
    runs[f"{proof}_resumed"] = RunDir(out / f"{proof}-resume").proof.interrupted.root
    return runs


def _recompute(how: str, config: RunConfig, src: Path | None, name: str) -> str:
    """The digest of identity ``name`` of a run of ``config`` made again from ``src`` (the
    recipe's ``recompute``: how; absent, the sha256 of ``src``'s newest checkpoint manifest)."""
    from tpulab.data import dialogue, preference
    from tpulab.data.contract import load_checked
    from tpulab.train.objectives.ppo_prompts import build_prompts

    if how is None:
        return manifest_digest(checkpoint_dir(src))
    if how == "preference":
        return preference.read_dir(src, config.data).identity
    if how == "recorded":
        return read_meta(checkpoint_dir(src))["identities"][name]
    source = dialogue.from_plays(load_checked(config.data), config.data)
    if how == "dialogue":
        return source.identity
    if how == "prompts":
        return build_prompts(source, config.data.seq_len, config.objective.options.max_new).identity
    raise TpulabError(f"the recipe recomputes {name} by {how!r}, which the chain cannot")


def identity_rows(runs: dict[str, Path], configs: dict[str, RunConfig]) -> list[dict]:
    """Every identity the chain's runs' newest checkpoints recorded (``recipe.chain``'s
    ``identities``: the source run's and each stage's), each beside its digest recomputed now from
    where it came from: a model's, the sha256 of its source run's newest checkpoint manifest; the
    pairs', ``preference.read_dir`` of the pairs dir (which also re-checks every file's sha256);
    a dialogue set's or RL prompts', rebuilt from the run's data."""
    source = recipe.chain()["source"]
    configs = {source: load(RunConfig, RunDir(runs[source]).config), **configs}

    def where(name: str | None) -> Path | None:
        if name is None:
            return None
        run, _, field = name.partition(".")
        return Path(getattr(configs[run].objective, field)) if field else runs[run]

    rows = []
    for run, names in recipe.chain()["identities"].items():
        recorded = read_meta(checkpoint_dir(runs[run]))["identities"]
        if set(recorded) - {"data"} != set(names):
            raise TpulabError(
                f"{runs[run]} records identities {sorted(recorded)}; the chain expects "
                f"{sorted(names)}"
            )
        for name, spec in names.items():
            src = where(spec.get("from"))
            now = _recompute(spec.get("recompute"), configs[run], src, name)
            rows.append(
                {
                    "run": run,
                    "name": name,
                    "recorded": recorded[name],
                    "source": spec["what"],
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
    c, chain = pairs["counts"], recipe.chain()
    proved = chain["resume_proof"]
    rm, dpo = _evals(runs[chain["scorer"]])[-1], _evals(runs[proved])[-1]
    dpo_first = next(r for r in read_records(runs[proved]) if r.get("step") == 1 and "loss" in r)
    ppo_evals = _evals(runs[chain["rl"]])
    v = RunDir(out / f"{proved}-resume").proof.read_verdict()
    curves = []
    for name, stage in chain["stages"].items():
        text = report.curves_section(
            runs[name], out / f"{name}-curves.png", f"{rel}/{name}-curves.png"
        )
        curves += [f"### {stage['title']}", "", text.split("\n\n", 1)[1], ""]

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
        [win_row(name) for name in chain["win_rate"]],
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
            f"From `{runs[chain['source']].name}/` (the SFT run): `tpulab pairs` "
            f"({c['train']['pairs']} "
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
            f"![DPO resume]({rel}/{proved}-resume/{rundir.PROOF}/overlay.png)",
            "",
            "Training curves (train loss per step; validation loss where the objective has one):",
            "",
            *curves,
            "Stage seconds: " + ", ".join(f"{k} {x:g}" for k, x in seconds.items()) + ".",
            "",
            f"Evidence: `{rel}/chain.json`, the runs "
            + ", ".join(f"`{rel}/{name}/`" for name in chain["stages"])
            + f" (configs beside them), the pairs `{rel}/pairs/`, the proof "
            f"`{rel}/{proved}-resume/{rundir.PROOF}/{rundir.VERDICT}`.",
        ]
    )


def chain_stage(
    sft: Path, out: Path, compile_cache: Path | None = None, env: dict | None = None
) -> str:
    """The capstone's stage: the chain from the post-training stage's SFT run into
    ``out/posttrain/chain`` (``env``: the capstone's MLflow store for every child)."""
    chain = Path(out) / "posttrain" / "chain"
    return run_chain(sft, chain, DEMO, compile_cache, "posttrain/chain", env)
