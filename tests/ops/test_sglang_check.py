"""ops/sglang_check.py (run on a GPU with SGLang): the plain launch carries no speculative flags, the
EAGLE-3 launch carries them all, and the script's helpers import without SGLang."""

import importlib.util
from pathlib import Path

from serving.sglang_backend import SGLangConfig

SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "sglang_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("sglang_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plain_and_speculative_launches_differ_only_by_the_eagle3_flags():
    mod = load_script()
    cfg = SGLangConfig(model_path="/m", draft_model_path="/h", port=31000)
    plain, spec = mod._plain_args(cfg), cfg.launch_args()
    assert "--speculative-algorithm" not in plain and plain[plain.index("--model-path") + 1] == "/m"
    assert spec[spec.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert spec[spec.index("--speculative-draft-model-path") + 1] == "/h" and "--port" in plain


def test_chat_prompts_are_lists_of_ids_under_transformers_5():
    from transformers import BatchEncoding

    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return BatchEncoding({"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]})

    assert load_script().chat_ids(Tok(), "hi") == [5, 6, 7]


def test_the_accept_length_metrics_are_checked_against_one_another():
    mod = load_script()
    meta = {"weight_version": "v1", "completion_tokens": 10, "spec_verify_ct": 3, "spec_accept_length": 10 / 3,
            "spec_correct_drafts_histogram": [0, 1, 1, 1], "spec_num_correct_drafts": 6,
            "spec_num_proposed_drafts": 45}
    assert mod.spec_problems(meta, "v1", 15) == []
    bad = dict(meta, weight_version="default", spec_correct_drafts_histogram=[2], spec_num_proposed_drafts=40)
    assert len(mod.spec_problems(bad, "v1", 15)) == 4
    assert mod.spec_problems({"weight_version": "v1", "completion_tokens": 4}, "v1", 15)
