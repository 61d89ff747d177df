"""The preference chain at the default size, end to end: pretrain -> SFT -> sampled pairs -> reward
model, DPO and PPO, scored against the gold reward r* (``tpulab.data.preference``).

Every stage is the library call the CLI makes (``train``, ``make_pairs``, ``win_rate``) on
``configs/default.yaml`` (4 layers, d_model 128, seq 128, fp32). Reported: the pairs' gold-optimal
accuracy (the best any reward model can reach on their Bradley-Terry labels), the reward model's
held-out accuracy against it, DPO's held-out pair accuracy and the KL(ref || pi) it reached, PPO's
over-optimisation curve (proxy reward, gold reward r* and KL to the reference on held-out prompts,
per evaluation) and the KL it reached, and the gold-reward win rates of DPO's and PPO's greedy
replies against SFT's on the held-out plays.

    .venv/bin/python benchmarks/preference_chain.py [--steps 300] [--train-prompts 2048]
    .venv/bin/python benchmarks/preference_chain.py --reuse runs/old-chain --steps 200 ...

``--reuse DIR`` takes each stage DIR holds (DIR/base, sft, pairs, reward, dpo, ppo) in place,
read-only, once it loads (verified checkpoint, every pair line checked), its config is the one this
script would run and its recorded identities name the stages before it; the missing stages run
into ``--runs``. Writes benchmarks/results/preference_chain.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
from tpulab.checkpoint.rundir import RunDir
from tpulab.config import identity_diff, load, to_dict
from tpulab.errors import TpulabError
from tpulab.evidence.metrics import read_records
from tpulab.evidence.report_kit import table
from tpulab.perf.timing import benchmark_environment
from tpulab.process_setup import prepare
from tpulab.train.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "default.yaml"
STAGES = ("base", "sft", "pairs", "reward", "dpo", "ppo")


def last_eval(run: Path) -> dict:
    return [r for r in read_records(run) if r.get("event") == "eval"][-1]


def stage_sets(args, runs: dict) -> dict[str, list[str]]:
    """Each training stage's ``--set`` overrides on configs/default.yaml."""
    steps = [f"train.steps={args.steps}", f"optim.schedule_steps={args.steps}"]
    pref = [f"objective.init={runs['sft']}", f"objective.data={runs['pairs']}"]
    ppo_steps = args.ppo_rounds * 4  # objective.ppo.epochs x minibatches: 2 x 2 (the default)
    return {
        "base": steps,
        "sft": [*steps, "objective.kind=sft", f"objective.init={runs['base']}"],
        "reward": [*steps, "objective.kind=reward", *pref, f"optim.lr={args.rm_lr}"],
        "dpo": [
            *steps,
            "objective.kind=dpo",
            *pref,
            f"optim.lr={args.dpo_lr}",
            f"objective.dpo.beta={args.beta}",
        ],
        "ppo": [
            f"train.steps={ppo_steps}",
            f"optim.schedule_steps={ppo_steps}",
            f"optim.warmup_steps={min(50, ppo_steps // 10)}",
            f"optim.lr={args.ppo_lr}",
            f"train.eval_every={args.ppo_eval_every * 4}",
            f"train.eval_batches={args.ppo_eval_batches}",
            f"checkpoint.save_every={args.ppo_eval_every * 4}",
            "objective.kind=ppo",
            f"objective.init={runs['sft']}",
            f"objective.reward_model={runs['reward']}",
            f"objective.ppo.kl_coef={args.kl_coef}",
        ],
    }


def wants(name: str, runs: dict) -> dict[str, str]:
    """The identities a stage's checkpoint must record: the digests of the stages it was made from
    (read from those stages' own checkpoints and pair files)."""
    from tpulab.checkpoint.files import manifest_digest
    from tpulab.train.restore import checkpoint_dir

    def digest(stage: str) -> str:
        return manifest_digest(checkpoint_dir(runs[stage]))

    if name == "sft":
        return {"base": digest("base")}
    if name in ("reward", "dpo"):
        return {"base": digest("sft"), "dataset": pairs_identity(runs["pairs"], runs["sft"])}
    if name == "ppo":
        return {"init": digest("sft"), "reference": digest("sft"), "reward_model": digest("reward")}
    return {}


def pairs_identity(pairs_dir: Path, sft_dir: Path) -> str:
    from tpulab.data.preference import read_dir
    from tpulab.train.restore import load_model

    return read_dir(pairs_dir, load_model(sft_dir).config.data).identity


