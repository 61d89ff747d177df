"""The MLflow helper process of ``MlflowTracker``: reads jobs as JSON lines on stdin, makes the MLflow calls.

First line: the tracker's settings (run_dir, uri, kind, extra_tags); then one ``[op, *args]`` per line.
The first failure prints one warning and switches tracking off (later jobs are read and dropped). At
end of input, whether the trainer ended normally or was killed, it prints ``{"run_id", "failed"}`` and
exits: it never finishes a run on its own, only the jobs it was sent.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    import signal

    # A preemption notice or Ctrl-C reaches the whole process group: the trainer handles it and then closes
    # our stdin, so its last steps still get logged. A kill of the trainer closes stdin too.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # MLflow logs a failing store call with a long traceback before raising it; the tracker turns the raise
    # into its one warning line, so MLflow's own logging is kept to what cannot be reported otherwise.
    import logging
    import os

    os.environ["MLFLOW_LOGGING_LEVEL"] = "CRITICAL"
    from tpulab.tracking.mlflow_hook import MlflowTracker

    first = sys.stdin.readline()
    if not first:
        return 0
    cfg = json.loads(first)
    tracker = MlflowTracker(
        cfg["run_dir"], cfg["uri"], kind=cfg["kind"], extra_tags=cfg["extra_tags"]
    )
    for name in ("mlflow", "alembic", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    for line in sys.stdin:
        if not tracker._enabled:
            continue
        try:
            op, *args = json.loads(line)
            tracker.execute(op, args)
        except Exception as e:  # noqa: BLE001 - any MLflow or sqlite failure: warn once, train on
            tracker._fail(e)
    print(json.dumps({"run_id": tracker.run_id, "failed": tracker.failed}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
