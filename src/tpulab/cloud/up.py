"""``tpu up``: every lifecycle step of a ``CloudSession`` in order, and the VM deleted whatever
happened (after a failed run, what can be retrieved is fetched first)."""

from __future__ import annotations

from tpulab.checkpoint.rundir import read_json
from tpulab.cloud.gcloud import Terminated, interruption, sigterm_as_interrupt
from tpulab.cloud.job import JobSpec
from tpulab.cloud.lifecycle import CloudSession, DeleteError, Interrupted
from tpulab.errors import TpulabError


def up(session: CloudSession, job: JobSpec, preempt_at: int | None = None) -> dict:
    """create -> stage -> run -> fetch, then delete whatever happened; the experiment log last.

    SIGTERM (a supervisor's stop) is handled like Ctrl-C: the gcloud children are killed, the
    VM is deleted and verified gone, and the exit is 143 (130 for Ctrl-C) with the VM named. A
    SIGTERM during that cleanup is counted, not obeyed (it would cut the delete short); a second
    Ctrl-C ends it, and the DeleteError names the VM."""
    from tpulab.cloud.explog import write_experiment_log

    failure: BaseException | None = None
    ran, step = False, "create"
    with sigterm_as_interrupt() as signals:
        try:
            session.create()
            step = "stage"
            session.stage(job)
            ran, step = True, "run"
            session.run(job, preempt_at)
            step = "fetch"
            session.fetch(job.run_name)
            step = "delete"
        except BaseException as e:  # Ctrl-C and SIGTERM too: the VM must not outlive us
            failure = e
            session.gcloud.kill_all()
            if ran and isinstance(e, TpulabError):
                try:  # the evidence of the failure (a receipt that did not qualify) first
                    session.fetch(job.run_name, strict=False)
                except TpulabError:
                    pass
                except KeyboardInterrupt as again:  # stop salvaging, still delete
                    failure = again
        cleanup_error = None
        with signals.defer():
            try:
                _cleanup_after(session, failure)
            except DeleteError as e:
                cleanup_error = e
            except (TpulabError, OSError) as e:  # the VM is still named, whatever broke
                cleanup_error = session.not_verified(f"the cleanup failed: {e}")
            except KeyboardInterrupt as e:  # a second Ctrl-C
                session.gcloud.kill_all()
                cleanup_error = session.not_verified(f"the cleanup was {interruption(e)[0]}")
            log = write_experiment_log(session.dir)
    if failure is None and signals.received:  # a SIGTERM during the cleanup of a success
        failure = Terminated()
    if cleanup_error is not None:
        if failure is not None:
            raise DeleteError(
                f"{cleanup_error} (after an earlier failure: {_failure_text(failure, step)})"
            ) from None
        raise cleanup_error
    if isinstance(failure, KeyboardInterrupt):
        how, code = interruption(failure)
        raise Interrupted(
            f"{how} during {step}: {session.resource()} deleted and verified gone",
            exit_code=code,
        ) from None
    if failure is not None:
        raise failure
    return {"experiment_log": str(log)}


def _cleanup_after(session: CloudSession, failure: BaseException | None) -> None:
    if failure is not None and read_json(session.cloud_dir / "resource.json", None) is None:
        state, _, _ = session.describe("cleanup: did create leave anything?")
        if state == "absent":
            session.write_record(
                "cleanup.json",
                {
                    "name": session.cfg.name,
                    "project": session.cfg.project,
                    "zone": session.cfg.zone,
                    "nothing_created": True,
                    "describe": state,
                    "verified_gone": True,
                },
            )
            return
    session.delete()


def _failure_text(failure: BaseException, step: str) -> str:
    if isinstance(failure, KeyboardInterrupt):
        return f"{interruption(failure)[0]} during {step}"
    return str(failure) or type(failure).__name__
