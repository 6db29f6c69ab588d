"""The promotion policy end to end, with real Ray actors and the reference engine on a tiny target.

A fleet of two ServerActors (each builds the target in its own process) behind the HTTP gateway, a real
head registry, and the PolicyActor shell ticking the PolicyController on its own loop, unattended, while
three clients stream chat completions the whole time. The heads are honest:
- v1, the champion: a random head (it accepts little);
- bad: v1 with noise weights (accepts nothing);
- v2, v3: v1 distilled on the target's own greedy outputs with ``trainer.step.train_step`` (10 and 20
  steps); measured to accept more, offline (acceptance replay) and live.
The offline gate reads ``trainer.replay`` samples of every head on the same records, captured by the engine
serving the champion. One fault is injected: once v2's canary is running, the replicas install v2 with its
draft logits negated (a silently corrupted weight update, the SGLang failure DESIGN.md describes: the head
proposes the tokens it finds least likely); its canary was honest, so it is promoted, collapses live and
must be rolled back and blocked by the watch. (Noise weights collapse less surely: on a 64-token vocabulary
random drafts still hit now and then, and one run's live mean, 1.11, sat just above the collapse line.)

The story, in the promotion log: bad rejected offline; v2 canary -> promoted -> rolled back (blocked); v3
canary -> promoted -> watch passed. Throughout: no failed request, every response equal to plain greedy
decoding of the target (lossless under every head, the corrupted one included), requests in flight across
every fleet swap. With ~25 requests per head the 5th percentile is the minimum, so the gates compare the
first quartile here (tail_quantile 0.25); everything else is the production code path.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from adaptive_eagle.checkpoint import HeadMeta
from adaptive_eagle.engine import SpeculativeEngine
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.trace import SamplingParams
from policies.actor import PolicyActor
from policies.gates import PROMOTE, REJECT
from policies.log import PromotionLog
from policies.samples import RequestSample
from serving.actor import remote_server_actor
from serving.backend import ReferenceBackend
from serving.config import ServingConfig
from serving.gateway import GatewayThread, create_app
from serving.server import DecodeServer
from tests.adaptive_eagle.test_engine import plain_greedy
from tests.serving.conftest import ENGINE, VOCAB, make_target, tiny_head

MAX_TOKENS = 16
REPLICAS = 2
CLIENTS = 3
LIVE_PROMPTS = 24
OFFLINE_RECORDS = 30
ROUTER_WAIT_S = 300.0  # a request waiting longer for a replica gets 429 (a failure): only a hung replica
DEADLINE_S = 600.0  # per stage: a stuck stage fails the test instead of hanging it (never a speed verdict)
POLICY = {"tail_quantile": 0.25, "min_samples": 20, "min_domain_samples": 5, "canary_fraction": 0.5,
          "canary_min_requests": 20, "rollback_window": 20, "collapse_min_requests": 8, "collapse_accept_length": 1.1,
          "bootstrap_resamples": 500}


def prompt(i: int) -> list[dict]:
    r = random.Random(i)
    return [{"role": "user", "content": " ".join(f"w{r.randrange(4, VOCAB)}" for _ in range(r.randrange(3, 9)))}]


def noise_weights(head, seed: int):
    """The head with every trainable weight replaced by N(0, 1) noise (embeddings, norms and vocab maps kept)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not name.startswith("embed_tokens") and not name.endswith("norm.weight") and "layernorm" not in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
    return head


# ---- the replicas (built inside each actor's process) -----------------------------------------------------
class CorruptingBackend(ReferenceBackend):
    """The reference backend with one injected fault: installing a version that the fault file names installs
    it with its draft logits negated, and the swap still reports success (only live acceptance can tell)."""

    def __init__(self, engine: SpeculativeEngine, registry: HeadRegistry, fault_file: str) -> None:
        super().__init__(engine, registry, max_prompt_tokens=64)
        self.fault_file = Path(fault_file)

    def swap_head(self, version: str):
        faults = json.loads(self.fault_file.read_text()) if self.fault_file.is_file() else []
        if version not in faults:
            return super().swap_head(version)
        with self._swap_lock:
            loaded = self.registry.load(version, self.engine.target, device=self.engine.target.device)
            with torch.no_grad():
                loaded.head.lm_head.weight.neg_()  # a sign flip: the least likely tokens are drafted first
            return self.engine.set_head(loaded, version)