def verify_reused(name: str, path: Path, runs: dict, args, sets: dict) -> dict:
    """A reused stage, checked: it loads, it is what this script would have made, it was made from
    the stages before it. -> its record (dir, digest, commit, seconds)."""
    from tpulab.data.preference import DATASET_FILE
    from tpulab.train.restore import load_model

    if name == "pairs":
        record = json.loads((path / DATASET_FILE).read_text())
        sft = load_model(runs["sft"])
        made = {
            "policy digest": (record["policy"]["checkpoint_digest"], sft.checkpoint_digest),
            "train prompts": (record["counts"]["train"]["prompts"], args.train_prompts),
            "eval prompts": (record["counts"]["eval"]["prompts"], args.eval_prompts),
        }
        bad = [f"{k} {have!r} (want {want!r})" for k, (have, want) in made.items() if have != want]
        if bad:
            raise TpulabError(f"--reuse {path}: not the pairs this chain makes: {'; '.join(bad)}")
        identity = pairs_identity(path, runs["sft"])
        commit = record["environment"]["git_commit"]
        return {"run_dir": str(path), "identity": identity, "git_commit": commit}
    restored = load_model(path)  # a verified checkpoint, restored
    want = load(RunConfig, CONFIG, sets[name])
    meta_cfg = to_dict(restored.config)
    diffs = identity_diff(RunConfig, meta_cfg, to_dict(want))
    if restored.step != want.train.steps:
        diffs.append(f"step {restored.step} (want {want.train.steps})")
    saved = RunDir(path).read_summary()
    for k, digest in wants(name, runs).items():
        if saved.identities.get(k) != digest:
            diffs.append(f"identity {k} {str(saved.identities.get(k))[:12]}… (want {digest[:12]}…)")
    if diffs:
        raise TpulabError(
            f"--reuse {path}: not the {name} stage of this chain: {'; '.join(diffs[:3])}"
        )
    seconds = saved.wall_s
    return {
        "run_dir": str(path),
        "checkpoint_digest": restored.checkpoint_digest,
        "git_commit": RunDir(path).read_env().git_commit,
        "seconds": None if seconds is None else round(seconds, 1),
    }


def round0(cfg: RunConfig) -> dict:
    """PPO's evaluation of its starting policy (the SFT run), before any update: the loop
    evaluates after its steps only. The same jitted evaluation, prompts and key as the run's."""
    from tpulab.train.loop import evaluate
    from tpulab.train.objectives.ppo import PPO
    from tpulab.train.sharding import make_mesh

    objective = PPO(cfg)
    steps = objective.steps(make_mesh())
    out = evaluate(steps, steps.init().params, objective.data().eval_batches)
    return {"step": 0, **out}


