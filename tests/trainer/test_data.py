"""Training data: recovering a truncated JSON array, ShareGPT, rendering with loss masks, domain
labels, splits and user JSONL."""

import json
from itertools import groupby

import pytest

from trainer.data import (
    Conversation,
    DataError,
    Message,
    classify_domain,
    iter_json_array,
    load_jsonl,
    load_sharegpt,
    render,
    split_of,
)

# ---- the truncated-array decoder -----------------------------------------------------------------------
OBJECTS = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi ] there }"}]},
    {"id": "b", "nested": {"deep": {"list": [1, 2, {"x": "]}"}]}}, "s": "quote \" and brace {"},
    {"id": "c", "value": "[not an array] {not an object}", "n": 3.5},
    {"id": "d", "conversations": [{"from": "gpt", "value": "last one"}]},
]


def array_text(objects, sep=",\n  "):
    """'[\\n  o1,\\n  o2 ...\\n]' and the offset just past each object."""
    parts = [json.dumps(o) for o in objects]
    text, ends = "[\n  ", []
    for i, p in enumerate(parts):
        text += p
        ends.append(len(text))
        if i < len(parts) - 1:
            text += sep
    return text + "\n]", ends


def test_whole_array_and_torn_tails():
    text, ends = array_text(OBJECTS)
    assert list(iter_json_array(text)) == OBJECTS
    for cut in range(len(text) + 1):  # every possible truncation point
        if cut <= text.index("["):
            continue
        want = [o for o, end in zip(OBJECTS, ends) if end <= cut]
        assert list(iter_json_array(text[:cut])) == want, cut


def test_torn_inside_strings_with_brackets():
    text, ends = array_text(OBJECTS[:2])
    inside_b = text.index("]}", ends[0])  # the '"]}"' string value inside object b
    assert list(iter_json_array(text[: inside_b + 2])) == OBJECTS[:1]
    assert list(iter_json_array("  [" + json.dumps(OBJECTS[0]) + ", {\"id\": \"x\", \"v\": \"}]")) == OBJECTS[:1]


def test_empty_and_compact_arrays():
    assert list(iter_json_array("[]")) == []
    assert list(iter_json_array("[")) == []
    assert list(iter_json_array(json.dumps(OBJECTS, separators=(",", ":")))) == OBJECTS


# ---- the real ShareGPT file --------------------------------------------------------------------------------
@pytest.mark.slow
def test_sharegpt_first_conversations():
    convs = list(load_sharegpt(limit=200))
    assert len(convs) == 200
    for c in convs:
        assert c.id and c.messages
        assert {m.role for m in c.messages} <= {"system", "user", "assistant"}
        assert c.messages[0].role != "assistant"
        assert any(m.role == "assistant" and m.content.strip() for m in c.messages)
        assert c.domain in ("english", "code", "math", "non_english")
    assert {c.domain for c in convs} >= {"english", "code"}


@pytest.mark.slow
def test_sharegpt_recovers_about_17600_conversations():
    assert 17_000 <= sum(1 for _ in load_sharegpt()) <= 18_000


# ---- rendering with the real SmolLM2 tokenizer -----------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from adaptive_eagle.targets import resolve_target_path

    return AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m"), local_files_only=True)


CONV = Conversation(
    id="t1",
    messages=(
        Message("system", "You are terse."),
        Message("user", "Write a loop in Python that prints 0, 1, 2."),
        Message("assistant", "```python\nfor i in range(3):\n    print(i)\n```"),
        Message("user", "Thanks! What is 2 + 2?"),
        Message("assistant", "2 + 2 = 4."),
    ),
    domain="code",
)


def masked_runs(ex):
    """[(mask value, [token ids])] for the maximal runs of equal mask values."""
    pairs = list(zip(ex.loss_mask, ex.input_ids))
    return [(m, [t for _, t in run]) for m, run in groupby(pairs, key=lambda p: p[0])]


@pytest.mark.slow
@pytest.mark.parametrize("with_system", [True, False])
def test_render_masks_exactly_the_assistant_turns(tokenizer, with_system):
    conv = CONV if with_system else Conversation("t2", CONV.messages[1:], "code")
    ex = render(conv, tokenizer)
    assert len(ex.input_ids) == len(ex.loss_mask) and set(ex.loss_mask) <= {0, 1}
    assert (ex.id, ex.domain) == (conv.id, conv.domain)
    msgs = [{"role": m.role, "content": m.content} for m in conv.messages]
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert tokenizer.decode(ex.input_ids) == full  # nothing lost or added
    assert ex.input_ids == tokenizer.encode(full, add_special_tokens=False)  # same tokens as one encode
    answers = [m.content for m in conv.messages if m.role == "assistant"]
    runs = masked_runs(ex)
    on = [tokenizer.decode(toks) for m, toks in runs if m == 1]
    assert on == [a + "<|im_end|>" for a in answers]
    for i, (m, toks) in enumerate(runs):
        if m == 1:  # the header before each assistant run is not trained on
            assert tokenizer.decode(runs[i - 1][1]).endswith("<|im_start|>assistant\n")
    off = tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m == 0])
    assert "You are terse." in off or not with_system
    assert "Write a loop in Python" in off and "What is 2 + 2?" in off
    assert off.count("<|im_start|>assistant\n") == 2 and "print(i)" not in off


