"""Preference data: the pair layout, stops, JSONL refusals, sampled pairs (``tpulab pairs``) and the
directory they are written to. Each check has a negative control."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from conftest import run_cli, tiny_config
from tpulab.data import dialogue as D
from tpulab.data import preference as P
from tpulab.data.corpus import load_corpus
from tpulab.data.tokenizer import PAD
from tpulab.errors import TpulabError
from tpulab.posttrain.pairs import PairsConfig, as_reply, make_pairs

SEQ = tiny_config().data.seq_len


def pref(chosen=b"Ay, my lord.", rejected=b"No", **kw):
    return P.Pref(b"K.\nHow?\n\nH.\n", chosen, rejected, "t", **kw)


def test_a_batch_holds_each_pair_as_chosen_then_rejected_rows_with_their_table_index():
    prefs = [pref(), pref(b"Well.", b"Go to", rejected_stops=False)]
    rows = P.encode(prefs, SEQ)
    batch = P.to_batch(rows, np.array([3, 7]))
    assert batch["inputs"].shape == (4, SEQ) and list(batch["index"]) == [6, 7, 14, 15]
    for row, (reply, stops) in enumerate(
        [(b"Ay, my lord.", True), (b"No", True), (b"Well.", True), (b"Go to", False)]
    ):
        m = batch["mask"][row] > 0
        assert bytes(batch["targets"][row][m].astype(np.uint8)) == P.replied(reply, stops)
        # the reward is read at the input position of the last response byte: the stop byte
        # when it stops, the reply's last byte when it ran out of room
        last = P.replied(reply, stops)[-1]
        assert batch["inputs"][row][batch["read"][row]] == last
    # negative control: the last position of the row is padding, not the reply
    assert batch["inputs"][0][-1] == PAD != batch["inputs"][0][batch["read"][0]]


def test_natural_pairs_fit_with_the_stop_byte_an_input_and_label_whole_speeches():
    cfg = tiny_config()
    prefs = P.from_plays(load_corpus(cfg.data.path), cfg.data)
    batch = P.to_batch(P.encode(prefs.train, SEQ), np.arange(len(prefs.train)))
    P.check_batch(batch)
    stops = batch["inputs"][np.arange(len(batch["read"])), batch["read"]]
    assert (stops == D.STOP).all() and (batch["read"] < SEQ).all()
    # negative control: the check refuses a row whose last byte is past the inputs
    with pytest.raises(TpulabError, match="past the inputs"):
        P.check_batch({**batch, "read": batch["read"] + SEQ})


@pytest.mark.parametrize(
    "line, why",
    [
        (b'{"prompt": "a", "chosen": "b", "rejected": "b"}', "chosen equals rejected"),
        (b'{"prompt": "a", "chosen": "", "rejected": "b", "chosen_stops": false}', "empty"),
        (b'{"prompt": "a", "chosen": "b", "rejected": "c", "rejected_stops": 1}', "true or false"),
        (b'{"prompt": "a", "chosen": "b\\u0003", "rejected": "c"}', "delimiter"),
        (b'{"prompt": "' + b"x" * 26 + b'", "chosen": "bcd", "rejected": "c"}', "more than"),
        (b'{"prompt": "a", "chosen": "b"}', "'rejected' is missing"),
        (b"[1, 2]", "expected an object"),
    ],
)
def test_a_bad_preference_line_is_refused_with_its_file_and_line(tmp_path, line, why):
    good = b'{"prompt": "Who?", "chosen": "Me.", "rejected": "You."}'
    path = tmp_path / "prefs.jsonl"
    path.write_bytes(good + b"\n" + line + b"\n" + good + b"\n")
    with pytest.raises(TpulabError, match=why) as e:
        P.read_jsonl(path, tiny_config().data)
    assert f"{path}:2" in str(e.value)
    path.write_bytes(good + b"\n" + good + b"\n")  # control: the good lines alone load
    assert len(P.read_jsonl(path, tiny_config().data).train) == 1


READERS = {
    "sft": (D.from_jsonl, b'{"prompt": "Who?", "response": "Me."}', "SFT data"),
    "preference": (
        P.read_jsonl,
        b'{"prompt": "Who?", "chosen": "Me.", "rejected": "You."}',
        "preference data",
    ),
}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize(
    "line, why",
    [
        (b"{not json", r"not valid JSON \("),
        (b'{"prompt": "a\xff"}', "not UTF-8 \\(byte 0xff\\)"),
        (b'"a string"', "expected an object with 'prompt'"),
        (b'{"prompt": 3}', "'prompt' is missing or not a string"),
    ],
)
def test_both_jsonl_readers_refuse_a_malformed_line_in_the_same_words(tmp_path, reader, line, why):
    """SFT and preference files go through one reader (``tpulab.data.jsonl``): the same bad line
    is refused with the same ``file:line`` words by both; the first bad line is the one named,
    even when a later line is malformed and the earlier one fails only the caller's own check."""
    read, good, what = READERS[reader]
    path = tmp_path / "data.jsonl"
    path.write_bytes(good + b"\n\n" + line + b"\n" + good + b"\n")
    with pytest.raises(TpulabError, match=f"^{re.escape(str(path))}:3: {why}"):
        read(path, tiny_config().data)
    first = good.replace(b"Me.", b"You.") if reader == "preference" else good.replace(b"Me.", b"")
    path.write_bytes(good + b"\n" + first + b"\n" + line + b"\n")
    with pytest.raises(TpulabError, match=f"^{re.escape(str(path))}:2: "):
        read(path, tiny_config().data)
    missing = re.escape(str(tmp_path / "none"))
    with pytest.raises(TpulabError, match=f"^cannot read {what} {missing}: "):
        read(tmp_path / "none", tiny_config().data)
    path.write_bytes(good + b"\n" + good + b"\n")  # control: the good lines alone load
    assert len(read(path, tiny_config().data).train) == 1


