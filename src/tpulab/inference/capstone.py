"""The inference section of the capstone report: KV-cache table, decode speed, export and its
verification."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
from tpulab.errors import ExitCode, TpulabError

# The bounds the issue sets for the default model (also asserted by the slow test).
INT8_MIN_GREEDY_AGREEMENT = 0.99
INT8_MAX_LOSS_RATIO = 0.01


def bounds(result: dict) -> dict:
    """Whether fp32 matches the full forward to its tolerance and int8 stays within the issue's
    bounds."""
    rows = {r["precision"]: r for r in result["rows"]}
    loss_rel = (
        abs(rows["int8"]["heldout_loss"] - rows["fp32"]["heldout_loss"])
        / rows["fp32"]["heldout_loss"]
    )
    return {
        "fp32_logit_diff_within_atol": rows["fp32"]["max_abs_logit_diff"]
        <= result["fp32_logit_atol"],
        "int8_greedy_agreement_ok": rows["int8"]["greedy_agreement"] >= INT8_MIN_GREEDY_AGREEMENT,
        "int8_loss_rel_to_fp32": loss_rel,
        "int8_loss_ok": loss_rel <= INT8_MAX_LOSS_RATIO,
    }


def capstone_stage(run_dir: Path, out_dir: Path) -> str:
    """Run the KV-cache table, the decode-speed benchmark, export, and verification (in a fresh
    process, against ``run_dir``).

    Writes ``out_dir/kvcache/``, ``out_dir/export/`` and ``out_dir/inference.md``; returns that
    Markdown, whose links are relative to ``out_dir.parent`` (where the capstone report lives).
    Raises TpulabError (naming inference.md) when verification fails or a bound is missed.
    """
    from tpulab.inference.cache_eval import markdown_table, write_kvcache_report
    from tpulab.inference.export import export_artifacts
    from tpulab.inference.speed import decode_speed, speed_table
    from tpulab.train.restore import load_model

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    restored = load_model(run_dir)
    result = write_kvcache_report(restored, out_dir / "kvcache")
    checks = bounds(result)
    speed = decode_speed(restored, repeats=2)
    atomic_write_json(
        out_dir / "kvcache" / "decode_speed.json",
        {"rows": speed, "environment": result["environment"], "hardware": result["hardware"]},
    )
    art = out_dir / "export"
    manifest = export_artifacts(restored, run_dir, art)
    try:
        proc = subprocess.run(
            # --run-dir: checked against the run this capstone trained, named here, not the run
            # dir the artifacts' manifest names (the record says which: checkpoint_source).
            [
                sys.executable,
                "-m",
                "tpulab.cli",
                "verify-export",
                str(art),
                "--run-dir",
                str(run_dir),
            ],
            capture_output=True,
            text=True,
            timeout=900,
            env=os.environ.copy(),
        )
    except subprocess.TimeoutExpired:
        raise TpulabError(
            f"inference: verify-export {art} did not finish within 900 s", exit_code=ExitCode.FAILED
        ) from None
    verified = proc.returncode == ExitCode.OK
    tail = (proc.stdout.strip() + ("\n" + proc.stderr.strip() if not verified else "")).strip()
    d, env = result["dtypes"], result["environment"]
    section = "\n".join(
        [
            "## Inference: KV cache and exported endpoints",
            "",
            f"Checkpoint step {restored.step} (manifest `{restored.checkpoint_digest[:16]}`), "
            f"on {result['hardware']}; jax {env['packages']['jax']}, "
            f"jaxlib {env['packages']['jaxlib']}. Dtypes: weights {d['weights']}, "
            f"activations {d['activations']}, accumulation {d['accumulation']}, "
            f"int8 scales {d['int8_scales']}. "
            f"Held-out windows {result['shapes']['heldout_windows']}, "
            f"prompt {result['shapes']['prompt_len']} tokens, "
            f"cache length {result['shapes']['cache_len']}.",
            "",
            markdown_table(result),
            "",
            "FP32 cached decode vs full forward: max |logit diff| within "
            f"{result['fp32_logit_atol']:g}: "
            f"{'yes' if checks['fp32_logit_diff_within_atol'] else 'NO'}. INT8 greedy agreement >= "
            f"{INT8_MIN_GREEDY_AGREEMENT}: "
            f"{'yes' if checks['int8_greedy_agreement_ok'] else 'NO'}; "
            f"INT8 held-out loss within {INT8_MAX_LOSS_RATIO:.0%} of FP32: "
            f"{'yes' if checks['int8_loss_ok'] else 'NO'} "
            f"({checks['int8_loss_rel_to_fp32']:.2e} relative).",
            "",
            f"![KV-cache precisions]({out_dir.name}/kvcache/kvcache.png)",
            "",
            "Decode speed (batch 1, greedy, fp32 cache; best of 2 after warm-up):",
            "",
            speed_table(speed),
            "",
            f"Exported {len(manifest['artifacts'])} endpoints to `{out_dir.name}/export/` "
            "(platforms "
            f"{', '.join(manifest['artifacts'][0]['platforms'])}; weights passed as arguments). "
            f"`tpulab verify-export` in a fresh process: **{'PASS' if verified else 'FAIL'}**.",
            "",
            tail,
            "",
        ]
    )
    atomic_write_bytes(out_dir / "inference.md", section.encode())
    missed = [
        k
        for k in ("fp32_logit_diff_within_atol", "int8_greedy_agreement_ok", "int8_loss_ok")
        if not checks[k]
    ]
    if missed or not verified:
        problems = missed + ([] if verified else ["export verification failed"])
        raise TpulabError(
            f"inference: {', '.join(problems)} (see {out_dir / 'inference.md'})",
            exit_code=ExitCode.FAILED,
        )
    return section
