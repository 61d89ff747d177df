"""`make test` on a fresh machine: the Debian packages its tests need are installed (or it stops
with one line) and the lint passes before the suite starts; test-only packages stay out of
`pip install tpulab`."""

from __future__ import annotations

import shutil
import subprocess
import tomllib

import pytest

from conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def planned(makefile, target: str, cwd) -> list[str]:
    """The commands ``make -n target`` would run, setup's install left out (its stamp is fresh)."""
    out = subprocess.run(
        ["make", "-n", "-f", str(makefile), target, "STAMP=stamp", "-o", "stamp"],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


def lint_first(commands: list[str]) -> bool:
    pytest_at = next(i for i, c in enumerate(commands) if "-m pytest" in c)
    before = commands[:pytest_at]
    return any("ruff check ." in c for c in before) and any(
        "ruff format --check ." in c for c in before
    )


def test_make_test_runs_both_ruff_commands_before_pytest(tmp_path):
    assert lint_first(planned(REPO / "Makefile", "test", tmp_path))


def test_the_order_check_can_fail(tmp_path):
    """Negative control: the same Makefile with lint dropped from test's prerequisites fails."""
    text = (REPO / "Makefile").read_text()
    assert "test: system-deps setup lint\n" in text
    bad = tmp_path / "Makefile"
    bad.write_text(text.replace("test: system-deps setup lint\n", "test: setup\n"))
    assert not lint_first(planned(bad, "test", tmp_path))
    assert not lint_first(planned(REPO / "Makefile", "test-fast", tmp_path))


def deps_first(commands: list[str]) -> bool:
    pytest_at = next(i for i, c in enumerate(commands) if "-m pytest" in c)
    return "scripts/system-deps" in commands[:pytest_at]


def test_make_test_checks_the_system_packages_before_pytest(tmp_path):
    assert deps_first(planned(REPO / "Makefile", "test", tmp_path))
    bad = tmp_path / "Makefile"
    bad.write_text(
        (REPO / "Makefile").read_text().replace("test: system-deps setup", "test: setup")
    )
    assert not deps_first(planned(bad, "test", tmp_path))  # negative control
    assert deps_first(planned(REPO / "Makefile", "test-fast", tmp_path))


def test_ci_runs_make_test_and_installs_nothing_itself():
    """`.ci/run` gets its set-up from `make test` alone, as a newcomer does."""
    lines = [
        s
        for s in (line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines())
        if s and not s.startswith("#")
    ]
    assert lines[-1] == "make test"
    assert not any("apt-get" in s or "install" in s for s in lines)


TEST_ONLY = {*("pytest", "pytest-timeout", "pytest-xdist", "execnet", "ruff", "gymnasium")}
# gymnasium brings Farama-Notifications: pinned beside it (pip would otherwise resolve it).
# scikit-learn (tpulab.data.digits) is a main dependency now, with the three it brings.
TEST_PINNED = TEST_ONLY | {"farama-notifications"}
MAIN_PINNED = {"scikit-learn", "joblib", "threadpoolctl", "narwhals"}


def _names(requirements: list[str]) -> set[str]:
    return {r.split("==")[0].split(";")[0].strip().lower() for r in requirements}


def test_test_only_packages_are_an_extra_that_setup_installs():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not _names(project["dependencies"]) & TEST_ONLY
    assert _names(project["optional-dependencies"]["test"]) == TEST_PINNED
    assert MAIN_PINNED <= _names(project["dependencies"])
    assert "pip install -q -e '.[test]'" in (REPO / "Makefile").read_text()
    # negative control: the check reads a test package among the install requirements
    assert _names(["pytest==9.2.0", "libtpu==1; platform_system == 'Linux'"]) == {
        "pytest",
        "libtpu",
    }


# --- scripts/system-deps, in a faked environment ----------------------------------------------

SCRIPT = REPO / "scripts" / "system-deps"
PACKAGES = {"chromium": "chromium", "umoci": "umoci", "skopeo": "skopeo", "bwrap": "bubblewrap"}


def _fake(bin_dir, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def system_deps(tmp_path, uid: int, have=(), apt: str | None = "ok"):
    """Runs the script with PATH = one directory of fakes: ``id -u`` says ``uid``, the tools in
    ``have`` exist, and apt-get (absent when ``apt`` is None) logs its arguments and, with "ok",
    installs by creating the tools, with "fail" exits 100, with "noop" installs nothing.
    -> (result, apt-get's calls)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "apt.log"
    bin_dir.mkdir()
    _fake(bin_dir, "id", f"echo {uid}")
    for tool in have:
        _fake(bin_dir, tool, "exit 0")
    if apt is not None:
        creates = "".join(
            f'case " $* " in *" {pkg} "*) printf "#!/bin/sh\\n" > {bin_dir}/{tool}; '
            f"/bin/chmod +x {bin_dir}/{tool};; esac\n"
            for tool, pkg in PACKAGES.items()
        )
        _fake(
            bin_dir,
            "apt-get",
            f'echo "$*" >> {log}\n' + {"ok": creates, "fail": "exit 100", "noop": ""}[apt],
        )
    result = subprocess.run(
        ["/bin/bash", str(SCRIPT)],
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return result, calls


def test_system_deps_does_nothing_when_every_tool_is_there(tmp_path):
    result, calls = system_deps(tmp_path, uid=1000, have=PACKAGES)
    assert (result.returncode, result.stderr, calls) == (0, "", [])


def test_system_deps_installs_what_is_missing_as_root(tmp_path):
    result, calls = system_deps(tmp_path, uid=0, have=("umoci", "skopeo"))
    assert result.returncode == 0, result.stderr
    assert calls == [
        "update -q",
        "install -y -q --no-install-recommends chromium bubblewrap",
    ]


def test_system_deps_stops_in_one_line_without_root(tmp_path):
    """Negative control: not root, so nothing is installed and the one line names the packages and
    the command."""
    result, calls = system_deps(tmp_path, uid=1000, have=("skopeo",))
    assert result.returncode != 0 and calls == []
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ") and "chromium umoci bubblewrap" in line
    assert "apt-get install -y --no-install-recommends chromium umoci bubblewrap" in line


def test_system_deps_stops_in_one_line_without_apt(tmp_path):
    result, calls = system_deps(tmp_path, uid=0, apt=None)
    assert result.returncode != 0
    [line] = result.stderr.splitlines()
    assert "chromium umoci skopeo bubblewrap" in line and "no apt-get" in line


def test_system_deps_fails_when_apt_get_fails(tmp_path):
    result, calls = system_deps(tmp_path, uid=0, have=("chromium", "umoci", "bwrap"), apt="fail")
    assert result.returncode != 0 and calls == ["update -q"]
    assert result.stderr.splitlines()[-1].startswith("error: apt-get could not install skopeo")


def test_system_deps_fails_when_the_install_leaves_a_tool_missing(tmp_path):
    result, calls = system_deps(tmp_path, uid=0, have=("chromium", "umoci", "skopeo"), apt="noop")
    assert result.returncode != 0 and len(calls) == 2
    assert result.stderr.splitlines()[-1] == (
        "error: apt-get installed bubblewrap, but these still put no tool on PATH: bubblewrap"
    )