def test_an_empty_reply_that_stops_is_a_reply_and_its_mask_holds_the_stop_byte(tmp_path):
    path = tmp_path / "p.jsonl"
    line = json.dumps({"prompt": "Who?", "chosen": "Me.", "rejected": ""})
    path.write_text(line + "\n" + line + "\n")
    prefs = P.read_jsonl(path, tiny_config().data)
    batch = P.to_batch(P.encode(prefs.train, SEQ), np.arange(1))
    assert batch["mask"][1].sum() == 1 and batch["targets"][1][batch["mask"][1] > 0] == D.STOP


def test_the_gold_reward_of_a_stored_reply_counts_its_stop():
    stopped, cut = pref(b"Ay.", b"No").rewards(), pref(b"Ay.", b"No", chosen_stops=False).rewards()
    assert stopped[0] - cut[0] == 1.0 and stopped[1] == cut[1]


def test_replies_are_cut_where_the_pair_format_cannot_hold_them():
    assert as_reply([ord("A"), ord("y"), D.STOP, ord("x")]) == (b"Ay", True, False)
    assert as_reply([ord("A"), D.PROMPT_START, ord("y")]) == (b"A", False, True)
    assert as_reply([ord("A"), 256]) == (b"A", False, True)  # BOS: a special token
    assert as_reply([ord("A"), 0xC3]) == (b"A", False, True)  # half a UTF-8 character
    assert as_reply([ord("A"), 0xC3, 0xA9, D.STOP]) == ("Aé".encode(), True, False)  # control


# --- sampled pairs (tpulab pairs) ----------------------------------------------------------------


