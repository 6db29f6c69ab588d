"""ops/sglang_check.py and ops/gpu_check.sh (run on a GPU with SGLang), on the parts that run without one: the
plain launch carries no speculative flags, the EAGLE-3 launch carries them all, the helpers import without
SGLang; the preflight names what the 0.5.23 wheel's own pins miss on a machine; the concurrent step tells a
backend that batches from one that serialises, and counts failed and hung streams; the steps' output equality
and three swaps in a row run through the SGLang stand-in; gpu_check.sh writes its summary where asked, on
every exit, and cuts a step at its budget."""

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from serving.sglang_backend import SGLangConfig

SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "sglang_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("sglang_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sglang_check"] = mod  # its dataclasses look their module up there
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


# ---- preflight: sglang's own requirements against what a machine has -------------------------------------------
def wheel_requires() -> list[str]:
    import zipfile

    from tests.serving.sglang_upstream import wheel_path

    with zipfile.ZipFile(wheel_path()) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def test_the_lent_gpu_machine_fails_sglangs_own_pins():
    """The lent machine's stack (torch 2.11.0+cu130, transformers 5.17, triton 3.6, no sglang-kernel) against the
    0.5.23 wheel's Requires-Dist: torch, transformers and the kernels wheel are named, with what is installed."""
    mod = load_script()
    lent = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "triton": "3.6.0", "numpy": "2.3.0"}
    problems = mod.requirement_problems(wheel_requires(), lent.get)
    assert "torch==2.14.1: 2.11.0+cu130 installed" in problems
    assert "transformers==5.19.0: 5.17.0 installed" in problems
    assert "sglang-kernel==0.4.10: not installed" in problems
    assert not any(p.startswith("numpy") for p in problems)  # unpinned and installed: met
    assert not any(p.startswith("av") for p in problems)  # an aarch64-only requirement: not this platform's


def test_requirements_of_extras_and_other_platforms_are_not_asked_for():
    mod = load_script()
    reqs = ["torch==2.14.1", "numpy", 'av==16.1.0; platform_machine == "aarch64"', 'pytest; extra == "test"']
    assert mod.requirement_problems(reqs, {"torch": "2.14.1", "numpy": "2.0"}.get) == []
    assert mod.requirement_problems(reqs, {"torch": "2.14.0"}.get) == ["torch==2.14.1: 2.14.0 installed",
                                                                       "numpy: not installed"]


# ---- the concurrent step --------------------------------------------------------------------------------------
class Result:
    def __init__(self, ids):
        self.token_ids = tuple(ids)


class FakeBackend:
    """Streams each prompt's tokens reversed, one item per `step_s`; `serial`: one request at a time (the gate
    the SGLang replica had in front of SGLang)."""

    def __init__(self, step_s=0.01, serial=False, fail_on=None):
        self.step_s, self.fail_on = step_s, fail_on
        self.lock = threading.Lock() if serial else None

    def stream(self, req, ids, capture=False):
        if self.lock is not None:
            with self.lock:
                yield from self._stream(req, ids)
        else:
            yield from self._stream(req, ids)

    def _stream(self, req, ids):
        for _ in range(5):
            time.sleep(self.step_s)
            if self.fail_on is not None and list(ids) == self.fail_on:
                raise RuntimeError("the server went away")
            yield "delta"
        yield Result(reversed(ids))


def test_sixteen_streams_at_once_overlap_where_the_backend_batches_and_not_where_it_serialises():
    mod = load_script()
    prompts = [[i, i + 1, i + 2] for i in range(16)]
    run = mod.concurrent_streams(FakeBackend(), prompts, 8, timeout_s=20)
    assert run.hung == 0 and not run.errors and run.overlap == 16
    assert list(run.outputs) == [list(reversed(p)) for p in prompts]
    serial = mod.concurrent_streams(FakeBackend(step_s=0.002, serial=True), prompts, 8, timeout_s=20)
    assert serial.hung == 0 and serial.overlap == 1  # the check's `concurrent_overlapped` fails on it


