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
