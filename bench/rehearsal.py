"""Production rehearsal: the stack of ops/prod.yaml on this machine, under drifting traffic and a fault schedule.

What runs (all real processes): a redis-server with only a TLS port on loopback (a private CA, the server's host
name checked, AUTH, production's append-only file with appendfsync everysec: bench/chaos.py), Ray started here
with the stack's replica and trainer actors, reference replicas in place of SGLang with SGLang's tree from
ops/prod.yaml (depth 5, top-k 4, 16 draft tokens), the gateway with its API key and admin token, the near-line
trainer, the policy, and a Prometheus server scraping the gateway every second with ops/alerts.yml. Traffic:
concurrent official `openai` clients send ShareGPT English prompts, then drift to code.

The config is ops/prod.yaml with only host-specific settings replaced (paths, ports, the target's location, Ray
resources, GPUs, the SGLang backend) and every count the loop waits for scaled by one declared factor, `--scale`
(a 2-core CPU serves a tiny fraction of a GPU fleet's requests): the policy's sample minimums, the candidate
cadence and, inversely, the capture fraction. Both lists are printed at the start and kept in the summary.
Alert `for:` durations are scaled by the same factor (a 30 s fault would never outlast a 2-minute `for:`).

Fault schedule, while the traffic runs (times are shares of the traffic time, printed):
    redis_restart        redis-server SIGTERMed, down a few seconds, started again on its files
    redis_sigkill        redis-server SIGKILLed mid-write (no shutdown, no last fsync) under the persistence
                         production runs (ops/scripts/node.sh: appendonly, appendfsync everysec), down 20 s,
                         started again on its files: acknowledged entries may be lost only within what everysec
                         promises (the last 2 s before the kill), and every loss is counted
    redis_refuses_writes OOM (maxmemory below use, noeviction), then READONLY (a replica of a dead master),
                         `--refuse-s` in all; then writes are accepted again
    trainer_step_fault   the trainer's next step raises (TrainerActor.inject_fault); its process ends, Ray restarts it
    trainer_sigkill      the trainer's process is SIGKILLed; Ray restarts it
    replica_kill         one replica actor is killed (ray.kill, restart allowed); its in-flight requests fail cleanly

The last line is one JSON object: failed_requests (outside the killed replica's in-flight requests),
hung_requests, candidates_written, promotions, stale_gate_decisions, acked_records_lost, capture_dropped,
capture_resumed_s, trainer_recovered_s, time_to_first_candidate_s, time_to_promotion_s (from the drift's
onset), alerts_fired, and per fault its alert and whether it fired (`faults`). --out keeps timeline.jsonl,
summary.json and the promotion log.

    .venv/bin/python bench/rehearsal.py --quick           # about 21 minutes on 2 cores
    .venv/bin/python bench/rehearsal.py --minutes 60      # the full run (docs/results/rehearsal-*)

Needs redis-server (`make redis-server`) and Prometheus (`make prometheus`). Never run it next to another job
that holds the cores: the gates and timings would measure that job.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from adaptive_eagle.compute import machine_key  # noqa: E402
from adaptive_eagle.evidence import EvidenceError, ReplayEvidence  # noqa: E402
from loop.metrics import trainer_state_class  # noqa: E402

from bench.chaos import EVERYSEC_LOSS_S, Prometheus, RedisTLS  # noqa: E402

SCALED_POLICY = ("min_samples", "min_domain_samples", "canary_min_requests", "canary_health_requests",
                 "canary_max_requests", "offline_max_samples", "rollback_window", "collapse_min_requests")
POLICY_FLOORS = {"min_samples": 20, "min_domain_samples": 5, "canary_min_requests": 20, "canary_health_requests": 5,
                 "canary_max_requests": 20, "offline_max_samples": 20, "rollback_window": 20,
                 "collapse_min_requests": 5}  # policies/config.py's lower bounds
SCALED_TRAINER = ("candidate_every_tokens", "candidate_every_minutes", "min_candidate_tokens")
TREE = {"depth": 5, "topk": 4, "num_draft_tokens": 16}  # filled from prod.yaml's sglang section
# the serving tree without model-free drafting or cost-aware pruning: acceptance replay of a captured greedy
# request is then exact, as it is for SGLang's EAGLE-3 tree
ENGINE_EXTRAS = {"cost_aware": False, "prompt_lookup": False, "suffix_drafting": False, "calibration_dir": ""}
EXPECTED_ALERT = {"redis_restart": "CaptureStoreDown", "redis_sigkill": "CaptureStoreDown",
                  "redis_refuses_writes": "CaptureStoreRefusing",
                  "trainer_step_fault": "TrainerRestarted", "trainer_sigkill": "TrainerRestarted",
                  "replica_kill": "ReplicaRestarted"}
DRIFT = ("english", "code")


# ---- the config ----------------------------------------------------------------------------------------
def rehearsal_config(prod: Path, scale: float, state: Path, redis: RedisTLS, env: dict) -> tuple[dict, list, list]:
    """prod.yaml as a dict (its ${VARS} from `env`), host-specific settings replaced, counts scaled by `scale`.
    Returns (config dict, replaced lines, scaled lines)."""
    from adaptive_eagle.cli import SHIPPED_HEAD
    from loop.config import expand_env

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        data = expand_env(yaml.safe_load(prod.read_text()), str(prod))
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    replaced: list[str] = []

    def put(section: dict, key: str, value, why: str, where: str) -> None:
        replaced.append(f"{where}.{key}: {section.get(key)!r} -> {value!r} ({why})")
        section[key] = value

    put(data, "state_dir", str(state), "this machine's disk", "")
    ray = data.setdefault("ray", {})
    put(ray, "address", None, "Ray started here, not a cluster", "ray")
    put(ray, "num_cpus", os.cpu_count() or 2, "this machine's cores", "ray")
    put(ray, "dashboard", False, "no dashboard port on a rehearsal", "ray")
    put(ray, "replica_num_cpus", 0, f"{os.cpu_count()} cores shared by replicas, trainer and gateway", "ray")
    put(ray, "replica_num_gpus", 0, "no GPU here", "ray")
    put(ray, "replica_resources", {}, "no custom resources on a one-node Ray", "ray")
    reg = data.setdefault("registry", {})
    put(reg, "path", None, "<state_dir>/registry", "registry")
    put(reg, "seed_head", str(SHIPPED_HEAD), "the shipped head on this disk", "registry")
    srv = data.setdefault("serving", {})
    put(srv, "host", "127.0.0.1", "loopback", "serving")
    put(srv, "port", 0, "any free port", "serving")
    put(srv, "target", "smollm2-135m", "the packaged SmolLM2-135M-Instruct (the seed head's target)", "serving")
    put(srv, "backend", "reference", "SGLang needs a GPU", "serving")
    sg = srv.pop("sglang", None) or {}
    engine = {"depth": sg.get("num_steps", TREE["depth"]), "topk": sg.get("eagle_topk", TREE["topk"]),
              "num_draft_tokens": sg.get("num_draft_tokens", TREE["num_draft_tokens"]), **ENGINE_EXTRAS}
    put(srv, "engine", engine, "SGLang's tree from serving.sglang, exact replay", "serving")
    st = data.setdefault("store", {})
    put(st, "redis_url", redis.url, "the TLS redis-server on loopback", "store")
    st["redis_password"] = redis.password  # ${AE_REDIS_PASSWORD}, set to the rehearsal server's
    put(st, "tls_ca_file", redis.ca_file, "its CA", "store")
    put(st, "spill_dir", str(state / "spill"), "this machine's disk", "store")
    tr = data.setdefault("trainer", {})
    put(tr, "num_cpus", 0, "shares the cores", "trainer")
    put(tr, "num_gpus", 0, "no GPU here", "trainer")
    put(tr, "resources", {}, "no custom resources on a one-node Ray", "trainer")
    put(tr, "device", "cpu", "no GPU here", "trainer")
    put(tr, "yield_queue_depth", 1, "the trainer shares the replicas' cores (prod: a GPU of its own)", "trainer")

    scaled: list[str] = []
    from policies.config import PolicyConfig
    from trainer.config import NearlineConfig

    pol = data.setdefault("policy", {})
    for key in SCALED_POLICY:
        base = pol.get(key, PolicyConfig.model_fields[key].default)
        value = max(POLICY_FLOORS[key], math.ceil(base * scale))
        scaled.append(f"policy.{key}: {base} -> {value}" + (" (the config's floor)" if value > base * scale else ""))
        pol[key] = value
    for key in SCALED_TRAINER:
        base = tr.get(key, NearlineConfig.model_fields[key].default)
        value = base * scale if key.endswith("minutes") else max(1, math.ceil(base * scale))
        scaled.append(f"trainer.{key}: {base} -> {value}")
        tr[key] = value
    cap = srv.setdefault("capture", {})
    base = cap.get("fraction", 1.0)
    cap["fraction"] = min(1.0, base / scale)
    scaled.append(f"serving.capture.fraction: {base} -> {cap['fraction']:g} (inverse: fewer requests, more captured)")
    return data, replaced, scaled


# ---- observation ---------------------------------------------------------------------------------------
@dataclass
class Timeline:
    t0: float  # unix seconds: the traffic's start
    path: Optional[Path] = None
    events: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, what: str, **extra) -> None:
        e = {"t_s": round(time.time() - self.t0, 1), "kind": kind, "what": what, **extra}
        with self.lock:
            self.events.append(e)
            if self.path is not None:
                with open(self.path, "a") as f:
                    f.write(json.dumps(e, default=str) + "\n")
        print(f"[{e['t_s']:7.1f}s] {kind:<10} {what}", flush=True)


def scrape(url: str) -> dict:
    """The gateway's /metrics as {name{labels}: value} (labels sorted)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url, timeout=30).text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class CaptureCounter:
    """Totals of per-replica counters across replica restarts (a restarted replica counts from 0 again)."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.total: dict[str, float] = {}

    def update(self, name: str, metrics: dict) -> float:
        for key, value in metrics.items():
            if not key.startswith(name + "{"):
                continue
            prev = self.last.get(key, 0.0)
            self.total[key] = self.total.get(key, 0.0) + (value - prev if value >= prev else value)
            self.last[key] = value
        return sum(v for k, v in self.total.items() if k.startswith(name + "{"))


class Watcher:
    """Polls the stack every second: candidates, promotion log events, the trainer's process and steps, capture
    counters; writes what changed into the timeline."""

    def __init__(self, stack, timeline: Timeline, metrics_url: str) -> None:
        self.stack, self.tl, self.metrics_url = stack, timeline, metrics_url
        self.candidates: dict[str, float] = {}  # version -> unix seconds seen
        self.events: list = []  # promotion log events seen
        self.trainer: Optional[dict] = None
        self.trainer_seen: list[tuple[float, Optional[dict]]] = []  # (time, status or None)
        self.written = self.dropped = 0.0
        self.written_at: list[tuple[float, float]] = []  # (time, total written)
        self.counters = CaptureCounter()
        self.errors: dict[str, int] = {}  # part -> failed polls (a fault makes some; the summary shows them)
        self.last_errors: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rehearsal-watch", daemon=True)
        self._seen_lines = 0

    def start(self) -> "Watcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for part, poll in (("trainer", self._trainer), ("registry", self._registry), ("log", self._log),
                               ("metrics", self._metrics)):
                try:
                    poll()
                except Exception as e:  # noqa: BLE001 - a part that does not answer is what faults do
                    self.errors[part] = self.errors.get(part, 0) + 1
                    self.last_errors[part] = f"{type(e).__name__}: {e}"[:300]
                    if part == "trainer":
                        self._trainer_status(None)

    def _trainer(self) -> None:
        import ray

        self._trainer_status(ray.get(self.stack.trainer.status.remote(), timeout=5))

    def _trainer_status(self, status: Optional[dict]) -> None:
        before = self.trainer
        self.trainer_seen.append((time.time(), status))
        if status is None and before is not None:
            self.tl.add("trainer", "does not answer (its process ended; Ray restarts it)")
        elif status is not None and (before is None or before.get("pid") != status.get("pid")):
            self.tl.add("trainer", f"answers from pid {status.get('pid')}: {status.get('state')}")
        elif status is not None and before is not None:
            state, was = trainer_state_class(status.get("state")), trainer_state_class(before.get("state"))
            if state != was and {state, was} != {"training", "waiting"}:  # not the flip between steps
                self.tl.add("trainer", f"{was} -> {status.get('state')}")
            if status.get("last_step_at") and not before.get("last_step_at"):  # per process (steps are resumed)
                self.tl.add("trainer", f"first step of pid {status.get('pid')} ({status.get('records_seen')} "
                                       f"records seen, loss {status.get('loss')})")
        self.trainer = status

    def _registry(self) -> None:
        for v in self.stack.registry.versions():
            if (v.training or {}).get("trainer") == "nearline" and v.version not in self.candidates:
                self.candidates[v.version] = time.time()
                self.tl.add("candidate", f"{v.version} written by the trainer")

    def _log(self) -> None:
        from policies.log import PromotionLog

        events = PromotionLog(self.stack.config.promotion_log).read().events
        for e in events[self._seen_lines:]:
            self.events.append(e)
            self.tl.add("policy", f"{e.event} {e.candidate or ''} (champion {e.champion}): {e.reason[:160]}")
        self._seen_lines = len(events)

    def _metrics(self) -> None:
        m = scrape(self.metrics_url)
        self.written = self.counters.update("ae_capture_written", m)
        self.dropped = self.counters.update("ae_capture_dropped", m)
        self.written_at.append((time.time(), self.written))

    # ---- derived figures ---------------------------------------------------------------------------
    def written_after(self, t: float, deadline_s: float) -> Optional[float]:
        """Seconds from t until the store acknowledged a new record (None: not within deadline_s)."""
        base = next((w for ts, w in reversed(self.written_at) if ts <= t), 0.0)
        return next((ts - t for ts, w in self.written_at if t < ts <= t + deadline_s and w > base), None)

    def trainer_recovered(self, t: float, pid: Optional[int]) -> Optional[float]:
        """Seconds from the fault taking effect (after t: process `pid` answered in error or not at all, or another
        process answered) until a trainer process other than `pid` answered healthy and had stepped. An injected
        step fault takes effect at the next step, which may come a while after t (a candidate evaluation)."""
        down = next((ts for ts, s in self.trainer_seen if ts > t and (
            s is None or s.get("pid") != pid or trainer_state_class(s.get("state")) == "error")), None)
        if down is None:
            return None
        for ts, s in self.trainer_seen:
            if ts > down and s is not None and s.get("pid") != pid and s.get("last_step_at") and \
                    trainer_state_class(s.get("state")) in ("training", "waiting", "evaluating"):
                return ts - down
        return None


# ---- faults --------------------------------------------------------------------------------------------
@dataclass
class FaultRun:
    name: str
    at_s: float  # planned, seconds after the traffic's start
    started: Optional[float] = None  # unix seconds
    cleared: Optional[float] = None  # the fault's end (writes accepted, Redis answering, process killed)
    lost: int = 0  # acknowledged stream entries missing afterwards
    lost_beyond_promise: int = 0  # of them, entries the store's persistence promised to keep
    detail: str = ""
    pid: Optional[int] = None


class Faults:
    def __init__(self, stack, redis: RedisTLS, stream_key: str, tl: Timeline, refuse_s: float) -> None:
        self.stack, self.redis, self.key, self.tl, self.refuse_s = stack, redis, stream_key, tl, refuse_s
        self.killed_replica: Optional[str] = None

    def run(self, f: FaultRun) -> None:
        f.started = time.time()
        getattr(self, f.name)(f)
        self.tl.add("fault", f"{f.name} done: {f.detail}")

    def _ids(self) -> set:
        return self.redis.stream_ids(self.key)

    def redis_restart(self, f: FaultRun) -> None:
        before = self._ids()
        self.tl.add("fault", f"redis_restart: SIGTERM to redis-server ({len(before)} entries in {self.key})")
        self.redis.restart(down_s=10.0)
        f.cleared = time.time()
        f.lost = len(before - self._ids())
        f.detail = f"down 10 s, answering again; {f.lost} of {len(before)} acknowledged entries missing"

    def redis_sigkill(self, f: FaultRun) -> None:
        """SIGKILL while the capture writes: entries read back just before the kill were acknowledged; those
        missing after the restart are counted, and any older than EVERYSEC_LOSS_S before the kill is a loss the
        persistence did not promise (with appendfsync always, any loss is)."""
        before = self._ids()
        killed_ms = int(time.time() * 1000)
        self.tl.add("fault", f"redis_sigkill: SIGKILL to redis-server ({len(before)} entries in {self.key}, "
                             f"appendfsync {self.redis.appendfsync})")
        # down 20 s: the writers notice an outage only at their next write, and CaptureStoreDown needs its
        # scaled `for:` across two scrapes after that (a 10 s outage went unalerted in a quick run)
        self.redis.restart(down_s=20.0, kill=True)
        f.cleared = time.time()
        missing = before - self._ids()
        window_ms = 1000 * EVERYSEC_LOSS_S if self.redis.appendfsync == "everysec" else 0
        f.lost = len(missing)
        f.lost_beyond_promise = sum(killed_ms - int(i.split("-")[0]) > window_ms for i in missing)
        f.detail = (f"down 20 s, answering again; {f.lost} of {len(before)} acknowledged entries missing, "
                    f"{f.lost_beyond_promise} of them older than the {window_ms / 1000:g} s appendfsync "
                    f"{self.redis.appendfsync} may lose")

    def redis_refuses_writes(self, f: FaultRun) -> None:
        before = self._ids()
        half = self.refuse_s / 2
        self.tl.add("fault", f"redis_refuses_writes: OOM for {half:g} s")
        self.redis.refuse_writes("oom")
        time.sleep(half)
        self.tl.add("fault", f"redis_refuses_writes: READONLY for {half:g} s")
        self.redis.refuse_writes("readonly")
        time.sleep(half)
        self.redis.accept_writes()
        f.cleared = time.time()
        f.lost = len(before - self._ids())
        f.detail = f"writes accepted again after {self.refuse_s:g} s; {f.lost} of {len(before)} entries missing"

    def trainer_step_fault(self, f: FaultRun) -> None:
        import ray

        f.pid = ray.get(self.stack.trainer.status.remote(), timeout=30).get("pid")
        ray.get(self.stack.trainer.inject_fault.remote("rehearsal: a fault injected into a trainer step"), timeout=30)
        f.cleared = time.time()
        f.detail = f"the next step of pid {f.pid} raises"

    def trainer_sigkill(self, f: FaultRun) -> None:
        import ray

        f.pid = ray.get(self.stack.trainer.status.remote(), timeout=60).get("pid")
        os.kill(int(f.pid), signal.SIGKILL)
        f.cleared = time.time()
        f.detail = f"SIGKILL to pid {f.pid}"

    def replica_kill(self, f: FaultRun) -> None:
        import ray

        replica = self.stack.replicas[-1]
        self.killed_replica = replica.name
        ray.kill(replica.handle, no_restart=False)
        f.cleared = time.time()
        f.detail = f"ray.kill({replica.name}), restart allowed"


# ---- the run -------------------------------------------------------------------------------------------
def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="20 minutes of traffic (about 21 in all): the checks "
                   "but promotions >= 1")
    p.add_argument("--minutes", type=float, default=None, help="minutes of traffic (default 20 quick, 50 full)")
    p.add_argument("--scale", type=float, default=0.05, help="the one factor on every count the loop waits for "
                   "(default 0.05: 400-sample minimums become 20)")
    p.add_argument("--clients", type=int, default=3, help="concurrent openai clients (default 3)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens a request (default 64)")
    p.add_argument("--refuse-s", type=float, default=30.0, help="seconds Redis refuses writes (OOM then READONLY)")
    p.add_argument("--prod", default=str(REPO / "ops" / "prod.yaml"), help="the production config")
    p.add_argument("--out", default=None, help="keep timeline.jsonl, summary.json and the promotion log here")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not 0 < a.scale <= 1:
        p.error(f"--scale must be in (0, 1], got {a.scale}")
    minutes = a.minutes or (20.0 if a.quick else 50.0)
    if not 4 <= minutes <= 600:
        p.error(f"--minutes must be in [4, 600], got {minutes}")
    return rehearse(a, minutes * 60.0)


def rehearse(a, traffic_s: float) -> int:
    import ray

    from adaptive_eagle_cli.demo.config import Phase
    from adaptive_eagle_cli.demo.traffic import PromptCycle, Traffic, sharegpt_pools
    from loop.stack import LocalStack
    from loop.config import parse_stack_config

    out = Path(a.out).expanduser() if a.out else None
    work = Path(tempfile.mkdtemp(prefix="ae-rehearsal-"))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for name in ("timeline.jsonl", "summary.json"):
            (out / name).unlink(missing_ok=True)
    secrets_env = {"AE_ADMIN_TOKEN": secrets.token_urlsafe(24), "AE_API_KEY": secrets.token_urlsafe(24),
                   "AE_REDIS_HOST": "localhost"}
    t_begin = time.time()
    print(f"rehearsal on {machine_key('cpu').removeprefix('cpu:')}; "
          f"{traffic_s / 60:g} minutes of traffic; work dir {work}", flush=True)
    # production's persistence (ops/scripts/node.sh: appendonly yes, Redis's default appendfsync everysec)
    with RedisTLS(work / "redis", appendfsync="everysec") as redis:
        secrets_env["AE_REDIS_PASSWORD"] = redis.password
        data, replaced, scaled = rehearsal_config(Path(a.prod), a.scale, work / "state", redis, secrets_env)
        print(f"config: {a.prod} with host-specific settings replaced:", flush=True)
        for line in replaced:
            print("  " + line, flush=True)  # no secret is among them: those stay ${VARS} of the environment
        print(f"scaled by --scale {a.scale:g} (every count the loop waits for; alert `for:` durations too):",
              flush=True)
        for line in scaled:
            print("  " + line, flush=True)
        cfg = parse_stack_config(data, "rehearsal config")
        store = cfg.store_config
        stream_key = f"{store.key_prefix}:{store.stream}"
        print("loading prompts (ShareGPT English and code) ...", flush=True)
        pools = sharegpt_pools(DRIFT, 400, 600, a.seed)
        stack = LocalStack(cfg, echo=lambda s: print(s, flush=True))
        prom = None
        tl = Timeline(t0=time.time(), path=None if out is None else out / "timeline.jsonl")
        results: list = []
        try:
            print("starting the stack (Ray, replicas, gateway, trainer, policy) ...", flush=True)
            info = stack.start()
            for line in info.lines():
                print("  " + line, flush=True)
            gw = stack.gateway.url
            # a scrape every 3 s, timing out at 3 s: the gateway answers /metrics within 2 s even while a replica
            # restarts (gateway.METRICS_STATUS_TIMEOUT_S); scaled `for:` durations stay >= one scrape apart
            prom = Prometheus(gw.split("://", 1)[1], REPO / "ops" / "alerts.yml", a.scale, workdir=work / "prometheus",
                              scrape_interval_s=3)
            prom.start()
            prom.watch(1.0)
            startup_s = time.time() - t_begin
            first = traffic_s * 0.3
            phases = (Phase(DRIFT[0], 0.0, first), Phase(DRIFT[1], first, traffic_s))
            plan = [FaultRun(n, traffic_s * share) for n, share in
                    (("redis_restart", 0.12), ("redis_refuses_writes", 0.22), ("redis_sigkill", 0.32),
                     ("trainer_step_fault", 0.40), ("trainer_sigkill", 0.55), ("replica_kill", 0.70))]
            print(f"traffic: {DRIFT[0]} {first:.0f} s -> {DRIFT[1]} {traffic_s - first:.0f} s, {a.clients} openai "
                  f"clients, greedy, {a.max_tokens} tokens a request (start-up took {startup_s:.0f} s)", flush=True)
            print("faults: " + ", ".join(f"{f.name} at {f.at_s:.0f} s" for f in plan), flush=True)
            tl.t0 = time.time()
            tl.add("traffic", f"{DRIFT[0]} traffic starts")
            watcher = Watcher(stack, tl, gw + "/metrics").start()
            traffic = Traffic(info.endpoint, cfg.serving.model_name, phases, PromptCycle(pools), a.clients,
                              a.max_tokens, 0.0, results.append, api_key=secrets_env["AE_API_KEY"])
            runner = threading.Thread(target=traffic.run, name="traffic", daemon=True)
            runner.start()
            traffic.t0 = tl.t0
            faults = Faults(stack, redis, stream_key, tl, a.refuse_s)
            drift_logged = False
            for f in plan:
                while time.time() - tl.t0 < f.at_s:
                    if not drift_logged and time.time() - tl.t0 >= first:
                        tl.add("traffic", f"drift: {DRIFT[1]} traffic from now on")
                        drift_logged = True
                    time.sleep(0.5)
                tl.add("fault", f"{f.name} starts")
                try:
                    faults.run(f)
                except Exception as e:  # noqa: BLE001 - a fault that could not be injected is reported, not hidden
                    f.detail = f"could not inject: {type(e).__name__}: {e}"
                    tl.add("fault", f"{f.name} FAILED to inject: {f.detail}")
            runner.join(max(1.0, traffic_s - (time.time() - tl.t0)) + 5)
            traffic.stop.set()
            grace_s = 300.0
            runner.join(grace_s)  # requests in flight finish; one still running after this is hung
            tl.add("traffic", f"traffic ended: {len(results)} requests answered")
            time.sleep(5)  # the last polls
            watcher.stop()
            try:
                trainer_events = ray.get(stack.trainer.events.remote(200), timeout=60)
            except Exception as e:  # noqa: BLE001 - reported, the summary is still written
                trainer_events = [f"events unavailable: {type(e).__name__}: {e}"]
            print("trainer events (its current process):", flush=True)
            for line in trainer_events[-30:]:
                print("  " + line, flush=True)
            summary = summarize(a, cfg, tl, watcher, faults, plan, results, traffic, prom, first, replaced, scaled,
                                startup_s, traffic_s)
            summary["trainer_events"] = trainer_events
            summary["trainer_status"] = watcher.trainer
        finally:
            if prom is not None:
                prom.stop()
            stack.stop()
            if ray.is_initialized():
                ray.shutdown()
        if out is not None:
            (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
            log = Path(cfg.promotion_log)
            if log.exists():
                (out / "promotions.jsonl").write_text(log.read_text())
    print(json.dumps(summary["figures"], default=str), flush=True)
    return 0 if summary["passed"] else 1


def summarize(a, cfg, tl: Timeline, w: Watcher, faults: Faults, plan: list, results: list, traffic, prom,
              drift_s: float, replaced: list, scaled: list, startup_s: float, traffic_s: float) -> dict:
    onset = tl.t0 + drift_s
    kill = next((f for f in plan if f.name == "replica_kill"), None)

    def killed_in_flight(r) -> bool:
        if kill is None or kill.started is None or faults.killed_replica is None:
            return False
        if f"replica {faults.killed_replica} failed while serving" not in r.error:
            return False
        return r.started_s + tl.t0 <= kill.cleared + 1.0  # sent before the kill: in flight (or queued) on it

    failed = [r for r in results if not r.ok and not killed_in_flight(r)]
    in_flight = [r for r in results if not r.ok and killed_in_flight(r)]
    sent = traffic._count
    hung = (sent - len(results)) + sum(1 for r in results if r.finished_s - r.started_s > 600)
    cands = sorted(w.candidates.values())
    promos = [e for e in w.events if e.event == "promoted"]
    promo_times = [_unix(e.time) for e in promos]
    stale = _stale_gate_decisions(w.events, w.stack.registry)
    power = _gate_power(w.events)
    resumed = [w.written_after(f.cleared, 300.0) for f in plan if f.name.startswith("redis") and f.cleared]
    recovered = [w.trainer_recovered(f.cleared, f.pid) for f in plan if f.name.startswith("trainer") and f.cleared]
    fired = dict(prom.fired) if prom is not None else {}
    fault_rows = []
    for f in plan:
        alert = EXPECTED_ALERT[f.name]
        # fired anew (or, still firing for an earlier fault, with a larger value) within 5 minutes of the fault
        at = None if prom is None or f.started is None else prom.alerted_between(alert, f.started, f.started + 300)
        fault_rows.append({"fault": f.name, "at_s": None if f.started is None else round(f.started - tl.t0, 1),
                           "detail": f.detail, "alert": alert, "alerted": at is not None,
                           "alert_after_s": None if at is None else round(at - f.started, 1), "lost": f.lost})
    figures = {
        "failed_requests": len(failed), "hung_requests": hung, "requests": len(results),
        "killed_replica_in_flight_errors": len(in_flight),
        "candidates_written": len(cands), "promotions": len(promos), "stale_gate_decisions": stale["stale"],
        "stale_evidence_refused": stale["refused"],
        "acked_records_lost": sum(f.lost for f in plan),
        "acked_records_lost_beyond_promise": sum(f.lost_beyond_promise for f in plan),
        "capture_written": int(w.written),
        "capture_dropped": int(w.dropped),
        "capture_resumed_s": None if not resumed or None in resumed else round(max(resumed), 1),
        "trainer_recovered_s": None if not recovered or None in recovered else round(max(recovered), 1),
        "time_to_first_candidate_s": next((round(t - onset, 1) for t in cands if t >= onset), None),
        "time_to_promotion_s": next((round(t - onset, 1) for t in promo_times if t >= onset), None),
        "gate_records_max": power["records_max"], "gate_smallest_detectable_tail_gain": power["smallest"],
        "alerts_fired": sorted(fired),
        "faults": [{k: r[k] for k in ("fault", "alert", "alerted", "alert_after_s")} for r in fault_rows],
        "traffic_minutes": round(traffic_s / 60, 1), "scale": a.scale,
    }
    checks = {"failed_requests == 0": figures["failed_requests"] == 0, "hung_requests == 0": hung == 0,
              "candidates_written >= 1": len(cands) >= 1, "stale_gate_decisions == 0": stale["stale"] == 0,
              # a SIGTERM restart and refused writes may lose nothing; a SIGKILL only what the persistence allows
              "acked_records_lost (SIGTERM, refusals) == 0":
                  sum(f.lost for f in plan if f.name != "redis_sigkill") == 0,
              "acked_records_lost_beyond_promise == 0": figures["acked_records_lost_beyond_promise"] == 0,
              "capture_resumed_s <= 30": (figures["capture_resumed_s"] or 1e9) <= 30,
              "trainer_recovered_s <= 120": (figures["trainer_recovered_s"] or 1e9) <= 120,
              "every fault alerted": all(r["alerted"] for r in fault_rows)}
    if not a.quick:
        if power["smallest"] is None and not promos:  # a check the evidence could not make is not claimed
            tl.add("check", f"not checked: promotions >= 1. No offline gate decision had the records to promote "
                            f"even a head twice as good on every record (at most {power['records_max']} paired "
                            "records a candidate); the loop's promotion path was not exercised")
        else:
            checks["promotions >= 1"] = len(promos) >= 1
    for name, ok in checks.items():
        tl.add("check", f"{'ok  ' if ok else 'FAIL'} {name}")
    for r in failed[:10]:
        tl.add("failed", f"request {r.index} ({r.domain}, sent at {r.started_s:.0f} s): {r.error[:200]}")
    return {"figures": figures, "checks": checks, "passed": all(checks.values()), "faults": fault_rows,
            "replaced": replaced, "scaled": scaled, "startup_s": round(startup_s, 1),
            "machine": machine_key("cpu").removeprefix("cpu:"),
            "alerts_first_fired_s": {k: round(v - tl.t0, 1) for k, v in fired.items()},
            "watch_poll_errors": w.errors, "watch_last_errors": w.last_errors, "args": vars(a)}


def _unix(iso: str) -> float:
    import datetime

    return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _gate_power(events: list) -> dict:
    """What the offline gate's evidence could show in this run: the most paired records any decision had, and
    the smallest gain on every record that any closing decision could have promoted (the gate's own
    detectable_tail_gain; None when none could promote even a head twice as good)."""
    rows = [e.evidence for e in events if e.evidence and e.evidence.get("gate") == "offline_sequential"]
    gains = [r["detectable_tail_gain"] for r in rows if r.get("detectable_tail_gain") is not None]
    return {"records_max": max((int(r.get("n", 0)) for r in rows), default=0),
            "smallest": min(gains) if gains else None}


def _stale_gate_decisions(events: list, registry) -> dict:
    """Gate decisions on evidence replayed against another champion than the one they were judged against: each
    candidate's head.json names the champion it was replayed against (metrics.replay.champion_version); a
    decision that judged it (canary_started, promoted, or rejected with the gate's evidence) while another
    champion served is stale. `refused` counts candidates rejected for stale evidence (the guard working)."""
    against = {}
    for v in registry.versions():
        try:
            ev = ReplayEvidence.from_metrics(v.metrics or {}, v.version)
        except EvidenceError:  # the policy refuses it too: it was never judged
            ev = None
        against[v.version] = ev.champion_version if ev is not None else None
    stale = refused = 0
    for e in events:
        if e.event == "rejected" and e.reason.startswith("stale evidence"):
            refused += 1
            continue
        judged = e.event in ("canary_started", "promoted") or (e.event == "rejected" and e.evidence)
        replayed = against.get(e.candidate)
        if judged and replayed is not None and e.champion is not None and replayed != e.champion:
            stale += 1
    return {"stale": stale, "refused": refused}


if __name__ == "__main__":
    sys.exit(main())
