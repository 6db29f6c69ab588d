"""DemoConfig: what `adaptive-eagle demo` runs (the CLI's options, checked at the boundary), and the
StackConfig the demo starts from it.

Owns: the demo's settings and their ranges (every error names the option and what is allowed), the
phase plan (which domain is sent when), and `demo_stack_config`: the stack tuned so that the loop
turns within minutes on a 2-core CPU (capture of every request, a trainer that writes candidates every
few minutes and yields to queued requests, sample minimums a few minutes of traffic can meet).
Must not touch: starting anything (run.py), traffic (traffic.py).

Engine. Serving and the control run decode with the same tree and with no model-free drafting
(prompt lookup, suffix index) and no cost-aware pruning: then acceptance replay of a head on a
captured greedy request reproduces what that head would have accepted serving it, step for step
(tests/trainer/test_replay.py), which is how the frozen head is scored on the very same requests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SCENARIO_DOMAINS = ("english", "code", "math", "agent", "sessions", "tools", "tools2")
# named scenarios: `--scenario long` = short English chat drifting to long multi-turn agent sessions; `--scenario
# agent` = an agent loop calling tools (demo/agent.py) whose tool set changes halfway (tools -> tools2)
SCENARIOS = {"long": ("english", "sessions"), "agent": ("tools", "tools2")}
# the first phase's share of the traffic where a named scenario sets it (the agent's drift comes halfway)
FIRST_SHARES = {SCENARIOS["agent"]: 0.5}
SESSION_CHARS = 16000  # characters of context a demo session grows to (about 4-5k tokens): bench/sessions.py
# the demo's serving.max_prompt_tokens: a session's last turns fit, within SmolLM2's 8,192 with room for the answer
MAX_PROMPT_TOKENS = 7680
MODEL_NAME = "adaptive-eagle"
# the serving tree (trainer.replay.TreeParams defaults) without model-free drafts or pruning: replay is exact
ENGINE = {"depth": 5, "topk": 4, "num_draft_tokens": 16, "cost_aware": False, "prompt_lookup": False,
          "suffix_drafting": False, "calibration_dir": ""}


class DemoConfigError(ValueError):
    """A demo option was refused: the message names the option and the allowed range."""


class DemoConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    minutes: float = Field(15.0, ge=1.0, le=720.0, description="wall-clock budget of the whole demo, start-up and "
                           "report included; in [1, 720]")
    out: str = Field("demo-report", min_length=1, description="report directory (created; files overwritten)")
    # the default: agents whose tool set changes, traffic the shipped English head accepts little of. English then
    # code costs that head almost nothing (docs/results/demo-2026-12-07-english-code-epyc: frozen accept length
    # 1.76 before the drift, 1.67-1.78 after), so 15 minutes there show no drift to win back
    scenario: tuple[str, ...] = Field(SCENARIOS["agent"], min_length=1, max_length=12, description=(
        "domains in the order the traffic drifts through them (1 to 12 phases; a domain may come back, not twice "
        "in a row), from english, code, math, agent, sessions (long multi-turn agent sessions), tools, tools2; "
        "or `long` (= english,sessions), `agent` (= tools,tools2: the default)"))
    prompts: Optional[str] = Field(None, description="a JSONL file of your own prompts ({prompt | messages, "
                                   "domain?} a line) instead of ShareGPT")
    clients: int = Field(2, ge=1, le=16, description="concurrent openai clients; in [1, 16]")
    max_tokens: int = Field(96, ge=8, le=512, description="tokens generated per request; in [8, 512]")
    think_s: float = Field(1.0, ge=0.0, le=60.0, description="pause of a client between its requests (leaves the "
                           "trainer CPU time); in [0, 60]")
    first_phase_share: float = Field(0.2, gt=0.0, lt=1.0, description="share of the traffic time of the first "
                                     "phase (before the drift), where the scenario does not set it (`agent`: "
                                     "half); in (0, 1)")
    control_every: int = Field(6, ge=1, le=1000, description="every k-th request is also decoded in-process with "
                               "the frozen head (its tokens/s); in [1, 1000]")
    holdback: float = Field(0.15, ge=0.0, le=0.5, description="share of requests the replicas decode with the "
                            "frozen shipped head next to the adapted one, at the same time (the holdback arm: the "
                            "report's time per output token, adapted vs frozen); in [0, 0.5]")
    greedy_checks: int = Field(5, ge=0, le=100, description="responses checked against plain greedy decoding; "
                               "in [0, 100]")
    max_prompt_chars: int = Field(600, ge=20, le=20_000, description="ShareGPT prompts longer than this are "
                                  "skipped; in [20, 20000]")
    quick: bool = Field(False, description="a few-minute run with short answers and fast candidates (CI)")
    port: int = Field(0, ge=0, le=65535, description="gateway port (0: any free port); in [0, 65535]")
    state_dir: Optional[str] = Field(None, description="where the stack keeps registry, store and trainer state "
                                     "(None: a fresh temporary directory)")
    keep_state: bool = Field(False, description="keep the temporary state directory after the run")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="seed of prompt order; in [0, 2**31 - 1]")
    head: Literal["dense", "moe"] = Field("dense", description=(
        "the kind of head the trainer adapts: dense (the shipped head, trained in place) or moe (the trainer grows "
        "an expert for a domain whose acceptance stays low: trainer moe_grow); in {dense, moe}"))
    evidence: Literal["prequential", "heldout"] = Field("prequential", description=(
        "how candidates are judged (trainer.evidence): prequential (test-then-train) or heldout; in "
        "{prequential, heldout}"))

    @field_validator("scenario", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, str):
            value = tuple(p.strip() for p in value.split(",") if p.strip())
        if isinstance(value, (tuple, list)) and len(value) == 1 and value[0] in SCENARIOS:
            value = SCENARIOS[value[0]]
        return value

    @field_validator("scenario")
    @classmethod
    def _known(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [d for d in value if d not in SCENARIO_DOMAINS]
        if bad:
            raise ValueError(f"unknown domain(s) {', '.join(bad)} (allowed: {', '.join(SCENARIO_DOMAINS)}, or one "
                             f"named scenario: {', '.join(SCENARIOS)})")
        twice = [a for a, b in zip(value, value[1:]) if a == b]
        if twice:
            raise ValueError(f"{twice[0]} follows itself: two phases in a row of one domain are one phase")
        return value

    @model_validator(mode="after")
    def _check(self) -> "DemoConfig":
        if self.prompts is not None and not Path(self.prompts).expanduser().is_file():
            raise ValueError(f"prompts: no such file {self.prompts}")
        return self

    @classmethod
    def make(cls, **fields) -> "DemoConfig":
        """Construct; a pydantic error becomes a DemoConfigError naming each option and its range."""
        try:
            return cls(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            raise DemoConfigError(explain(e)) from None

    # ---- derived settings ---------------------------------------------------------------------
    @property
    def first_share(self) -> float:
        """The first phase's share of the traffic: the named scenario's (agent: half), else first_phase_share."""
        if "first_phase_share" in self.model_fields_set:
            return self.first_phase_share
        return FIRST_SHARES.get(self.scenario, self.first_phase_share)

    @property
    def budget_s(self) -> float:
        return self.minutes * 60.0

    def traffic_s(self, startup_s: float) -> float:
        """Seconds of traffic: the budget less start-up and the closing work (the frozen head's acceptance
        replay of every captured request, greedy checks, report). The replay grows with the traffic: on a
        2-core AMD EPYC it took 0.15 s per second of traffic (89 s after 610 s), so it gets a share of the rest;
        stopping the stack took 7-62 s, the 5 greedy checks of 96 tokens 8 s."""
        closing = (40.0 if self.quick else 60.0) + 2.0 * self.greedy_checks * self.max_tokens / 32
        # --quick: a few short requests, replayed in seconds
        share = 0.0 if self.quick else max(REPLAY_SHARES.get(d, REPLAY_SHARE) for d in self.scenario)
        return max(20.0, (self.budget_s - startup_s - closing) / (1.0 + share))


REPLAY_SHARE = 0.2  # closing replay seconds per second of traffic (measured 0.15 on 2 cores), with a margin
# domains whose records replay slower: agent turns carry ~600 prompt tokens of tool schemas (measured 0.64 s per
# second of traffic on a 2-core AMD EPYC: 193 requests replayed in 415 s)
REPLAY_SHARES = {"tools": 0.7, "tools2": 0.7}


def explain(error: ValidationError) -> str:
    lines = []
    for err in error.errors():
        name = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-") if err["loc"] else "demo"
        field = DemoConfig.model_fields.get(str(err["loc"][0])) if err["loc"] else None
        doc = f" — {field.description}" if field is not None and field.description else ""
        given = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        lines.append(f"{name}: {err['msg'].removeprefix('Value error, ')}{given}{doc}")
    return "; ".join(lines)


@dataclass(frozen=True)
class Phase:
    domain: str
    start_s: float  # seconds after traffic began
    end_s: float


def phase_plan(domains: tuple[str, ...], traffic_s: float, first_share: float) -> tuple[Phase, ...]:
    """The first domain gets `first_share` of the traffic time (the baseline before the drift), the others
    split the rest evenly, in order."""
    if len(domains) == 1:
        return (Phase(domains[0], 0.0, traffic_s),)
    first = traffic_s * first_share
    rest = (traffic_s - first) / (len(domains) - 1)
    phases = [Phase(domains[0], 0.0, first)]
    for i, d in enumerate(domains[1:]):
        phases.append(Phase(d, first + i * rest, first + (i + 1) * rest))
    return tuple(phases)


def demo_stack_config(cfg: DemoConfig, state_dir: str):
    """The StackConfig of the demo: the real target, the shipped head as the seed champion, a local store,
    one replica, every request captured, a trainer and a policy tuned to turn within the budget."""
    from adaptive_eagle.cli import SHIPPED_HEAD
    from loop.config import parse_stack_config

    quick = cfg.quick
    trainer = {
        "num_cpus": 0, "device": "cpu", "poll_ms": 200, "checkpoint_every_s": 20,
        "champion_check_s": 3, "batch_tokens": 1024 if quick else 4096, "min_fresh_tokens": 256 if quick else 1024,
        # test-then-train: a snapshot costs no replay when written and gathers evidence from then on; two gather at
        # once, and a newer one closes the older whose rows lead the champion least. The sequential gate's valid
        # test needs about 60 paired records for a head 50% better, hundreds for a few percent
        # (docs/results/gate-sim-2026-12-07-epyc), so a snapshot every sixth of the run (at least every minute): a longer
        # demo gives each snapshot a longer window of evidence (a third of the run, more for one that leads). A
        # held-out candidate is replayed when written (every 2.5 minutes)
        "evidence": cfg.evidence, "heldout_percent": 50 if quick else 25, "heldout_per_domain": 48,
        "candidate_every_tokens": 1024 if quick else int(60_000 * max(1.0, cfg.minutes / 15)),
        "candidate_every_minutes": 0.3 if quick else max(1.0, cfg.minutes / 6) if cfg.evidence == "prequential"
        else 2.5,
        "min_candidate_tokens": 512 if quick else 8192,
        # every record trains at full length (chunked TTT keeps memory linear): a trainer capped below the
        # served contexts makes long positions worse (docs/results/long-sessions-2026-12-02)
        "max_len": MAX_PROMPT_TOKENS + max(cfg.max_tokens, 256),
        # the replica and the trainer each run one thread: with two or more cores each has its own and the
        # trainer never needs to pause; on one core it pauses while a request waits for the replica
        "yield_queue_depth": 0 if (os.cpu_count() or 1) >= 2 else 1,
    }
    if quick:  # a smoke run: a candidate must reach the gates even if too few records can judge it
        trainer["min_candidate_heldout"] = 1
    if cfg.head == "moe":
        # an expert for a domain whose records stay below the head's running acceptance for a while: prod's 200
        # records are 8-10 minutes of this machine's traffic, a phase of a continual run; 50 are about 2-3
        trainer.update(moe_grow=True, moe_grow_after_records=50 if not quick else 10)
    policy = {
        "tick_s": 1.0, "candidate_poll_s": 1.0 if quick else 3.0, "min_samples": 20, "min_domain_samples": 10,
        # a few dozen requests make the 5th percentile their minimum and a quartile one or two of them: the
        # demo's tail is the mean accept length of the lowest quarter of requests
        "tail_quantile": 0.25, "tail_statistic": "tail_mean", "confidence_level": 0.9, "bootstrap_resamples": 500,
        "domain_tolerance": 0.05,
        "canary_fraction": 0.5, "canary_min_requests": 20, "rollback_window": 30, "collapse_min_requests": 10,
        # 20 unpaired live requests a head cannot resolve a gain of a few percent (the paired offline gate
        # showed it): the canary checks that the candidate is not clearly worse live
        "canary_margin": 0.1,
        # the demo's traffic is greedy, so replay is exact and the canary is a health check: 5 live requests a
        # head without a collapse or clear harm (prod: 100; the rehearsal scales it to 5 too)
        "canary_health_requests": 5,
    }
    return parse_stack_config({
        "state_dir": state_dir,
        "ray": {"num_cpus": max(2, os.cpu_count() or 2), "dashboard": False, "replica_num_cpus": 0},
        "registry": {"seed_head": str(SHIPPED_HEAD)},
        "serving": {"model_name": MODEL_NAME, "port": cfg.port, "queue_size": 16 + cfg.clients,
                    "max_prompt_tokens": MAX_PROMPT_TOKENS, "max_tokens_limit": max(cfg.max_tokens, 256),
                    "default_max_tokens": cfg.max_tokens, "request_timeout_s": 900,
                    "capture": {"fraction": 1.0, "budget_bytes_per_s": 256 << 20, "seed": cfg.seed},
                    "holdback_fraction": cfg.holdback,
                    "engine": ENGINE},
        "store": {"fsync": False},
        "trainer": trainer,
        "policy": policy,
    }, "demo stack")


__all__ = ["DemoConfig", "DemoConfigError", "ENGINE", "MAX_PROMPT_TOKENS", "MODEL_NAME", "Phase", "SCENARIOS",
           "SCENARIO_DOMAINS", "SESSION_CHARS", "demo_stack_config",
           "phase_plan"]
