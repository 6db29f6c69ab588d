"""regen-data: ShareGPT prompts answered by the target, as train-head JSONL (trainer/regen.py)."""

import json

import pytest
from typer.testing import CliRunner

from trainer import data as D
from trainer.regen import RegenConfig, done_ids, drop_torn_tail, pick_prompts, regenerate, trim_unfinished, validate


def conv(cid: str, text: str | None = None) -> D.Conversation:
    text = text or f"Tell me about rivers and lakes, part {cid}."
    return D.Conversation(id=cid, domain="english", messages=(D.Message("user", text), D.Message("assistant", "ok")))


def ids_in(split: str, n: int) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        if D.split_of(f"c{i}") == split:
            out.append(f"c{i}")
        i += 1
    return out


def test_pick_prompts_takes_each_split_as_asked_and_skips_done_ones(tmp_path):
    train, held = ids_in("train", 6), ids_in("heldout", 3)
    convs = [conv(c) for c in sorted(train + held, key=lambda c: int(c[1:]))]
    cfg = RegenConfig(out=tmp_path / "o.jsonl", train_conversations=4, heldout_conversations=2)
    picked = [cid for cid, _ in pick_prompts(convs, cfg, skip=set())]
    assert [c for c in picked if D.split_of(c) == "train"] == train[:4]
    assert [c for c in picked if D.split_of(c) == "heldout"] == held[:2]
    # ids already written count toward the quota: a resumed run answers no more than asked in all
    again = [cid for cid, _ in pick_prompts(convs, cfg, skip={train[0], held[0]})]
    assert sorted(again) == sorted(set(picked) - {train[0], held[0]})


def test_pick_prompts_passes_over_short_and_repeated_prompts(tmp_path):
    train = ids_in("train", 4)
    same = "Why is the sea salty?"
    convs = [conv(train[0], "continue"), conv(train[1], same), conv(train[2], same), conv(train[3])]
    cfg = RegenConfig(out=tmp_path / "o.jsonl", train_conversations=5, heldout_conversations=0)
    assert [cid for cid, _ in pick_prompts(convs, cfg, skip=set())] == [train[1], train[3]]


def test_trim_unfinished_ends_a_cut_reply_at_a_sentence():
    assert trim_unfinished("The sky is blue. The grass is gre") == "The sky is blue."
    assert trim_unfinished("Steps:\n1. Boil water\n2. Add the") == "Steps:\n1. Boil water"
    text = "one long sentence without any end at all and then it is cut"
    assert trim_unfinished(text) == text  # nothing to cut at: kept whole


@pytest.mark.parametrize("field,value", [("batch", 0), ("max_new_tokens", 2), ("train_conversations", -1)])
def test_validate_names_the_field_and_range(tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"{field}: {value} is outside \d+\.\.\d+"):
        validate(RegenConfig(out=tmp_path / "o.jsonl", **{field: value}))
    with pytest.raises(ValueError, match="domains: unknown"):
        validate(RegenConfig(out=tmp_path / "o.jsonl", domains=("poetry",)))


def test_a_torn_last_line_is_cut_off_and_a_bad_line_elsewhere_refused(tmp_path):
    out = tmp_path / "o.jsonl"
    good = json.dumps({"id": "a", "conversations": []}) + "\n"
    out.write_text(good + '{"id": "b", "conversa')  # killed mid-write
    assert drop_torn_tail(out) == len('{"id": "b", "conversa')
    assert out.read_text() == good and done_ids(out) == {"a"}
    assert drop_torn_tail(out) == 0
    out.write_text(good + good + '{"id": "c", "conversa')  # read back in 4-byte pieces: the same cut
    assert drop_torn_tail(out, chunk=4) == len('{"id": "c", "conversa') and out.read_text() == good + good
    out.write_text('{"id": "d"')  # nothing whole at all
    assert drop_torn_tail(out, chunk=4) == len('{"id": "d"') and out.read_text() == ""
    out.write_text(good)
    out.write_text('{"id": "b", "conversa\n' + good)  # not a tail: refused, naming the line
    with pytest.raises(D.DataError, match=r"o\.jsonl:1: not JSON"):
        done_ids(out)


def test_cli_refuses_a_bad_option_and_writes_nothing(tmp_path):
    from adaptive_eagle_cli import app

    out = tmp_path / "o.jsonl"
    res = CliRunner().invoke(app, ["regen-data", "--out", str(out), "--batch", "0"])
    assert res.exit_code == 2 and "batch: 0 is outside 1..512" in res.output
    assert not out.exists()


def test_regenerate_answers_with_the_target_and_resumes(smollm2, tmp_path):
    out = tmp_path / "regen.jsonl"
    convs = [conv(c, f"Name {k + 2} colours of the rainbow.") for k, c in enumerate(ids_in("train", 3))]
    cfg = RegenConfig(out=out, train_conversations=3, heldout_conversations=0, max_new_tokens=12, batch=2)
    res = regenerate(cfg, smollm2, convs)
    assert res["written"] + res["empty_replies"] == 3 and res["written"] >= 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["id"] for r in rows} == done_ids(out) <= {c.id for c in convs}
    for r in rows:  # train-head's own reader takes the file as it is
        assert [m["role"] for m in r["conversations"]] == ["user", "assistant"]
    assert len(list(D.load_jsonl(out))) == len(rows)
    # a reply is the target's own greedy continuation of the chat-templated prompt: the batch's longest prompt
    # (no left padding) against the same prompt decoded alone, over its first tokens
    tok = smollm2.tokenizer
    longest = max(convs, key=lambda c: len(tok.encode(c.messages[0].content)))
    text = tok.apply_chat_template([{"role": "user", "content": longest.messages[0].content}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    alone = smollm2.model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.eos_token_id)
    reply = next(r["conversations"][1]["content"] for r in rows if r["id"] == longest.id)
    assert tok.encode(reply, add_special_tokens=False)[:3] == alone[0, ids.shape[1]:].tolist()
    with open(out, "a") as f:  # a run killed mid-write: the next one cuts the torn line and goes on
        f.write('{"id": "torn", "conv')
    again = regenerate(cfg, smollm2, convs)
    assert again["written"] == 0 and again["skipped_done"] == len(rows) and again["torn_bytes_dropped"] == 20
    assert len(out.read_text().splitlines()) == len(rows)
