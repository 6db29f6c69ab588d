"""Acceptance by context position: bucket edges, per-bucket sums equal to the overall figures (TTT
evaluation and acceptance replay), the long-session builder, and `eval-head --by-position`."""

import json
from unittest import mock

import pytest
import torch
from typer.testing import CliRunner

from adaptive_eagle.checkpoint import HeadMeta
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle_cli import app
from feature_store.config import StoreConfig
from feature_store.writer import write_records
from tests.trainer.test_nearline import world  # noqa: F401  (module fixture)
from tests.trainer.test_ttt import make_batch, make_setup
from trainer.cli import DEFAULT_BUCKETS
from trainer.data import Conversation, DataError, Message, TokenizedExample, render, split_of
from trainer.offline import evaluate
from trainer.positions import (DEFAULT_EDGES, PositionTally, bucket_label, bucket_of, buckets_below, parse_edges)
from trainer.replay import RecordReplay, ReplayScore, TreeParams, replay_heads
from trainer.sessions import long_sessions
from trainer.ttt import ttt_loss


# ---- buckets -----------------------------------------------------------------------------------------------
def test_bucket_edges_and_labels():
    assert [bucket_of(p, DEFAULT_EDGES) for p in (0, 511, 512, 1023, 1024, 4095, 4096, 8191, 8192, 10**6)] == \
        [0, 0, 1, 1, 2, 3, 4, 4, 5, 5]
    labels = [bucket_label(lo, hi) for lo, hi in buckets_below(DEFAULT_EDGES, 8192)]
    assert labels == ["0-512", "512-1k", "1-2k", "2-4k", "4-8k"]
    assert [bucket_label(lo, hi) for lo, hi in buckets_below(DEFAULT_EDGES, 1024)] == ["0-512", "512-1k"]
    assert buckets_below(DEFAULT_EDGES, 1025)[-1] == (1024, 2048)
    assert buckets_below(DEFAULT_EDGES, 9000)[-1] == (8192, None) and bucket_label(8192, None) == "8k+"
    assert bucket_label(0, 256) == "0-256" and bucket_label(256, 512) == "256-512"
    assert parse_edges(DEFAULT_BUCKETS) == DEFAULT_EDGES  # the CLI's torch-free default is the same


@pytest.mark.parametrize("text", ["", "0", "5,10", "0,512,512", "0,100,50", "0,a", "-1,0"])
def test_bad_edges_name_the_rule(text):
    with pytest.raises(ValueError, match="buckets"):
        parse_edges(text)


def test_a_chain_row_counts_where_its_first_draft_lands():
    """Row t drafts x_{t+2}: rows 509 and 510 fall either side of the 512 edge."""
    tally = PositionTally((0, 512, 1024), steps=1)
    rows = torch.tensor([0, 509, 510, 1000])
    tally.add(rows, torch.ones(1, 4, dtype=torch.bool), torch.tensor([[True, False, True, True]]))
    got = {b["bucket"]: (b["eligible"][0], b["accepted"][0]) for b in tally.summary(limit=1100)}
    assert got == {"0-512": (2, 1), "512-1k": (2, 2), "1k+": (0, 0)}


# ---- TTT evaluation ----------------------------------------------------------------------------------------
def test_bucket_sums_equal_the_overall_step_sums():
    target, head = make_setup(seed=5)
    batch = make_batch(target, head, b=3, t=40, seed=5)
    out = ttt_loss(head, batch)
    tally = PositionTally((0, 8, 16, 32), steps=len(out.step_accept))
    tally.add(out.row_position, out.row_eligible, out.row_accepted)
    buckets = tally.summary(limit=40)
    assert [b["bucket"] for b in buckets] == ["0-8", "8-16", "16-32", "32+"]
    assert [sum(b["eligible"][j] for b in buckets) for j in range(7)] == out.step_eligible
    assert [sum(b["accepted"][j] for b in buckets) for j in range(7)] == out.step_accept
    assert sum(b["positions"] for b in buckets) == out.step_count[0]
    assert all(b["positions"] > 0 for b in buckets)


def tiny_examples(target, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, target.config.vocab_size, (n,), generator=g).tolist()
        mask = (torch.rand(n, generator=g) < 0.7).long().tolist()
        out.append(TokenizedExample(f"e{i}", "english", ids, mask))
    return out


