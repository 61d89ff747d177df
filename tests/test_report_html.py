"""report.html in a real headless Chromium: it loads with no console error, every image decodes,
nothing is fetched from the network; and it says what report.md says. Chromium comes from Debian's
packages, installed by `make test` (scripts/system-deps), never by a test; without it these tests
fail."""

import html
import json
import re
import shutil
import subprocess
import tempfile

import pytest

from conftest import run_cli

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--virtual-time-budget=10000",
    "--enable-logging=stderr",
    "--v=0",
]
# Injected into a copy of the page only (the report itself has no script and its CSP forbids one):
# collects errors, CSP violations and console.error calls, then reports every image's decode state
# into the DOM.
CHECKER = """<script>
window.__errs = [];
window.addEventListener('error',
  e => __errs.push('error: ' + (e.message || (e.target && e.target.src) || 'resource')), true);
document.addEventListener('securitypolicyviolation', e => __errs.push('csp: ' + e.blockedURI));
const ce = console.error;
console.error = (...a) => { __errs.push('console: ' + a.join(' ')); ce(...a); };
window.addEventListener('load', () => { const imgs = [...document.images];
  const r = {errors: __errs, images: imgs.length,
             decoded: imgs.filter(i => i.complete && i.naturalWidth > 0).length};
  const p = document.createElement('pre'); p.id = 'tpulab-check';
  p.textContent = JSON.stringify(r);
  document.body.appendChild(p); });
</script>"""


@pytest.fixture(scope="module")
def chromium():
    """A claimed check that cannot run is a failure, not a skip: install Chromium in the setup."""
    path = shutil.which("chromium")
    if path is None:
        pytest.fail(
            "chromium is not installed: make test installs Debian's package (scripts/system-deps; "
            "apt-get install -y --no-install-recommends chromium); run that setup first"
        )
    return path


def browser_check(chromium: str, page, tmp_path) -> dict:
    text = page.read_text()
    text = text.replace(
        "style-src 'unsafe-inline'\">",
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'\">",
        1,
    )
    assert "script-src 'unsafe-inline'" in text
    probe = tmp_path / f"probe-{page.stem}.html"
    probe.write_text(text.replace("</head>", CHECKER + "</head>", 1))
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", probe.as_uri()],
            capture_output=True,
            text=True,
            timeout=120,
        )
    m = re.search(r'<pre id="tpulab-check">(.*?)</pre>', out.stdout, re.S)
    assert m, f"no check result from chromium (rc {out.returncode}): {out.stderr[-2000:]}"
    result = json.loads(html.unescape(m.group(1)))
    result["console"] = [ln for ln in out.stderr.splitlines() if ":CONSOLE" in ln]
    return result


def test_report_html_loads_clean_in_chromium(chromium, trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    result = run_cli("report", "--run-dir", str(run), "--no-track")
    assert result.returncode == 0, result.stderr
    md, page = (run / "report.md").read_text(), run / "report.html"
    body = page.read_text()
    # same content: every heading and every image of the Markdown is in the page, images embedded
    for heading in re.findall(r"^#+ (.*)$", md, re.M):
        assert html.escape(re.sub(r"[`*]", "", heading), quote=False) in re.sub(
            r"</?(code|strong)>", "", body
        )
    n_images = len(re.findall(r"!\[[^\]]*\]\(", md))
    assert n_images >= 1 and body.count("<img alt=") == n_images
    assert not re.search(r'(src|href)="(https?:)?//', body) and "missing image" not in body
    assert re.findall(r'<img [^>]*src="([^"]{0,22})', body) == ["data:image/png;base64,"] * n_images
    assert "Goodput" in md and "Training curves" in md and "What this ran on" in md

    check = browser_check(chromium, page, tmp_path)
    assert check["errors"] == [] and check["console"] == []
    assert check["images"] == n_images and check["decoded"] == n_images


def test_browser_check_catches_broken_and_fetched_images(chromium, tmp_path):
    """Negative controls for the check itself: an image fetched from the network (blocked offline
    and by the page's policy) and an image whose data does not decode must both be reported."""
    from tpulab.evidence.html import render_html

    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    page = tmp_path / "bad.html"
    body = render_html("# t\n\n![broken](bad.png)\n", tmp_path)
    page.write_text(body.replace("</body>", '<img src="http://192.0.2.1/x.png"></body>'))
    check = browser_check(chromium, page, tmp_path)
    assert check["images"] == 2 and check["decoded"] == 0
    assert any("192.0.2.1" in e for e in check["errors"])
    missing = render_html("![gone](nope.png)", tmp_path)
    assert "missing image: nope.png" in missing and "<img" not in missing


def test_without_chromium_the_browser_tests_fail_not_skip(tmp_path):
    """Control of the fixture: with no chromium on PATH the browser test errors out naming the
    setup step (in CI a skipped claimed check would read as a pass)."""
    import os
    import sys

    from conftest import REPO

    test = "tests/test_report_html.py::test_browser_check_catches_broken_and_fetched_images"
    env = {**os.environ, "PATH": str(tmp_path)}  # an empty dir: no chromium, no apt-get
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            test,
            f"--basetemp={tmp_path / 'inner'}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert out.returncode != 0, out.stdout
    assert "chromium is not installed" in out.stdout and "1 error" in out.stdout, out.stdout
    assert "skipped" not in out.stdout, out.stdout