def test_sampled_pairs_record_their_policy_and_seeds_and_read_back(sampled_pairs, sft_policy):
    from tpulab.train.restore import load_model

    meta = json.loads((sampled_pairs / P.DATASET_FILE).read_text())
    assert meta["policy"]["checkpoint_digest"] == load_model(sft_policy).checkpoint_digest
    assert meta["labeller_seed"] == 0 and meta["sampling"]["temperature"] == 1.0
    prefs = P.read_dir(sampled_pairs, tiny_config().data)
    assert len(prefs.train) == meta["counts"]["train"]["pairs"] > 20
    assert len(prefs.eval) == meta["counts"]["eval"]["pairs"] > 0
    assert all(p.chosen != p.rejected or p.chosen_stops != p.rejected_stops for p in prefs.train)
    # the identity names the policy's digest and the labeller's seed
    other = dict(meta, labeller_seed=1)
    moved = sampled_pairs.parent / "relabelled"
    shutil.copytree(sampled_pairs, moved)
    (moved / P.DATASET_FILE).write_text(json.dumps(other))
    assert P.read_dir(moved, tiny_config().data).identity != prefs.identity


def test_sampling_is_seeded_and_the_labeller_draws_bradley_terry(
    sft_policy, sampled_pairs, tmp_path
):
    again = make_pairs(
        sft_policy, tmp_path / "again", PairsConfig(train_prompts=64, eval_prompts=16)
    )
    assert (tmp_path / "again" / P.TRAIN_FILE).read_bytes() == (
        sampled_pairs / P.TRAIN_FILE
    ).read_bytes()
    relabel = make_pairs(
        sft_policy,
        tmp_path / "relabel",
        PairsConfig(train_prompts=64, eval_prompts=16, labeller_seed=5),
    )
    # the same replies, other Bradley-Terry draws: some pairs swap (negative control for the seed)
    a = P.read_dir(tmp_path / "again", tiny_config().data).train
    b = P.read_dir(tmp_path / "relabel", tiny_config().data).train
    assert again["counts"]["train"]["pairs"] == relabel["counts"]["train"]["pairs"]
    swapped = sum(x.chosen != y.chosen for x, y in zip(a, b))
    assert 0 < swapped < len(a)
    unordered = lambda prefs: [(p.prompt, {p.chosen, p.rejected}) for p in prefs]  # noqa: E731
    assert unordered(a) == unordered(b)  # the same sampled replies: only the labels moved


def test_a_changed_or_foreign_pairs_dir_is_refused(sampled_pairs, tmp_path):
    cfg = tiny_config().data
    bad = tmp_path / "bad"
    shutil.copytree(sampled_pairs, bad)
    with open(bad / P.TRAIN_FILE, "ab") as f:
        f.write(b'{"prompt": "A.\\n", "chosen": "x", "rejected": "y"}\n')
    with pytest.raises(TpulabError, match="does not match the sha256"):
        P.read_dir(bad, cfg)
    shutil.copy(sampled_pairs / P.TRAIN_FILE, bad / P.TRAIN_FILE)
    P.read_dir(bad, cfg)  # control: the original file reads
    meta = json.loads((bad / P.DATASET_FILE).read_text())
    (bad / P.DATASET_FILE).write_text(json.dumps({**meta, "tokenizer": {"kind": "bpe"}}))
    with pytest.raises(TpulabError, match="another tokenizer"):
        P.read_dir(bad, cfg)
    (bad / P.DATASET_FILE).write_text("{")
    with pytest.raises(TpulabError, match="corrupt dataset"):
        P.read_dir(bad, cfg)
    with pytest.raises(TpulabError, match="cannot read"):
        P.read_dir(tmp_path / "nowhere", cfg)


def test_pairs_refuses_bad_input_in_one_line_and_writes_nothing(
    trained_run, sampled_pairs, tmp_path
):
    out = tmp_path / "out"
    r = run_cli("pairs", "--policy", str(tmp_path / "missing"), "--out", str(out))
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "holds no checkpoints" in r.stderr and not out.exists()
    before = sorted(p.name for p in sampled_pairs.iterdir())
    with pytest.raises(TpulabError, match="is not empty \\(dataset.json is in the way\\)"):
        make_pairs(trained_run, sampled_pairs)
    assert sorted(p.name for p in sampled_pairs.iterdir()) == before
    with pytest.raises(TpulabError, match="temperature"):
        make_pairs(trained_run, out, PairsConfig(temperature=-1.0))
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
