"""Every gcloud command form tpulab sends, with placeholder operands: the real parser accepts
each (test_cloud_gcloud_parser), and the rehearsal's recorded calls use only these
(test_cloud_rehearsal)."""

from __future__ import annotations

from tpulab.cloud.config import CloudConfig
from tpulab.cloud.gcloud import (
    create_argv,
    delete_argv,
    describe_argv,
    list_argv,
    scp_from_argv,
    scp_to_argv,
    ssh_argv,
)


def command_forms(cfg: CloudConfig) -> dict[str, list[str]]:
    """Form name -> argv, one per command form."""
    return {
        "create": create_argv(cfg),
        "describe": describe_argv(cfg),
        "list": list_argv(cfg),
        "scp to --worker=all": scp_to_argv(
            cfg, ["/tmp/tpulab-x.whl", "/tmp/config.yaml"], "tpulab/"
        ),
        "scp from --worker=N": scp_from_argv(cfg, "tpulab/runs/r", "/tmp/out/", 1),
        "scp from --worker=N, absolute (shared dir)": scp_from_argv(
            cfg, "/mnt/shared/runs/r", "/tmp/out/", 0
        ),
        "ssh --worker=all --command": ssh_argv(
            cfg, "cd tpulab && .venv/bin/tpulab receipt --out runs/r/receipt"
        ),
        "ssh --worker=N --command": ssh_argv(
            cfg, "cd tpulab && env A=1 .venv/bin/tpulab train", worker=0
        ),
        "delete --quiet": delete_argv(cfg),
    }