def test_evaluate_by_position_adds_a_slice_and_leaves_the_rest_unchanged():
    target, head = make_setup(seed=6, dtype=torch.float32)
    exs = tiny_examples(target, [48, 30, 64])
    plain = evaluate(head, target, exs, max_len=64, batch_tokens=64, bf16=False)
    sliced = evaluate(head, target, exs, max_len=64, batch_tokens=64, bf16=False, edges=(0, 16, 32, 128))
    assert "by_position" not in plain
    assert {k: v for k, v in sliced.items() if k != "by_position"} == plain
    buckets = sliced["by_position"]
    assert [b["bucket"] for b in buckets] == ["0-16", "16-32", "32-128"]  # 64 tokens: nothing past 64
    assert sum(b["positions"] for b in buckets) == plain["positions"]
    eligible = [sum(b["eligible"][j] for b in buckets) for j in range(7)]
    accepted = [sum(b["accepted"][j] for b in buckets) for j in range(7)]
    assert [a / e if e else 0.0 for a, e in zip(accepted, eligible)] == pytest.approx(plain["alpha"])


# ---- acceptance replay -------------------------------------------------------------------------------------
def test_replay_steps_carry_their_positions_and_the_slice_sums_to_the_whole(world):  # noqa: F811
    target, head, records = world
    score = replay_heads({"h": head}, records, target, TreeParams(3, 2, 6)).scores["h"]
    for rec, r in zip(records, score.records):
        first = next(i for i, m in enumerate(rec.loss_mask) if m)
        assert len(r.positions) == r.steps and r.positions[0] == first + 1
        assert all(b == a + k + 1 for a, b, k in zip(r.positions, r.positions[1:], r.accepted))
    buckets = score.by_position((0, 8, 16, 24))
    assert sum(b["steps"] for b in buckets) == sum(r.steps for r in score.records)
    assert sum(b["accepted"] for b in buckets) == sum(sum(r.accepted) for r in score.records)
    steps = sum(b["steps"] for b in buckets)
    assert sum(b["accept_length"] * b["steps"] for b in buckets) / steps == pytest.approx(score.mean, abs=1e-3)


def test_replay_slice_of_hand_made_records():
    s = ReplayScore((RecordReplay("a", None, (0, 2, 1), (3, 4, 7)), RecordReplay("b", None, (1,), (600,)),
                     RecordReplay("c", None, (3, 3))))  # c: replayed without positions, left out
    got = s.by_position((0, 512, 1024))
    assert [(b["bucket"], b["steps"], b["accepted"]) for b in got] == [("0-512", 3, 3), ("512-1k", 1, 1)]
    assert got[0]["accept_length"] == pytest.approx(2.0) and got[0]["alpha"][:2] == pytest.approx([2 / 3, 1 / 2], abs=1e-4)


def test_eval_head_by_position_on_stored_traffic(tmp_path, world):  # noqa: F811
    target, head, records = world
    store = StoreConfig(backend="local", local_root=str(tmp_path / "store"), fsync=False)
    write_records(store, records)
    reg = HeadRegistry.create(tmp_path / "registry")
    reg.register(head, HeadMeta.new("v1", target.name, target.fingerprint), dtype=torch.float32)
    base = ["eval-head", "v1", "--root", str(tmp_path / "store"), "--registry", str(tmp_path / "registry"),
            "--target", "tiny", "--depth", "3", "--topk", "2", "--draft-tokens", "6"]
    with mock.patch("trainer.evaluate.load_target", lambda *a, **k: target):
        res = CliRunner().invoke(app, base + ["--by-position", "--buckets", "0,8,16", "--json"])
        assert res.exit_code == 0, res.output
        v1 = json.loads(res.output)["heads"]["v1"]
        assert sum(b["steps"] for b in v1["by_position"]) == v1["steps"]
        assert [b["bucket"] for b in v1["by_position"]][:2] == ["0-8", "8-16"]
        plain = json.loads(CliRunner().invoke(app, base + ["--json"]).output)["heads"]["v1"]
        assert "by_position" not in plain and plain["steps"] == v1["steps"]
        table = CliRunner().invoke(app, base + ["--by-position", "--buckets", "0,8,16"])
        assert table.exit_code == 0 and "by context position" in table.output and "8-16" in table.output


# ---- long sessions -----------------------------------------------------------------------------------------
class CharChat:
    """A ChatML tokenizer stand-in: one token per character, the turn markers one token each."""

    eos_token = "<|im_end|>"
    SPECIAL = {"<|im_start|>": 1, "<|im_end|>": 2}

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            special = next((s for s in self.SPECIAL if text.startswith(s, i)), None)
            out.append(self.SPECIAL[special] if special else ord(text[i]) + 10)
            i += len(special) if special else 1
        return out

    def decode(self, ids):
        back = {v: k for k, v in self.SPECIAL.items()}
        return "".join(back.get(t, chr(t - 10) if t >= 10 else "") for t in ids)

    def convert_tokens_to_ids(self, token):
        return self.SPECIAL[token]