@pytest.mark.slow
def test_render_truncates_to_max_len(tokenizer):
    full = render(CONV, tokenizer)
    for max_len in (5, 17, len(full.input_ids) - 3):
        ex = render(CONV, tokenizer, max_len=max_len)
        assert len(ex.input_ids) == len(ex.loss_mask) == max_len
        assert ex.input_ids == full.input_ids[:max_len] and ex.loss_mask == full.loss_mask[:max_len]
    assert render(CONV, tokenizer, max_len=10_000) == full


# ---- domains and splits -----------------------------------------------------------------------------------
DOMAIN_SAMPLES = {
    "code": [
        Message("user", "How do I reverse a list in Python?"),
        Message("assistant", "Use slicing:\n```python\ndef reverse(xs):\n    return xs[::-1]\n```\nIt returns a new list."),
    ],
    "math": [
        Message("user", "Solve for x: 3x + 5 = 20. Then find the derivative of x^2 + 3x and the integral of 2x."),
        Message("assistant", "Subtract 5: 3x = 15, so x = 5. The derivative is 2x + 3; the integral of 2x is x^2 + C."),
    ],
    "french": [
        Message("user", "Bonjour, pouvez-vous m'aider à écrire une lettre de motivation pour un poste d'ingénieur "
                        "à Paris ? J'ai cinq années d'expérience dans le développement de logiciels."),
        Message("assistant", "Bien sûr ! Voici une proposition. Madame, Monsieur, je me permets de vous adresser ma "
                             "candidature pour le poste d'ingénieur logiciel. Fort de cinq années d'expérience, j'ai "
                             "acquis des compétences solides en conception et en développement. Je serais ravi de "
                             "contribuer à vos projets. Veuillez agréer mes salutations distinguées."),
    ],
    "chinese": [
        Message("user", "你好，请帮我写一首关于春天的诗。"),
        Message("assistant", "春风吹绿了江南岸，桃花朵朵映山红。燕子归来寻旧垒，细雨无声润物中。"),
    ],
    "english": [
        Message("user", "Can you suggest a few ideas for a weekend trip with my family?"),
        Message("assistant", "Sure! You could visit a nearby national park for a hike and a picnic, spend a day at a "
                             "science museum with the kids, or rent a cabin by a lake and enjoy a campfire."),
    ],
}


@pytest.mark.parametrize(
    "sample, domain",
    [("code", "code"), ("math", "math"), ("french", "non_english"), ("chinese", "non_english"),
     ("english", "english")],
)
def test_classify_domain(sample, domain):
    assert classify_domain(DOMAIN_SAMPLES[sample]) == domain


def test_classify_domain_empty_is_english():
    assert classify_domain([]) == "english"
    assert classify_domain([Message("user", "   ")]) == "english"


def test_split_of_is_deterministic_and_about_five_percent():
    ids = [f"conv-{i}" for i in range(2000)]
    splits = [split_of(i) for i in ids]
    assert splits == [split_of(i) for i in ids]
    assert set(splits) == {"train", "heldout"}
    assert 0.03 <= splits.count("heldout") / len(ids) <= 0.07
    assert all(split_of(i, heldout_percent=0) == "train" for i in ids[:200])
    assert all(split_of(i, heldout_percent=100) == "heldout" for i in ids[:200])
    # a larger held-out share contains the smaller one (buckets are fixed per id)
    assert {i for i in ids if split_of(i, 5) == "heldout"} <= {i for i in ids if split_of(i, 10) == "heldout"}


# ---- user JSONL -----------------------------------------------------------------------------------------------
RECORDS = [
    {"id": "r1", "conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    {"id": "r2", "conversations": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]},
]


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_jsonl_round_trip(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [json.dumps(r) for r in RECORDS] + [""])
    convs = list(load_jsonl(path))
    assert [c.id for c in convs] == ["r1", "r2"]
    for c, r in zip(convs, RECORDS):
        assert [(m.role, m.content) for m in c.messages] == [(t["role"], t["content"]) for t in r["conversations"]]
        assert c.domain in ("english", "code", "math", "non_english")


def test_load_jsonl_names_records_without_id(tmp_path):
    rec = {"conversations": RECORDS[0]["conversations"]}
    path = write_lines(tmp_path / "noid.jsonl", [json.dumps(RECORDS[0]), json.dumps(rec)])
    assert [c.id for c in load_jsonl(path)] == ["r1", "noid.jsonl:2"]


@pytest.mark.parametrize(
    "bad_line",
    [
        '{"id": "x", "conversations": [',  # not JSON
        json.dumps({"id": "x", "conversations": [{"role": "user", "content": "only a question"}]}),  # no answer
        json.dumps({"id": "x", "conversations": [{"role": "wizard", "content": "?"}]}),  # unknown role
        json.dumps({"id": "x", "messages": []}),  # wrong field
        json.dumps(["not", "an", "object"]),
    ],
)
def test_load_jsonl_bad_line_names_file_and_line(tmp_path, bad_line):
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps(RECORDS[0]), bad_line, json.dumps(RECORDS[1])])
    with pytest.raises(DataError, match=rf"bad\.jsonl:2: "):
        list(load_jsonl(path))
