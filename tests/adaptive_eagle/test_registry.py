"""Head registry: immutable versions with lineage, the champion compare-and-set (raced by threads and
processes), pin and block rules, corrupt control files refused, and reads that create nothing."""

import hashlib
import json
import multiprocessing
import threading
from pathlib import Path

import pytest
import torch

from adaptive_eagle.checkpoint import HeadMeta, HeadValidationError, save_head
from adaptive_eagle.draft_head import DraftHeadConfig, Eagle3DraftHead, init_weights
from adaptive_eagle.registry import (
    BLOCKED_FILE,
    CHAMPION_FILE,
    LOCK_FILE,
    PINNED_FILE,
    PLAIN,
    HeadRegistry,
    RegistryError,
    RegistryLockedError,
)
from adaptive_eagle.targets import tiny_target

DRAFT_VOCAB = 40
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target():
    return tiny_target(num_layers=8)


def make_head(target, seed=0) -> Eagle3DraftHead:
    torch.manual_seed(seed)
    cfg = DraftHeadConfig.from_target(target.config, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=target.aux_layer_ids)
    head = Eagle3DraftHead(cfg)
    init_weights(head)
    head.set_draft_vocab(torch.randperm(cfg.vocab_size)[:DRAFT_VOCAB].sort().values)
    return head


def meta(target, version, parent=None, **kw) -> HeadMeta:
    return HeadMeta.new(version, target.name, target.fingerprint, parent=parent, **kw)


@pytest.fixture
def reg(tmp_path, target) -> HeadRegistry:
    """A registry holding v1 <- v2 <- v3 (parent chain) and a root w1, fp32 so loads are bit-exact."""
    r = HeadRegistry.create(tmp_path / "registry", lock_timeout_s=5.0)
    for i, (name, parent) in enumerate([("v1", None), ("v2", "v1"), ("v3", "v2"), ("w1", None)]):
        m = meta(target, name, parent, data={"window": [f"2026-01-0{i + 1}T00:00Z", f"2026-01-0{i + 2}T00:00Z"]},
                 metrics={"accept_length": 1.4 + 0.01 * i})
        r.register(make_head(target, seed=i), m, dtype=torch.float32)
    return r