def conversations(k=400):
    """Conversations of 1-3 exchanges (some with a system message or an unanswered last question)."""
    out = []
    for i in range(k):
        msgs = [Message("system", f"sys{i}")] if i % 7 == 0 else []
        for t in range(1 + i % 3):
            msgs += [Message("user", f"q{i}.{t} " + "u" * (5 + i % 11)), Message("assistant", f"a{i}.{t} " + "z" * 30)]
        if i % 5 == 0:
            msgs.append(Message("user", "unanswered"))
        out.append(Conversation(f"c{i}", tuple(msgs), "english"))
    return out


def test_sessions_are_held_out_bounded_masked_and_deterministic():
    convs, tok = conversations(), CharChat()
    heldout = [c.id for c in convs if split_of(c.id) == "heldout"]
    sessions = long_sessions(convs, tok, min_tokens=150, max_tokens=200, n=3)
    assert len(sessions) == 3 and sessions == long_sessions(convs, tok, min_tokens=150, max_tokens=200, n=3)
    used = [c for s in sessions for c in s.sources]
    assert used == heldout[: len(used)]  # consecutive held-out conversations, each used once
    for s in sessions:
        ex = s.example
        assert 150 <= len(ex.input_ids) <= 200 and len(ex.loss_mask) == len(ex.input_ids)
        masked = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
        answers = "".join(m.content + "<|im_end|>" for m in s.conversation.messages if m.role == "assistant")
        assert answers.startswith(masked)  # assistant turns only, in order, cut at max_tokens
        assert masked.count("a") >= 2 and "q" not in masked and "sys" not in masked
        roles = [m.role for m in s.conversation.messages]
        assert "system" not in roles and roles[-1] == "assistant" and "unanswered" not in str(s.conversation)
        assert s.starts[0] == 0 and list(s.starts) == sorted(s.starts) and s.starts[-1] < len(ex.input_ids)
        for part, start in zip(s.parts, s.starts):  # each part's own rendering sits at its start
            alone = render(part, tok).input_ids
            assert ex.input_ids[start : start + len(alone)] == alone[: len(ex.input_ids) - start]


def test_sessions_take_what_there_is_and_refuse_bad_bounds():
    convs, tok = conversations(), CharChat()
    heldout = [c for c in convs if split_of(c.id) == "heldout"]
    assert long_sessions(convs, tok, min_tokens=10**6, max_tokens=10**6, n=2) == []  # never long enough
    one_each = long_sessions(convs, tok, min_tokens=1, max_tokens=30, n=1000)
    assert [s.sources for s in one_each] == [(c.id,) for c in heldout]
    assert all(len(s.example.input_ids) == 30 for s in one_each)
    assert {c for s in long_sessions(convs, tok, min_tokens=1, max_tokens=30, n=1000, split="train")
            for c in s.sources} == {c.id for c in convs} - {c.id for c in heldout}
    with pytest.raises(DataError, match="min_tokens"):
        long_sessions(convs, tok, min_tokens=300, max_tokens=200, n=1)
    with pytest.raises(DataError, match="n 0"):
        long_sessions(convs, tok, min_tokens=1, max_tokens=200, n=0)


def test_long_heldout_sharegpt_sessions_with_the_real_tokenizer(smollm2_tokenizer):
    from trainer.data import load_sharegpt

    convs = list(load_sharegpt(limit=4000))
    sessions = long_sessions(convs, smollm2_tokenizer, min_tokens=4096, max_tokens=8192, n=2, domains=["english"])
    assert len(sessions) == 2
    for s in sessions:
        assert 4096 <= len(s.example.input_ids) <= 8192 and s.example.domain == "english"
        assert all(split_of(c) == "heldout" for c in s.sources) and len(s.sources) >= 2
        text = smollm2_tokenizer.decode(s.example.input_ids)
        assert text.count("<|im_start|>system") == 1  # one session, one system prompt
    assert sessions == long_sessions(convs, smollm2_tokenizer, min_tokens=4096, max_tokens=8192, n=2,
                                     domains=["english"])


def test_run_eval_head_by_position_on_the_shipped_head(smollm2):
    from adaptive_eagle.cli import SHIPPED_HEAD
    from trainer.train_head import position_table, run_eval_head

    lines = []
    res = run_eval_head(SHIPPED_HEAD, smollm2, domains=["english"], max_len=1024, by_position=True, sessions=1,
                        log=lines.append)["english"]
    assert res["sessions"] == 1 and res["session_tokens"] == 1024 and res["conversations"] >= 1
    assert [b["bucket"] for b in res["by_position"]] == ["0-512", "512-1k"]
    assert sum(b["positions"] for b in res["by_position"]) == res["positions"] > 500
    assert lines == [position_table("english", res)] and "512-1k" in lines[0]
