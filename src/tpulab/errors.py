"""The one exception type users see (a one-line message, a non-zero exit, no traceback), and the
one table of the exit codes the ``tpulab`` command can end with."""

from __future__ import annotations

import enum
import signal


class ExitCode(enum.IntEnum):
    """Every status ``tpulab`` exits with, each with its one-line meaning (the README's table,
    checked against this one by tests/test_exit_codes.py). Codes 3 to 6 name what broke, so a
    script can tell a bad disk from a bad result; 75 and up are the job-control conventions.

    Changed: until issue 20, 4 meant both a failing disk (loop, checkpoint store) and a receipt
    whose runtime is not the expected target; the receipt now exits 6. The list of codes that a
    comment in the stall watchdog kept ("errors (1, 2, 3)") is gone: this table is the list.
    """

    meaning: str

    def __new__(cls, code: int, meaning: str):
        member = int.__new__(cls, code)
        member._value_ = code
        member.meaning = meaning
        return member

    OK = 0, "success: the command did what it says (every check or proof it ran passed)"
    FAILED = 1, "a check, proof, verification, gate or cloud step ran and did not pass"
    BAD_INPUT = 2, "bad input or config (argparse's usage errors too), refused in one line"
    BAD_STATE = 3, "training hit a state it cannot trust (non-finite, or a changed frozen base)"
    IO_FAILED = 4, "writing the run's files or checkpoints failed (a full or failing disk)"
    DELETE_NOT_VERIFIED = 5, "cloud cleanup could not verify the VM is gone: it may cost money"
    WRONG_TARGET = 6, "the runtime is not the target `tpulab receipt --expect` named"
    STALLED = 75, "a step watchdog saw no step finish in time (EX_TEMPFAIL: resume the run)"
    PEER_FAILED = 76, "`tpulab launch` tore the job down: one of its processes died or failed"
    INTERRUPTED = 128 + signal.SIGINT, "Ctrl-C (128 + SIGINT)"
    TERMINATED = 128 + signal.SIGTERM, "SIGTERM ended a cloud command (in training it preempts: 0)"


class TpulabError(Exception):
    """A problem with the user's input or environment, stated in one line.

    The CLI prints ``error: <message>`` and exits with ``exit_code`` (an ``ExitCode``); anything
    else is a bug and keeps its traceback.
    """

    exit_code: ExitCode = ExitCode.BAD_INPUT

    def __init__(self, message: str, exit_code: ExitCode | None = None):
        super().__init__(" ".join(str(message).split()))
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(TpulabError):
    """A config key or value that cannot be used."""


class CheckpointError(TpulabError):
    """A checkpoint that is missing, corrupt or belongs to another run."""