def snapshot(root: Path) -> dict:
    """Every path under root with its bytes' digest and mtime (directories: mtime only)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[str(p.relative_to(root))] = (digest, st.st_mtime_ns)
    out["."] = ("dir", root.stat().st_mtime_ns)
    return out


# ---- roots ------------------------------------------------------------------------------------
def test_a_missing_root_is_an_error_naming_it_and_is_not_created(tmp_path):
    missing = tmp_path / "no" / "registry"
    with pytest.raises(RegistryError, match="does not exist.*create") as e:
        HeadRegistry(missing)
    assert str(missing) in str(e.value) and not (tmp_path / "no").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(RegistryError, match="not a directory"):
        HeadRegistry(tmp_path / "file")


def test_create_starts_at_plain_decoding_and_is_safe_to_rerun(tmp_path, target):
    r = HeadRegistry.create(tmp_path / "a" / "b")
    p = r.champion_pointer()
    assert r.champion() == PLAIN and p.plain and p.previous is None and p.generation == 0
    assert r.pinned() is None and r.blocked() == {} and r.versions() == []
    r.register(make_head(target), meta(target, "v1"), dtype=torch.float32)
    assert r.set_champion("v1", expect=PLAIN).ok
    again = HeadRegistry.create(tmp_path / "a" / "b")
    assert again.champion() == "v1" and [v.version for v in again.versions()] == ["v1"]
    assert not (r.root / LOCK_FILE).exists()


def test_an_uninitialised_directory_lists_versions_but_refuses_champion_reads(tmp_path, target):
    save_head(make_head(target), tmp_path / "v1", meta(target, "v1"), dtype=torch.float32)
    before = snapshot(tmp_path)
    r = HeadRegistry(tmp_path)
    assert [v.version for v in r.versions()] == ["v1"]
    for read in (r.champion, r.pinned, r.blocked):
        with pytest.raises(RegistryError, match="missing: not an initialised registry"):
            read()
    assert snapshot(tmp_path) == before


def test_the_shipped_heads_directory_reads_as_a_registry():
    r = HeadRegistry(REPO / "heads")
    names = [v.version for v in r.versions()]
    assert {"smollm2-135m-english-v1", "smollm2-135m-english-v2"} <= set(names)
    assert r.lineage("smollm2-135m-english-v2") == ["smollm2-135m-english-v2", "smollm2-135m-english-v1"]


# ---- versions ---------------------------------------------------------------------------------
def test_versions_list_with_lineage_window_and_metrics(reg):
    (reg.root / ".v9.tmp-abc").mkdir()  # a writer's staging directory is not a version
    vs = reg.versions()
    assert [v.version for v in vs] == ["v1", "v2", "v3", "w1"]
    v2 = reg.version("v2")
    assert v2.parent == "v1" and v2.window == ["2026-01-02T00:00Z", "2026-01-03T00:00Z"]
    assert v2.metrics == {"accept_length": pytest.approx(1.41)} and v2.path == reg.root / "v2"
    assert len(v2.sha256) == 64
    assert reg.lineage("v3") == ["v3", "v2", "v1"] and reg.lineage("w1") == ["w1"]
    assert "v2" in reg and "v9" not in reg and PLAIN not in reg and "../v1" not in reg
    assert reg.get("v3") == reg.root / "v3"


def test_versions_are_immutable(reg, target):
    before = snapshot(reg.root / "v1")
    with pytest.raises(RegistryError, match="immutable"):
        reg.register(make_head(target, seed=9), meta(target, "v1"), dtype=torch.float32)
    with pytest.raises(RegistryError, match="immutable"):
        reg.add(reg.root / "v1")
    assert snapshot(reg.root / "v1") == before
    for bad in (PLAIN, "../escape", ".hidden", "champion.json", "a/b", ""):
        with pytest.raises(RegistryError, match="not a valid version name"):
            reg.register(make_head(target), meta(target, bad))
    assert not (reg.root.parent / "escape").exists()


def test_add_imports_a_validated_version_directory(reg, target, tmp_path):
    src = tmp_path / "elsewhere" / "x1"
    save_head(make_head(target, seed=7), src, meta(target, "x1", parent="v3"), dtype=torch.float32)
    assert reg.add(src) == "x1" and reg.lineage("x1") == ["x1", "v3", "v2", "v1"]
    torch.testing.assert_close(reg.load("x1").head.fc.weight, make_head(target, seed=7).fc.weight, rtol=0, atol=0)
    bad = tmp_path / "elsewhere" / "x2"
    save_head(make_head(target, seed=8), bad, meta(target, "x2"), dtype=torch.float32)
    with open(bad / "model.safetensors", "r+b") as f:  # flip a byte: the checksum no longer matches
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(HeadValidationError, match="sha256 mismatch"):
        reg.add(bad)
    assert "x2" not in reg and not any(p.name.startswith(".x2") for p in reg.root.iterdir())


def test_load_validates_and_refuses_a_checksum_mismatch(reg, target):
    loaded = reg.load("v2", target)
    assert loaded.meta.version == "v2" and loaded.meta.parent == "v1"
    torch.testing.assert_close(loaded.head.fc.weight, make_head(target, seed=1).fc.weight, rtol=0, atol=0)
    weights = reg.root / "v2" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(HeadValidationError, match="sha256 mismatch"):
        reg.load("v2", target)
    with pytest.raises(RegistryError, match="no such version"):
        reg.load("v9")
    with pytest.raises(RegistryError, match="plain decoding"):
        reg.get(PLAIN)


def test_a_head_json_naming_another_version_is_refused(reg):
    head_json = reg.root / "w1" / "head.json"
    head_json.write_text(head_json.read_text().replace('"w1"', '"v1"'))
    with pytest.raises(RegistryError, match="names version 'v1', but lies in directory 'w1'"):
        reg.version("w1")
    with pytest.raises(RegistryError, match="names version"):
        reg.load("w1", verify_checksum=False)


# ---- champion -----------------------------------------------------------------------------------
def test_champion_compare_and_set(reg):
    change = reg.set_champion("v1", expect=PLAIN, reason="first head")
    assert change.ok and change.champion.version == "v1"
    p = reg.champion_pointer()
    assert (p.version, p.previous, p.reason, p.generation) == ("v1", PLAIN, "first head", 1) and not p.plain
    stale = reg.set_champion("v2", expect=PLAIN)
    assert not stale.ok and "stale expect" in stale.message and "'v1'" in stale.message
    assert stale.champion == p and reg.champion() == "v1"
    assert reg.set_champion("v1", expect="v1").ok and reg.champion_pointer().generation == 1  # no-op
    back = reg.set_champion(PLAIN, expect="v1", reason="rollback")
    assert back.ok and reg.champion() == PLAIN and reg.champion_pointer().previous == "v1"
    with pytest.raises(RegistryError, match="'v9' is not a version"):
        reg.set_champion("v9", expect=PLAIN)
    pointer = json.loads((reg.root / CHAMPION_FILE).read_text())
    assert set(pointer) == {"format_version", "version", "previous", "set_at", "reason", "generation"}


def test_cas_race_between_threads_has_exactly_one_winner_per_round(reg):
    versions, rounds = ["v1", "v2", "v3", "w1"], 5
    for _ in range(rounds):
        expect = reg.champion()
        racers = [v for v in versions if v != expect]  # each wants to replace the champion it read
        barrier, results = threading.Barrier(len(racers)), {}

        def race(name):
            barrier.wait()
            results[name] = reg.set_champion(name, expect=expect)

        threads = [threading.Thread(target=race, args=(n,)) for n in racers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [n for n, r in results.items() if r.ok]
        assert len(winners) == 1, results
        assert all("stale expect" in r.message and r.champion.version == winners[0]
                   for n, r in results.items() if n not in winners)
        assert reg.champion() == winners[0] and reg.champion_pointer().previous == expect
    assert reg.champion_pointer().generation == rounds
    assert not (reg.root / LOCK_FILE).exists()


def _race_in_process(root, name, barrier, queue):
    barrier.wait()
    change = HeadRegistry(root).set_champion(name, expect=PLAIN)
    queue.put((name, change.ok, change.message))


def test_cas_race_between_processes_has_exactly_one_winner(reg):
    ctx = multiprocessing.get_context("fork")
    racers = ["v1", "v2", "v3", "w1"]
    barrier, queue = ctx.Barrier(len(racers)), ctx.Queue()
    procs = [ctx.Process(target=_race_in_process, args=(str(reg.root), n, barrier, queue)) for n in racers]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in racers]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    winners = [name for name, ok, _ in results if ok]
    assert len(winners) == 1, results
    assert all("stale expect" in msg for _, ok, msg in results if not ok)
    assert reg.champion() == winners[0] and reg.champion_pointer().generation == 1


def test_a_lock_left_by_a_dead_writer_is_named_and_broken_only_on_request(reg):
    (reg.root / LOCK_FILE).write_text(json.dumps({"token": "t", "pid": 4242, "host": "h1", "since": "then"}))
    slow = HeadRegistry(reg.root, lock_timeout_s=0.05)
    with pytest.raises(RegistryLockedError, match="pid 4242 on h1.*break_lock"):
        slow.set_champion("v1", expect=PLAIN)
    assert reg.champion() == PLAIN  # reads take no lock
    assert slow.break_lock() == "pid 4242 on h1 since then" and slow.break_lock() is None
    assert slow.set_champion("v1", expect=PLAIN).ok


# ---- pin and block ------------------------------------------------------------------------------
def test_pinned_allows_only_the_pinned_version(reg):
    assert reg.set_champion("v1", expect=PLAIN).ok
    pin = reg.pin("v2", reason="on-call: hold v2 over the weekend")
    assert reg.pinned() == pin and pin.version == "v2"
    refused = reg.set_champion("v3", expect="v1")
    assert not refused.ok and "'v2' is pinned (on-call: hold v2 over the weekend)" in refused.message
    assert not reg.set_champion(PLAIN, expect="v1").ok
    assert reg.set_champion("v2", expect="v1").ok
    with pytest.raises(RegistryError, match="'v2' is already pinned"):
        reg.pin("v3")
    with pytest.raises(RegistryError, match="'v2' is pinned; unpin it first"):
        reg.block("v2", "regressed")
    assert reg.unpin() == pin and reg.pinned() is None and reg.unpin() is None
    assert reg.set_champion("v3", expect="v2").ok
    reg.pin(PLAIN, reason="speculation off")
    assert not reg.set_champion("v1", expect="v3").ok and reg.set_champion(PLAIN, expect="v3").ok


def test_blocked_versions_never_become_champion(reg):
    block = reg.block("v2", "code accept length -4% on canary")
    assert reg.blocked() == {"v2": block}
    refused = reg.set_champion("v2", expect=PLAIN)
    assert not refused.ok and "'v2' is blocked: code accept length -4% on canary" in refused.message
    with pytest.raises(RegistryError, match="blocked"):
        reg.pin("v2")
    with pytest.raises(RegistryError, match="cannot be blocked"):
        reg.block(PLAIN, "no")
    with pytest.raises(RegistryError, match="needs a reason"):
        reg.block("v3", "")
    with pytest.raises(RegistryError, match="not a version"):
        reg.block("v9", "typo")
    reg.block("v3", "second")
    assert set(reg.blocked()) == {"v2", "v3"}
    assert reg.unblock("v2") == block and reg.unblock("v2") is None and set(reg.blocked()) == {"v3"}
    assert reg.set_champion("v2", expect=PLAIN).ok
    assert reg.block("v2", "regressed after promotion").version == "v2"  # blocking the champion is allowed
    assert reg.champion() == "v2" and not reg.set_champion("v2", expect="v2").ok


# ---- corrupt control files ------------------------------------------------------------------------
CORRUPT = {
    "champion-malformed": (CHAMPION_FILE, "{not json", "malformed JSON"),
    "champion-empty": (CHAMPION_FILE, "", "malformed JSON"),
    "champion-missing-field": (CHAMPION_FILE, json.dumps({"format_version": 1, "version": "v1"}), "previous"),
    "champion-extra-field": (CHAMPION_FILE, json.dumps({"format_version": 1, "version": "v1", "previous": None,
                                                        "set_at": "t", "reason": "", "generation": 1, "x": 1}), "x"),
    "champion-unknown-version": (CHAMPION_FILE, json.dumps({"format_version": 1, "version": "gone", "previous": None,
                                                            "set_at": "t", "reason": "", "generation": 1}),
                                 "'gone' is not a version"),
    "champion-newer-format": (CHAMPION_FILE, json.dumps({"format_version": 99, "version": "v1", "previous": None,
                                                         "set_at": "t", "reason": "", "generation": 1}),
                              "format_version"),
    "pinned-malformed": (PINNED_FILE, "[]", "refusing to treat it as empty"),
    "pinned-unknown": (PINNED_FILE, json.dumps({"format_version": 1, "pinned": {"version": "gone", "reason": "",
                                                                                "pinned_at": "t"}}), "'gone'"),
    "blocked-malformed": (BLOCKED_FILE, "nul\x00l", "malformed JSON"),
    "blocked-plain": (BLOCKED_FILE, json.dumps({"format_version": 1, "blocked": {PLAIN: {"reason": "r",
                                                                                         "blocked_at": "t"}}}),
                      "plain decoding cannot be blocked"),
    "blocked-no-reason": (BLOCKED_FILE, json.dumps({"format_version": 1, "blocked": {"v1": {"reason": "",
                                                                                            "blocked_at": "t"}}}),
                          "reason"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_a_corrupt_control_file_is_refused_with_its_reason_and_left_alone(reg, case):
    name, text, reason = CORRUPT[case]
    (reg.root / name).write_text(text)
    read = {CHAMPION_FILE: reg.champion, PINNED_FILE: reg.pinned, BLOCKED_FILE: reg.blocked}[name]
    with pytest.raises(RegistryError, match=reason) as e:
        read()
    assert name in str(e.value)
    with pytest.raises(RegistryError):  # a writer refuses too, and overwrites nothing
        reg.set_champion("v1", expect=PLAIN)
    assert (reg.root / name).read_text() == text and not (reg.root / LOCK_FILE).exists()


def test_a_missing_control_file_is_refused_not_read_as_empty(reg):
    reg.set_champion("v1", expect=PLAIN)
    (reg.root / BLOCKED_FILE).unlink()
    with pytest.raises(RegistryError, match="blocked.json: missing"):
        reg.blocked()
    with pytest.raises(RegistryError, match="blocked.json: missing"):
        reg.set_champion("v2", expect="v1")
    assert reg.champion() == "v1"


# ---- reads create nothing -------------------------------------------------------------------------
def test_read_only_calls_create_nothing(reg, target):
    reg.set_champion("v2", expect=PLAIN)
    reg.pin("v2")
    reg.block("w1", "bad")
    before = snapshot(reg.root)
    r = HeadRegistry(reg.root)
    r.versions(), r.version("v3"), r.lineage("v3"), r.get("v1"), "v1" in r, "zz" in r
    r.load("v1", target), r.load("v2")
    r.champion(), r.champion_pointer(), r.pinned(), r.blocked()
    for bad in (lambda: r.get("zz"), lambda: r.load("zz"), lambda: r.version(PLAIN)):
        with pytest.raises(RegistryError):
            bad()
    assert snapshot(reg.root) == before