def test_a_failed_or_hung_stream_is_counted_not_waited_for():
    mod = load_script()
    prompts = [[1], [2], [3]]
    run = mod.concurrent_streams(FakeBackend(fail_on=[2]), prompts, 8, timeout_s=20)
    assert run.outputs[1] is None and len(run.errors) == 1 and "request 1" in run.errors[0]
    slow = mod.concurrent_streams(FakeBackend(step_s=2.0), prompts, 8, timeout_s=0.5)
    assert slow.hung == 3 and slow.wall_s < 2.0


def test_max_overlap():
    mod = load_script()
    assert mod.max_overlap([(0, 1), (1, 2), (2, 3)]) == 1  # one ends as the next starts
    assert mod.max_overlap([(0, 3), (1, 2), (1.5, 4)]) == 3 and mod.max_overlap([]) == 0


# ---- the steps through the SGLang stand-in ------------------------------------------------------------------
def standin_replica(tmp_path):
    from serving.sglang_backend import SGLangBackend, launch_sglang
    from tests.serving.sglang_standin import StandInHost, WordTokenizer, make_registry

    registry = make_registry(tmp_path / "registry")
    host = StandInHost()
    config = SGLangConfig(model_path="/models/tiny", draft_model_path=str(registry.get("v1")), weight_version="v1",
                          launch=True, health_poll_s=0.001, startup_timeout_s=5.0)
    client = host.client()
    process = launch_sglang(config, client=client, spawn=host.spawn)
    backend = SGLangBackend(config, WordTokenizer(), registry, "v1", "fp", client=client, process=process,
                            spawn=host.spawn)
    return host, backend, client


def test_concurrent_outputs_through_the_sglang_backend_equal_the_sequential_ones(tmp_path):
    mod = load_script()
    host, backend, _ = standin_replica(tmp_path)
    host.server.step_s = 0.005  # the stand-in's queueing model: each verify step takes time, as on a GPU
    prompts = [[5 + i, 6, 7 + i] for i in range(16)]
    sequential = mod.serve_with(backend, None, prompts, 12, "v1")
    run = mod.concurrent_streams(backend, prompts, 12, timeout_s=60)
    assert run.hung == 0 and not run.errors, run.errors
    assert list(run.outputs) == sequential["outputs"] and all(len(o) == 12 for o in run.outputs)
    # the replica passes the 16 through to SGLang's batch (the stand-in's scheduler runs up to 48 at once)
    assert run.overlap > 8 and host.server.peak_running > 8, (run.overlap, host.server.peak_running)


def test_three_swaps_in_a_row_keep_the_target_and_each_heads_draft_checksum(tmp_path):
    from serving.sglang_swap import WeightSession

    mod = load_script()
    host, backend, client = standin_replica(tmp_path)
    session = WeightSession(client)
    sums = session.checksums()
    drafts = {"v1": sums.draft}
    assert mod.swaps_in_a_row(backend, session, ["v2", "v1", "v2"], drafts, sums.target) == []
    assert set(drafts) == {"v1", "v2"} and drafts["v1"] != drafts["v2"]
    ids = [5, 6, 7]
    want = mod.generate(client, ids, 8)["output_ids"]
    assert mod.alive_problems(client, ids, 8, want) == []
    # v3 has another draft vocabulary: SGLang restarts on it, which is not an in-place swap
    problems = mod.swaps_in_a_row(backend, session, ["v3"], drafts, sums.target)
    assert len(problems) == 1 and "swap 1 to v3" in problems[0] and "restarted" in problems[0]
    host.server.alive = False
    assert "does not answer" in mod.alive_problems(client, ids, 8, want)[0]


def test_the_report_is_written_as_the_checks_go_and_a_preflight_writes_its_findings(tmp_path):
    mod = load_script()
    report = mod.Report(tmp_path / "r.json")
    report.check("a", True)
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is True
    report.check("b", False)
    report.figure(x=1)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["ok"] is False and saved["checks"] == {"a": True, "b": False} and saved["figures"] == {"x": 1}
    rc = mod.main(["--preflight", "--out", str(tmp_path / "out")])
    found = json.loads((tmp_path / "out" / "preflight.json").read_text())
    assert rc == (1 if found["problems"] else 0) and found["python"] == sys.version.split()[0]


