"""calibrate-head: a head's acceptance calibration is measured on the real target and shipped in
head.json, and an engine installing that head starts from it."""

import json
import shutil
from pathlib import Path

import pytest

SHIPPED = Path(__file__).resolve().parents[2] / "heads" / "smollm2-135m-english-v2"


@pytest.mark.slow
def test_calibrate_head_writes_head_json_and_engines_start_from_it(smollm2, tmp_path):
    from adaptive_eagle.checkpoint import load_head
    from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
    from trainer.calibrate import run_calibrate_head

    head_dir = tmp_path / "head"
    shutil.copytree(SHIPPED, head_dir)
    meta = json.loads((head_dir / "head.json").read_text())
    meta["metrics"].pop("calibration", None)
    (head_dir / "head.json").write_text(json.dumps(meta))
    res = run_calibrate_head(head_dir, smollm2, n_prompts=2, max_tokens=24, log=lambda s: None)
    assert res["prompts"] == 2 and res["observations"] > 0
    shipped = json.loads((head_dir / "head.json").read_text())["metrics"]["calibration"]
    assert list(shipped) == [smollm2.fingerprint]
    loaded = load_head(head_dir, smollm2)  # the weights' checksum still holds
    engine = SpeculativeEngine(smollm2, loaded, EngineConfig(calibration_dir=""))
    assert engine.binding.calibration_source == "head.json"
    from adaptive_eagle.costmodel import AcceptCalibration

    assert engine.calibration.to_dict() == AcceptCalibration.from_dict(shipped[smollm2.fingerprint]).damped().to_dict()
