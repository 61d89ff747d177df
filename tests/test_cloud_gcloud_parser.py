"""Every gcloud command line tpulab builds is accepted by the installed gcloud's own parser.

Each form runs inside `unshare -n` (a network namespace with no interfaces but lo) with a throwaway
CLOUDSDK_CONFIG, so the real CLI parses the arguments and stops at the credential check ("You do
not currently have an active account selected", exit 1) without any traffic. An argument error
would exit 2 before that; the negative controls show the same harness catches a misspelled flag
and a bad flag value. If `unshare -n` or gcloud is missing this test fails; it never skips.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from cloud_forms import command_forms
from tpulab.cloud.config import CloudConfig
from tpulab.cloud.gcloud import create_argv

NO_ACCOUNT = "You do not currently have an active account selected"


def _isolated_env(config_dir) -> dict:
    return {
        **os.environ,
        "CLOUDSDK_CONFIG": str(config_dir),
        "CLOUDSDK_CORE_CHECK_GCE_METADATA": "false",
        "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
    }


def _parse(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["unshare", "-n", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_real_gcloud_parser_accepts_every_form_offline(tmp_path):
    gcloud = shutil.which("gcloud")
    assert gcloud, "the Google Cloud CLI (gcloud) must be installed for this test"
    env = _isolated_env(tmp_path / "gcloud-config")
    # The namespace really has no network: a connect to a public address fails at once.
    probe = _parse(
        [
            sys.executable,
            "-c",
            "import socket; socket.create_connection(('8.8.8.8', 53), timeout=2)",
        ],
        env,
    )
    assert probe.returncode != 0 and "unreachable" in probe.stderr.lower(), (
        f"`unshare -n` must give an isolated namespace: rc={probe.returncode} {probe.stderr[-300:]}"
    )

    cfg = CloudConfig(
        project="tpulab-parser-check",
        zone="us-central1-a",
        name="tpulab-parse",
        gcloud=gcloud,
        accelerator_type="v5litepod-8",
        runtime_version="v2-alpha-tpuv5-lite",
    )
    forms = command_forms(cfg)
    forms["create --spot"] = create_argv(dataclasses.replace(cfg, spot=True))
    forms["create --preemptible"] = create_argv(
        dataclasses.replace(cfg, preemptible=True, accelerator_type="v5p-8")
    )
    controls = {  # must be rejected by the parser (exit 2)
        "misspelled flag": [
            a.replace("--accelerator-type", "--acelerator-type") for a in forms["create"]
        ],
        "bad flag value": [
            a.replace("--strict-host-key-checking=no", "--strict-host-key-checking=maybe")
            for a in forms["ssh --worker=all --command"]
        ],
    }
    jobs = {
        **{("form", k): v for k, v in forms.items()},
        **{("control", k): v for k, v in controls.items()},
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(jobs, pool.map(lambda argv: _parse(argv, env), jobs.values())))

    for (kind, name), p in results.items():
        if kind == "form":
            assert p.returncode == 1 and NO_ACCOUNT in p.stderr, (
                f"gcloud rejected tpulab's '{name}' form: {jobs[(kind, name)]}\n"
                f"rc={p.returncode}\n{p.stderr[-600:]}"
            )
        else:
            assert p.returncode == 2 and NO_ACCOUNT not in p.stderr, (
                f"control '{name}' was not caught: {p.stderr}"
            )
    assert "did you mean '--accelerator-type'" in results[("control", "misspelled flag")].stderr
    print(
        "forms accepted by the real gcloud parser:\n"
        + "\n".join(
            f"  {n}: {' '.join(jobs[('form', n)][1:])}" for (k, n) in results if k == "form"
        )
    )
