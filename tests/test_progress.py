"""Long loops show a bar on a terminal and plain lines in logs."""

import io

from tpulab.progress import progress


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_in_a_log():
    out = io.StringIO()
    assert list(progress(["a", "b", "c"], "export", stream=out)) == ["a", "b", "c"]
    assert out.getvalue().splitlines() == [
        "[progress] export: 1/3",
        "[progress] export: 2/3",
        "[progress] export: 3/3",
    ]


def test_a_bar_on_a_terminal_and_no_plain_lines():
    out = Tty()
    assert list(progress(range(4), "bench", stream=out)) == [0, 1, 2, 3]
    assert (
        "[progress]" not in out.getvalue() and "bench" in out.getvalue() and "4/4" in out.getvalue()
    )


def test_the_step_bar_draws_on_stderr_only_when_enabled_or_on_a_terminal(capsys):
    from tpulab.train.step_progress import step_bar

    bar = step_bar(5, 2, True)
    bar.update(1)
    bar.close()
    out, err = capsys.readouterr()
    assert out == "" and "3/5" in err and "step" in err
    for enabled in (False, None):  # None: a terminal decides; pytest's stderr is none
        bar = step_bar(5, 2, enabled)
        bar.update(1)
        bar.close()
        assert bar.disable and capsys.readouterr() == ("", "")