def build_server(registry_root: str, fault_file: str, name: str) -> DecodeServer:
    """Runs in the actor's process: the target is built there, the registry opened by path, the champion served."""
    target, registry = make_target(), HeadRegistry(registry_root)
    version = registry.champion()
    head = registry.load(version, target) if version != "none" else None
    engine = SpeculativeEngine(target, head, ENGINE, head_version=None if version == "none" else version)
    return DecodeServer(CorruptingBackend(engine, registry, fault_file), name=name)


# ---- heads ---------------------------------------------------------------------------------------------
def greedy_rows(target, n: int, seed0: int):
    """Training rows: prompts and the target's own greedy continuations (loss on the continuation)."""
    from trainer.traffic import TrafficRow

    plain = SpeculativeEngine(target, None, ENGINE)
    rows = []
    for i in range(n):
        ids = plain.encode(prompt(seed0 + i))
        out = list(plain.generate(ids, SamplingParams(max_tokens=MAX_TOKENS)).token_ids)
        rows.append(TrafficRow(f"train-{i}", None, tuple(ids + out), (0,) * len(ids) + (1,) * len(out), None, None))
    return rows


def distilled(target, start, rows, steps: tuple[int, ...]) -> list:
    """Copies of `start` after each of `steps` TTT optimizer steps on `rows` (one batch, features computed once)."""
    from trainer.step import StepConfig, adamw, train_step
    from trainer.traffic import make_traffic_batch

    head = copy.deepcopy(start).float()
    batch = make_traffic_batch(target, head, rows).batch
    opt, cfg, out = adamw(head, 1e-2), StepConfig(ttt_steps=2, max_loss_rows=None), []
    for step in range(max(steps)):
        train_step(head, batch, opt, None, cfg, step=step)
        if step + 1 in steps:
            out.append(copy.deepcopy(head).to(target.dtype))
    return out


@dataclass
class World:
    target: object
    registry: HeadRegistry
    heads: dict
    replay: dict  # version -> [RequestSample] on the same records
    expected: list  # LIVE_PROMPTS plain greedy texts


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Heads registered, offline replay done, plain greedy answers known (one torch thread: on 2 shared cores,
    two threads per process run these tiny ops ~10x slower)."""
    from trainer.replay import TreeParams, replay_heads

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = make_target()
        v1 = tiny_head(target, 11)
        v2, v3 = distilled(target, v1, greedy_rows(target, 64, 1000), steps=(10, 20))
        heads = {"v1": v1, "bad": noise_weights(copy.deepcopy(v1), seed=2), "v2": v2, "v3": v3}
        registry = HeadRegistry.create(tmp_path_factory.mktemp("integration") / "registry")
        for version, head in heads.items():
            registry.register(head, HeadMeta.new(version, target.name, target.fingerprint), dtype=torch.float32)
        assert registry.set_champion("v1", expect="none").ok
        served = {v: registry.load(v, target).head for v in heads}  # as the servers load them (float32 on disk)
        engine = SpeculativeEngine(target, served["v1"], ENGINE, head_version="v1")
        records = [engine.generate(prompt(2000 + i), SamplingParams(max_tokens=MAX_TOKENS), capture=True,
                                   request_id=f"rec-{i}").trace for i in range(OFFLINE_RECORDS)]
        report = replay_heads(served, records, target, TreeParams.of(ENGINE))
        replay = {v: [RequestSample(**s) for s in report.scores[v].samples(v)] for v in heads}
        expected = []
        for i in range(LIVE_PROMPTS):
            ids = engine.encode(prompt(i))
            out = plain_greedy(target, ids, MAX_TOKENS)
            end = next((k + 1 for k, t in enumerate(out) if t in engine.eos_ids), len(out))
            expected.append(target.tokenizer.decode([t for t in out[:end] if t not in engine.eos_ids],
                                                    skip_special_tokens=True))
    finally:
        torch.set_num_threads(threads)
    return World(target, registry, heads, replay, expected)


# ---- traffic -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    prompt: int
    ok: bool
    text: str
    head_version: str | None
    accept_length: float | None
    started: float
    ended: float
    error: str = ""


def stream_chat(client: httpx.Client, url: str, i: int) -> Outcome:
    body = {"model": "tiny-eagle", "messages": prompt(i), "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True}
    t0, text, spec = time.time(), [], None
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Outcome(i, False, "", None, None, t0, time.time(), f"HTTP {r.status_code}: {r.read()!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(i, False, "".join(text), None, None, t0, time.time(), str(chunk["error"]))
                text.append(chunk["choices"][0]["delta"].get("content") or "")
                spec = chunk.get("adaptive_eagle", spec)
    except httpx.HTTPError as e:
        return Outcome(i, False, "".join(text), None, None, t0, time.time(), f"{type(e).__name__}: {e}")
    if spec is None:
        return Outcome(i, False, "".join(text), None, None, t0, time.time(), "no final chunk")
    return Outcome(i, True, "".join(text), spec["head_version"], spec["accept_length"], t0, time.time())


class Clients:
    """CLIENTS threads streaming requests back to back until stopped."""

    def __init__(self, url: str) -> None:
        self.url, self.outcomes, self.stop = url, [], threading.Event()
        self._next, self._lock = 0, threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(CLIENTS)]

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                with self._lock:
                    i, self._next = self._next % LIVE_PROMPTS, self._next + 1
                out = stream_chat(client, self.url, i)
                with self._lock:
                    self.outcomes.append(out)

    def __enter__(self) -> Self:
        for t in self.threads:
            t.start()
        # traffic is flowing once every client has finished a request: from then on each client is always inside
        # one (between two it only appends an outcome), so every fleet change, however short, has one in flight
        deadline = time.monotonic() + DEADLINE_S
        while len(self.outcomes) < CLIENTS:
            assert time.monotonic() < deadline, f"no traffic within {DEADLINE_S} s: {self.outcomes}"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


class TimedFleet:
    """The gateway's fleet, recording the wall-clock window of every swap and canary change."""

    def __init__(self, fleet) -> None:
        self.fleet, self.windows = fleet, []

    def _timed(self, what: str, version, fn, *args):
        t0 = time.time()
        try:
            return fn(*args)
        finally:
            self.windows.append((what, version, t0, time.time()))

    def swap(self, version):
        return self._timed("swap", version, self.fleet.swap, version)

    def set_canary(self, version, fraction):
        return self._timed("canary", version, self.fleet.set_canary, version, fraction)

    def serving_versions(self):
        return self.fleet.serving_versions()

    def live_samples(self, version, since):
        return self.fleet.live_samples(version, since)

    def cannot_serve(self, version):
        return self.fleet.cannot_serve(version)