def ppo_curve(run: Path, first: dict) -> list[dict]:
    """Per evaluation (``first``: before any update): the rounds done, the held-out proxy reward,
    gold reward r* and KL; and the last logged training round's own proxy score and KL."""
    records = read_records(run)
    logged = [r for r in records if "round" in r and "score" in r]
    out = []
    for r in [first, *(r for r in records if r.get("event") == "eval")]:
        before = [x for x in logged if x["step"] <= r["step"]]
        last = before[-1] if before else None
        out.append(
            {
                "step": r["step"],
                "rounds": r["step"] // 4,
                "val_reward": r["val_reward"],
                "val_gold_reward": r["val_gold_reward"],
                "val_kl": r["val_kl"],
                "val_response_length": r["val_response_length"],
                "train_score": None if last is None else last["score"],
                "train_kl": None if last is None else last["kl"],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="steps of every training stage but PPO")
    ap.add_argument("--train-prompts", type=int, default=2048)
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--rm-lr", type=float, default=1e-3)
    ap.add_argument("--dpo-lr", type=float, default=3e-4)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--ppo-rounds", type=int, default=200, help="PPO rounds (4 loop steps each)")
    ap.add_argument("--ppo-lr", type=float, default=1e-4)
    ap.add_argument("--kl-coef", type=float, default=0.05)
    ap.add_argument("--ppo-eval-every", type=int, default=20, help="rounds between evaluations")
    ap.add_argument("--ppo-eval-batches", type=int, default=8, help="16 held-out prompts each")
    ap.add_argument(
        "--reuse", type=Path, help="a chain's runs dir: its stages are taken as they are"
    )
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench-preference-chain")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.reuse is not None and args.reuse.resolve() == args.runs.resolve():
        raise SystemExit("error: --runs must not be the --reuse dir (its stages are read-only)")
    prepare()
    from tpulab.posttrain.pairs import PairsConfig, make_pairs
    from tpulab.posttrain.winrate import win_rate
    from tpulab.train.loop import train

    env = benchmark_environment()
    shutil.rmtree(args.runs, ignore_errors=True)
    runs = {k: args.runs / k for k in STAGES}
    reused, seconds = {}, {}

    def stage(name, fn, *a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        seconds[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {seconds[name]} s", flush=True)
        return out

    pairs = None
    for name in STAGES:
        if args.reuse is not None and (args.reuse / name).exists():
            runs[name] = args.reuse / name
            reused[name] = verify_reused(name, runs[name], runs, args, stage_sets(args, runs))
            print(f"{name}: reused {runs[name]}", flush=True)
            if name == "pairs":
                pairs = json.loads((runs[name] / "dataset.json").read_text())
                pairs["identity"] = reused[name]["identity"]
            continue
        if name == "pairs":
            cfg = PairsConfig(train_prompts=args.train_prompts, eval_prompts=args.eval_prompts)
            pairs = stage(name, make_pairs, runs["sft"], runs["pairs"], cfg)
            continue
        cfg = load(RunConfig, CONFIG, stage_sets(args, runs)[name])
        stage(name, train, cfg, runs[name], progress=False)
    wins = {
        k: stage(f"win_rate_{k}", win_rate, runs[k], runs["sft"], args.eval_prompts)
        for k in ("dpo", "ppo")
    }
    rm, dpo, ppo = last_eval(runs["reward"]), last_eval(runs["dpo"]), last_eval(runs["ppo"])
    dpo_first = next(r for r in read_records(runs["dpo"]) if r.get("step") == 1)
    ppo_cfg = load(RunConfig, CONFIG, stage_sets(args, runs)["ppo"])
    curve0 = stage("ppo_round0_eval", round0, ppo_cfg)
    res = {
        "steps": args.steps,
        "pairs": pairs["counts"],
        "pairs_identity": pairs["identity"],
        "reward": {
            "lr": args.rm_lr,
            "val_accuracy": rm["val_accuracy"],
            "val_gold_optimal_accuracy": rm["val_gold_optimal_accuracy"],
            "val_loss": rm["val_loss"],
        },
        "dpo": {
            "lr": args.dpo_lr,
            "beta": args.beta,
            "step1_loss": dpo_first["loss"],
            "step1_reward_margin_absmax": dpo_first["reward_margin_absmax"],
            "val_reward_accuracy": dpo["val_reward_accuracy"],
            "val_kl_ref": dpo["val_kl_ref"],
            "val_loss": dpo["val_loss"],
        },
        "ppo": {
            "rounds": args.ppo_rounds,
            "steps": ppo_cfg.train.steps,
            "lr": args.ppo_lr,
            "settings": to_dict(ppo_cfg.objective.ppo),
            "eval_prompts": args.ppo_eval_batches * ppo_cfg.data.batch_size,
            "val_reward": ppo["val_reward"],
            "val_gold_reward": ppo["val_gold_reward"],
            "val_kl": ppo["val_kl"],
            "curve": ppo_curve(runs["ppo"], curve0),
        },
        "win_rate": {
            k: {f: w[f] for f in ("prompts", "wins", "ties", "losses", "win_rate")}
            for k, w in wins.items()
        },
        "gold_mean": {k: w["gold_mean"] for k, w in wins.items()},
        "stop_rate": {k: w["stop_rate"] for k, w in wins.items()},
        "samples": {k: w["replies"][:3] for k, w in wins.items()},
        "runs": {k: str(v) for k, v in runs.items()},
        "reused": reused,
        "seconds": seconds,
        "environment": env,
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "preference_chain.json", res)
    md = markdown(res)
    atomic_write_bytes(args.out / "preference_chain.md", md.encode())
    print(md)


def markdown(res: dict) -> str:
    env, c, r, d, p = res["environment"], res["pairs"], res["reward"], res["dpo"], res["ppo"]
    w, g, s = res["win_rate"], res["gold_mean"], res["stop_rate"]
    ps = p["settings"]

    def wins(k):
        return (
            f"{w[k]['win_rate']:.3f} ({w[k]['wins']} wins, {w[k]['ties']} ties, "
            f"{w[k]['losses']} losses)"
        )

    curve = table(
        ["rounds", "mean proxy reward", "mean gold r*", "KL to the reference", "reply bytes"],
        [
            (
                e["rounds"],
                f"{e['val_reward']:.3f}",
                f"{e['val_gold_reward']:.3f}",
                f"{e['val_kl']:.3f}",
                f"{e['val_response_length']:.1f}",
            )
            for e in p["curve"]
        ],
    )
    # the KL labels' "||" is plain text here: table() escapes each "|" once
    quantities = table(
        ["quantity", "value"],
        [
            ("sampled pairs: train / held-out", f"{c['train']['pairs']} / {c['eval']['pairs']}"),
            ("gold-optimal accuracy, held-out pairs", f"{r['val_gold_optimal_accuracy']:.3f}"),
            (f"reward model held-out accuracy (lr {r['lr']:g})", f"{r['val_accuracy']:.3f}"),
            (
                "DPO step-1 loss / largest step-1 margin",
                f"{d['step1_loss']!r} / {d['step1_reward_margin_absmax']!r}",
            ),
            (
                f"DPO held-out pair accuracy (beta {d['beta']:g}, lr {d['lr']:g})",
                f"{d['val_reward_accuracy']:.3f}",
            ),
            ("DPO KL(ref || pi) on held-out pairs, nats per reply", f"{d['val_kl_ref']:.3f}"),
            (
                "PPO KL(pi || ref) reached on held-out prompts, nats per reply (k1, sampled)",
                f"{p['val_kl']:.3f}",
            ),
            (
                f"gold win rate, DPO vs SFT greedy, {w['dpo']['prompts']} held-out prompts",
                wins("dpo"),
            ),
            (
                f"gold win rate, PPO vs SFT greedy, {w['ppo']['prompts']} held-out prompts",
                wins("ppo"),
            ),
            (
                "mean r*: DPO / PPO / SFT",
                f"{g['dpo']['policy']:.3f} / {g['ppo']['policy']:.3f} / {g['ppo']['against']:.3f}",
            ),
            (
                "stop rate: DPO / PPO / SFT",
                f"{s['dpo']['policy']:.3f} / {s['ppo']['policy']:.3f} / {s['ppo']['against']:.3f}",
            ),
        ],
    )
    reused = [
        f"- {k}: `{v['run_dir']}`, made at commit `{v['git_commit'][:7]}`"
        + (f", {v['seconds']} s" if v.get("seconds") else "")
        for k, v in res["reused"].items()
    ]
    return "\n".join(
        [
            "# The preference chain (default size)",
            "",
            f"configs/default.yaml (4 layers, d_model 128, seq 128, fp32), {res['steps']} steps a "
            "stage: pretrain -> SFT -> `tpulab pairs` (two replies per prompt, temperature 1, "
            "Bradley-Terry labels on r*) -> reward model and DPO from the SFT run; PPO "
            f"({p['rounds']} rounds of {ps['rollouts']} rollouts of at most {ps['max_new']} "
            f"bytes, {ps['epochs']} epochs x {ps['minibatches']} minibatches = {p['steps']} "
            f"steps, lr {p['lr']:g}, {ps['kl_estimator']} KL penalty {ps['kl_coef']:g}) from "
            "the SFT run, the SFT run its reference, scored by the reward model.",
            "",
            quantities,
            "",
            f"PPO's over-optimisation curve (Gao et al., arXiv:2210.10760): {p['eval_prompts']} "
            "held-out prompts sampled at temperature "
            f"{ps['temperature']:g} with one fixed key at each evaluation; proxy = the reward "
            "model's score, gold = r*, KL = the sequence log-ratio log pi/ref of the sampled "
            "reply (k1).",
            "",
            curve,
            "",
            "Stage seconds (run here): "
            + ", ".join(f"{k} {v}" for k, v in res["seconds"].items())
            + ".",
            "",
            *(
                ["Reused stages (read-only, verified: loads, same config, identities chain):"]
                + reused
                + [""]
                if reused
                else []
            ),
            f"Provenance: backend `{env['backend']}`, device kind `{env['device_kind']}` x"
            f"{env['device_count']}, {env['cpu_count']} CPU cores, load average at start "
            f"{env['load_avg_1m_5m_15m']}, at end {res['load_avg_at_end']}; "
            + ", ".join(f"{k} {v}" for k, v in env["packages"].items())
            + f"; commit `{env['git_commit']}`; {env['time_utc']}.",
            "",
        ]
    )


if __name__ == "__main__":
    try:
        main()
    except TpulabError as e:  # a refused --reuse: one line, nothing written
        raise SystemExit(f"error: {e}") from None
