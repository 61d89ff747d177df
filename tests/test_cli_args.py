"""The argument shapes the subcommands share (``tpulab.cli.args``): parsed by the real parser,
each with a control that shows the check can fail. No jax: these run in a second."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest

from tpulab.cli.args import check_paths, from_flags, proof_children, verdict_exit
from tpulab.cli.main import build_parser, main
from tpulab.errors import ExitCode, TpulabError


@dataclasses.dataclass(frozen=True)
class Opts:
    skip_bridge: bool = False
    chaos_kills: int = 3
    timeout_s: float = 60.0
    unflagged: str = "default"


def test_from_flags_takes_each_field_from_its_flag_and_keeps_the_rest():
    args = types.SimpleNamespace(skip_bridge=True, chaos_kills=0, timeout=5.0, other=1)
    assert from_flags(Opts, args, timeout_s="timeout") == Opts(True, 0, 5.0, "default")
    # control: without the rename the unit-less flag is not taken
    assert from_flags(Opts, args).timeout_s == 60.0
    with pytest.raises(AttributeError, match="Opts: no flag timeout_ms"):
        from_flags(Opts, args, timeout_s="timeout_ms")  # a typo is an error, never a default


def test_the_commands_configs_come_whole_from_their_flags():
    p = build_parser()
    from tpulab.orchestrate.capstone import CapstoneOptions
    from tpulab.posttrain.pairs import PairsConfig

    capstone = p.parse_args(["capstone", "--out", "o", "--skip-dossier", "--chaos-kills", "0"])
    got = from_flags(CapstoneOptions, capstone)
    assert got.skip_dossier and got.chaos_kills == 0 and not got.skip_bridge
    pairs = p.parse_args(["pairs", "--policy", "a", "--out", "b", "--top-k", "5", "--seed", "2"])
    # every field of these configs has a flag of its name: none is left at a silent default
    for cls, args in ((CapstoneOptions, capstone), (PairsConfig, pairs)):
        assert all(hasattr(args, f.name) for f in dataclasses.fields(cls)), cls
    assert from_flags(PairsConfig, pairs) == PairsConfig(top_k=5, seed=2)


def test_path_flags_are_checked_once_for_every_command(capsys):
    args = check_paths(types.SimpleNamespace(run_dir="runs/x", out=None, other=""))
    assert args.run_dir == Path("runs/x") and args.out is None and args.other == ""
    with pytest.raises(TpulabError, match="^--out must not be empty$"):
        check_paths(types.SimpleNamespace(out=""))
    # through the dispatcher: commands that once took --run-dir as a plain Path ("" = cwd)
    for command in ("bench", "report", "chaos"):
        argv = [command, "--run-dir", ""]
        assert main(argv) == ExitCode.BAD_INPUT
        err = capsys.readouterr().err
        assert err == "error: --run-dir must not be empty\n", (argv, err)
    # control: a non-empty run dir gets past the check to the handler's own refusal
    assert main(["chaos", "--run-dir", "x", "--config", ""]) != ExitCode.OK
    assert "--run-dir" not in capsys.readouterr().err


def test_a_proof_line_says_its_verdict_first_and_fails_unless_it_passed(capsys):
    same, differs = types.SimpleNamespace(identical=True), types.SimpleNamespace(identical=False)
    assert verdict_exit(same, "3 kills") == ExitCode.OK
    assert verdict_exit(differs, "3 kills") == ExitCode.FAILED
    assert verdict_exit(same, "x", ok=False) == ExitCode.FAILED  # identical, teardown failed
    assert verdict_exit(same, "y", subject="torch/eager") == ExitCode.OK
    assert capsys.readouterr().out.splitlines() == [
        "IDENTICAL: 3 kills",
        "NOT IDENTICAL: 3 kills",
        "IDENTICAL: x",
        "torch/eager: IDENTICAL: y",
    ]


def test_prove_resume_and_chaos_read_the_same_child_flags():
    p = build_parser()
    base = ["--run-dir", "r", "--reference", "ref", "--warm-resume-cache", "--no-track"]
    prove, chaos = p.parse_args(["prove-resume", *base]), p.parse_args(["chaos", *base])
    assert (
        proof_children(prove)
        == proof_children(chaos)
        == {
            "reference_dir": Path("ref"),
            "compile_cache": None,
            "warm_resume_cache": True,
            "track": False,
        }
    )
    # control: the defaults differ from what was given
    assert proof_children(p.parse_args(["chaos", "--run-dir", "r"]))["track"] is True
    with pytest.raises(TpulabError, match="--reference must not be empty"):
        proof_children(p.parse_args(["chaos", "--run-dir", "r", "--reference", ""]))