class PolicyLoop:
    """The PolicyActor shell on its own event loop thread, ticking unattended."""

    def __init__(self, actor: PolicyActor, interval_s: float = 0.2) -> None:
        self.actor, self.loop = actor, asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = asyncio.run_coroutine_threadsafe(actor.run(interval_s), self.loop)

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(DEADLINE_S)

    def close(self) -> int:
        """Stop the loop; the number of ticks it ran."""
        self.call(self.actor.stop())
        ticks = self.running.result(DEADLINE_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        return ticks


def wait_for_event(plog: PromotionLog, event: str, candidate: str, clients: Clients, fleet: TimedFleet) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not any(e.event == event and e.candidate == candidate for e in plog.read().events):
        failed = [o for o in list(clients.outcomes) if not o.ok]
        assert not failed, f"failed requests: {failed[:3]}"
        assert time.monotonic() < deadline, f"no {event} of {candidate} within {DEADLINE_S} s: " \
                                            f"{[(e.event, e.candidate) for e in plog.read().events]}"
        time.sleep(0.1)


# ---- the test ------------------------------------------------------------------------------------------
def test_policy_promotes_rejects_and_rolls_back_a_live_fleet(ray_session, world, tmp_path):
    w = world
    mean = {v: float(np.mean([s.accept_length for s in w.replay[v]])) for v in w.replay}
    assert all(len(w.replay[v]) >= POLICY["min_samples"] for v in w.replay)  # records ending at once are skipped
    assert mean["v2"] > mean["v1"] + 0.2 and mean["v3"] > mean["v1"] + 0.2 and mean["bad"] < 1.05, mean

    fault_file = tmp_path / "corrupt.json"
    build = functools.partial(build_server, str(w.registry.root), str(fault_file))
    replicas = [remote_server_actor(functools.partial(build, f"actor-{i}"), f"actor-{i}", num_cpus=0)
                for i in range(REPLICAS)]
    app = create_app(ServingConfig(model_name="tiny-eagle", replicas=REPLICAS, max_tokens_limit=64,
                                   default_max_tokens=MAX_TOKENS, request_timeout_s=ROUTER_WAIT_S), replicas)
    gateway = GatewayThread(app)
    url = gateway.start(timeout=120)
    fleet = TimedFleet(app.state.gateway.fleet)
    assert fleet.serving_versions() == ["v1"] * REPLICAS
    actor = PolicyActor(w.registry.root, fleet, POLICY)
    plog = actor.controller.plog
    policy = PolicyLoop(actor)
    try:
        with Clients(url) as clients:
            # a deliberately bad head: rejected offline, the fleet never sees it
            decision = policy.call(actor.consider("bad", w.replay["v1"], w.replay["bad"]))
            assert decision.action == REJECT and fleet.windows == []
            # v2: offline gate -> canary (honest), then its installs get corrupted -> promoted -> collapse
            assert policy.call(actor.consider("v2", w.replay["v1"], w.replay["v2"])).action == PROMOTE
            assert fleet.serving_versions() == ["v1", "v2"]
            fault_file.write_text(json.dumps(["v2"]))
            wait_for_event(plog, "rolled_back", "v2", clients, fleet)
            assert fleet.serving_versions() == ["v1"] * REPLICAS
            # v3 against the restored champion: canary -> promoted -> the watch passes
            assert policy.call(actor.consider("v3", w.replay["v1"], w.replay["v3"])).action == PROMOTE
            wait_for_event(plog, "watch_ended", "v3", clients, fleet)
        ticks = policy.close()
        assert ticks > 10 and actor.tick_errors == 0, (ticks, actor.tick_errors)
    finally:
        gateway.stop()

    # every request succeeded (none stranded in the router's queue across a fleet change) and equals plain
    # greedy decoding, whatever head served it
    outcomes = clients.outcomes
    failed = [o for o in outcomes if not o.ok]
    assert failed == [], failed[:3]
    wrong = [(o.prompt, o.head_version, o.text) for o in outcomes if o.ok and o.text != w.expected[o.prompt]]
    assert wrong == [], wrong[:3]
    served = {v: [o.accept_length for o in outcomes if o.head_version == v] for v in ("v1", "v2", "v3")}
    assert all(len(x) >= POLICY["canary_min_requests"] for x in served.values()), {v: len(x) for v, x in served.items()}
    # requests were in flight across every fleet change (canary starts and ends, promotions, the rollback)
    assert [(what, v) for what, v, _, _ in fleet.windows] == [
        ("canary", "v2"), ("canary", None), ("swap", "v2"), ("swap", "v1"),
        ("canary", "v3"), ("canary", None), ("swap", "v3")]
    for what, version, t0, t1 in fleet.windows:
        assert any(o.started < t1 and o.ended > t0 for o in outcomes), (what, version, t0, t1)

    # the registry and the fleet end where the story says
    registry = HeadRegistry(w.registry.root)
    assert registry.champion() == "v3" and "v2" in registry.blocked() and "v3" not in registry.blocked()
    assert fleet.serving_versions() == ["v3"] * REPLICAS

    # the log tells it in order, with the evidence
    events = plog.read().events
    assert [(e.event, e.candidate) for e in events] == [
        ("considered", "bad"), ("rejected", "bad"),
        ("considered", "v2"), ("canary_started", "v2"), ("canary_ended", "v2"), ("promoted", "v2"),
        ("rolled_back", "v2"),
        ("considered", "v3"), ("canary_started", "v3"), ("canary_ended", "v3"), ("promoted", "v3"),
        ("watch_ended", "v3")]
    by = {(e.event, e.candidate): e for e in events}
    assert by[("rejected", "bad")].evidence["gate"] == "offline"
    assert by[("canary_ended", "v2")].evidence["tail_candidate"] > by[("canary_ended", "v2")].evidence["tail_champion"]
    collapse = by[("rolled_back", "v2")]
    assert collapse.by == "policy" and collapse.champion == "v1" and collapse.evidence["gate"] == "rollback"
    assert collapse.evidence["n_live"] >= POLICY["collapse_min_requests"]
    assert by[("promoted", "v3")].action == PROMOTE and by[("watch_ended", "v3")].action == "hold"
    # live acceptance measured by the clients: the corrupted v2 (after its promotion) accepted ~nothing
    promoted_at = next(t1 for what, v, _, t1 in fleet.windows if (what, v) == ("swap", "v2"))
    corrupted = [o.accept_length for o in outcomes if o.head_version == "v2" and o.started > promoted_at]
    # (near 1: the policy's own collapse window saw < collapse_accept_length; the clients' whole set is a bit noisier)
    assert corrupted and np.mean(corrupted) < 1.25 and np.mean(served["v3"]) > np.mean(corrupted) + 0.2, \
        (np.mean(corrupted), served["v3"])

    # on-call reads the same story from the CLI
    from adaptive_eagle_cli import app as cli

    res = CliRunner().invoke(cli, ["promotions", "--registry", str(w.registry.root), "--json"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.output.splitlines() if x.strip()]
    assert [(x["event"], x["candidate"]) for x in lines] == [(e.event, e.candidate) for e in events]