# ---- ops/gpu_check.sh: where the results go, and the budget it keeps --------------------------------------------
GPU_CHECK = SCRIPT.parent / "gpu_check.sh"


def fake_bin(tmp_path, sleep_s: int) -> dict:
    """PATH with an nvidia-smi that answers, and a PY that runs Python only for the script's summary (stdin)
    and otherwise sleeps: a step that would run past the budget."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200, 143771 MiB, 580.00'\n")
    (bin_dir / "py").write_text(f'#!/bin/sh\n[ "$1" = "-" ] && exec {sys.executable} "$@"\nexec sleep {sleep_s}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PY": str(bin_dir / "py"), "SKIP_INSTALL": "1"}


def test_without_a_gpu_it_stops_at_once_and_still_writes_its_summary_where_asked(tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin", "PY": sys.executable}
    res = subprocess.run(["bash", str(GPU_CHECK), "--out", str(tmp_path / "o")], env=env, capture_output=True,
                         text=True, timeout=60)
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert res.returncode == 2 and summary["ok"] is False
    assert [s["step"] for s in summary["steps"]] == ["gpu"] and summary["steps"][0]["rc"] != 0


def test_every_step_runs_under_the_budget_and_a_step_past_it_is_cut_and_reported(tmp_path):
    env = {**fake_bin(tmp_path, 60), "BUDGET_S": "3", "OUT": str(tmp_path / "o")}
    t0 = time.monotonic()
    res = subprocess.run(["bash", str(GPU_CHECK)], env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30, res.stdout  # the 60 s step was cut at the 3 s budget
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())  # OUT from the environment
    assert res.returncode != 0 and summary["ok"] is False and summary["budget_s"] == 3
    cut = [s for s in summary["steps"] if s["timed_out"]]
    assert cut and cut[0]["step"] == "preflight" and cut[0]["limit_s"] <= 3
    env = {**fake_bin(tmp_path / "b", 0), "BUDGET_S": "5000", "OUT": str(tmp_path / "p")}
    subprocess.run(["bash", str(GPU_CHECK)], env=env, capture_output=True, text=True, timeout=60)
    assert json.loads((tmp_path / "p" / "summary.json").read_text())["budget_s"] == 600  # never past 10 minutes


def test_the_gpu_steps_run_end_to_end_on_the_stand_in_and_fill_the_report(tmp_path):
    """Every step after the launch, through the SGLang backend on the stand-in: the code that otherwise runs only on
    a GPU, its checks and figures written to the report. Plain decoding is the stand-in's target, token by token."""
    from argparse import Namespace

    from serving.sglang_swap import WeightSession
    from tests.serving.sglang_standin import WordTokenizer

    mod = load_script()
    host, backend, client = standin_replica(tmp_path)
    registry = backend.registry
    prompts = [[5 + i, 6, 7] for i in range(4)]
    s = mod.Setup(WordTokenizer(), prompts, registry, "v1", mod.rolled_copy(registry, "v1"), backend.cfg)
    plain = []
    for p in prompts:
        out = []
        for _ in range(10):
            out.append(host.server.next_token(p + out))
        plain.append(out)
    args = Namespace(max_new=10, concurrency=16, concurrent_timeout=60.0)
    report = mod.Report(tmp_path / "sglang_check.json")
    session = WeightSession(client)
    base = mod.step_greedy(backend, client, s, plain, args, report)
    mod.step_concurrent(backend, s, args, report)
    seen = mod.step_swap(backend, client, session, s, plain, base, args, report)
    mod.step_swaps_in_a_row(backend, client, session, s, plain, seen, args, report)
    saved = json.loads((tmp_path / "sglang_check.json").read_text())
    must = ("greedy_equal", "metrics_consistent", "concurrent_all_finished", "concurrent_equal_sequential",
            "swap_in_place", "target_unchanged", "draft_changed", "draft_restored", "lossless_after_swap",
            "accept_restored", "labels_after_swaps", "three_swaps_in_a_row", "alive_after_three_swaps")
    assert {k: saved["checks"][k] for k in must} == dict.fromkeys(must, True), saved
    assert saved["figures"]["concurrency"] == 16 and saved["figures"]["concurrent_hung"] == 0
