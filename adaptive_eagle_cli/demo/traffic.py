"""The demo's traffic: real prompts whose mix drifts by phases, sent by concurrent `openai` clients.

Owns: the prompt pools (ShareGPT first user turns of the training split, per domain; the agent-style
workload of bench/workloads.py; long multi-turn sessions of bench/sessions.py; or a user's JSONL file),
the clients (greedy requests through the OpenAI endpoint, each request's domain in `metadata`), and
`RequestResult`, one per request, failures included (an exception, a non-200 answer, an empty
completion). Must not touch: the stack, the report.

Sessions (domain `sessions`) are sent as agents send them: a client works through one session at a time,
turn after turn; each request carries the system message, every earlier turn and the model's own answers
as they came back, then the new turn, so contexts grow to thousands of tokens. A failed turn ends the
session (the next turn would need its answer); the client starts the next session.

Agent tasks (domains `tools` and `tools2`, agent.py) are sent as an agent framework sends them: a client works
through one task at a time: the task with the domain's tool set and tool_choice "required", then (when the answer
holds calls) the history with the calls and the results of the client's own tools, tool_choice "auto". A
response's text is then its content and calls in one canonical form (`agent.canonical`), which the control
compares.

The held-out split of ShareGPT is never sent as a prompt: it is what offline evaluations score heads on (the agent
tasks' search tool returns held-out passages as tool results).
"""

from __future__ import annotations

import importlib.util
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from adaptive_eagle_cli.demo import agent
from adaptive_eagle_cli.demo.config import SESSION_CHARS, Phase

SHAREGPT_DOMAINS = ("english", "code", "math")
SESSIONS = "sessions"  # the domain of long multi-turn agent sessions


@dataclass(frozen=True)
class Prompt:
    messages: tuple  # ({"role", "content"}, ...); a session's pool entry: ()
    domain: str
    session: object = None  # domain `sessions`: the bench/sessions.py Session whose turns the client sends
    tools: tuple = ()  # agent domains: the tool set offered (OpenAI tool dicts); messages may then hold tool turns
    tool_choice: Optional[str] = None
    parallel_tool_calls: Optional[bool] = None  # None: the endpoint's default (true)
    max_tokens: Optional[int] = None  # this request's own budget (a required call's), else the traffic's

    def chat_body(self, model: str, max_tokens: int) -> dict:
        """The greedy chat request as the clients send it (the control re-decodes from the same body)."""
        body = {"model": model, "messages": list(self.messages), "temperature": 0,
                "max_tokens": self.max_tokens or max_tokens}
        if self.tools:
            body.update(tools=list(self.tools), tool_choice=self.tool_choice)
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        return body


@dataclass(frozen=True)
class RequestResult:
    index: int  # order in which requests were sent
    client: int
    domain: str
    phase: int  # index into the phase plan
    started_s: float  # seconds after traffic began
    finished_s: float
    prompt: Prompt
    ok: bool
    error: str = ""
    request_id: str = ""  # the response id = the trace's request_id in the store
    text: str = ""
    completion_tokens: int = 0
    head_version: str = ""
    accept_length: float = 0.0  # tokens per verify step, bonus included
    verify_steps: int = 0
    tokens_per_s: float = 0.0
    captured: str = ""
    by_context: tuple[tuple[str, int, int], ...] = ()  # the response's (context bucket, verify steps, accepted drafts)
    arm: str = "served"  # "holdback": the replica decoded it with the frozen baseline head (serving.holdback_fraction)
    tpot_s: float = 0.0  # the response's time per output token after the first
    tool_calls: tuple[tuple[str, str, str], ...] = ()  # the answer's calls (id, name, arguments), agent domains


# ---- prompt pools ---------------------------------------------------------------------------------
def sharegpt_pools(domains: Sequence[str], per_domain: int, max_chars: int, seed: int) -> dict[str, list[Prompt]]:
    """Up to `per_domain` prompts for each of `domains` (english, code, math, agent) from ShareGPT's training
    split, shuffled with `seed`. Reads the file only as far as it needs to."""
    from trainer.data import load_sharegpt, select

    tools = [d for d in domains if d in agent.TOOL_DOMAINS]
    wanted = {d for d in domains if d in SHAREGPT_DOMAINS} | ({"english"} if "agent" in domains or tools else set())
    texts: dict[str, list[str]] = {d: [] for d in wanted}
    agent_convs: list = []
    for conv in select(load_sharegpt(), domains=sorted(wanted), split="train"):
        first = next((m.content for m in conv.messages if m.role == "user"), "")
        if conv.domain == "english" and "agent" in domains and len(agent_convs) < 4 * per_domain:
            agent_convs.append(conv)
        if 20 <= len(first) <= max_chars and len(texts[conv.domain]) < per_domain:
            texts[conv.domain].append(first)
        if all(len(texts[d]) >= per_domain for d in wanted) and ("agent" not in domains
                                                                 or len(agent_convs) >= 4 * per_domain):
            break
    pools = {d: [Prompt(({"role": "user", "content": t},), d) for t in texts[d]] for d in domains if d in texts}
    if "agent" in domains:
        workloads = bench_module("workloads")
        n = min(per_domain, len(agent_convs) // 3)
        pools["agent"] = [Prompt(tuple(m), "agent") for m in workloads.agent_prompts(agent_convs, n, seed=seed)]
    if SESSIONS in domains:
        pools[SESSIONS] = session_pool(max(2, per_domain // 10), seed=seed)
    for i, d in enumerate(tools):  # each tool domain its own tasks; a client's task is one to two requests
        pools[d] = [Prompt(({"role": "user", "content": t},), d)
                    for t in agent.tasks(texts["english"], per_domain, seed=seed + i)]
    rng = random.Random(seed)
    for d, pool in pools.items():
        if not pool:
            raise ValueError(f"ShareGPT gave no {d} prompts of 20..{max_chars} characters (raise --max-prompt-chars)")
        rng.shuffle(pool)
    return pools


def search_passages(n: int = 400, min_chars: int = 120, max_chars: int = 600) -> list[str]:
    """Up to `n` assistant answers of held-out English ShareGPT conversations: what the agent tasks' search tool
    looks in."""
    from trainer.data import load_sharegpt, select

    out: list[str] = []
    for conv in select(load_sharegpt(), domains=["english"], split="heldout"):
        text = next((m.content for m in conv.messages if m.role == "assistant"), "")
        if min_chars <= len(text) <= max_chars:
            out.append(text)
            if len(out) >= n:
                break
    if not out:
        raise ValueError("ShareGPT's held-out split holds no English answer for the search tool")
    return out


def session_pool(n: int, seed: int) -> list[Prompt]:
    """Up to `n` long sessions (chat and tool kinds alternating, bench/sessions.py) from ShareGPT's training
    split, each growing to about SESSION_CHARS characters of context; fewer where the split runs out."""
    from trainer.data import load_sharegpt, select

    build = bench_module("sessions").build_sessions
    convs = list(select(load_sharegpt(), split="train"))
    for k in sorted({n, min(n, 16), min(n, 4), 1}, reverse=True):  # as many as the split holds text for
        try:
            return [Prompt((), SESSIONS, session=s) for s in build(convs, k, min_chars=SESSION_CHARS, seed=seed)]
        except ValueError:
            continue
    raise ValueError("ShareGPT's training split holds no text for a long session")


def bench_module(name: str):
    """bench/<name>.py (the agent-style workload, the long sessions) loaded from the source tree: bench/ is not
    an installed package. A clear error where the tree does not have it."""
    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
    if not path.is_file():
        raise ValueError(f"this scenario needs {path} (the source tree's bench/{name}.py)")
    spec = importlib.util.spec_from_file_location(f"adaptive_eagle_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def jsonl_pools(path: str, seed: int) -> dict[str, list[Prompt]]:
    """A user's prompts: one JSON object a line, {"prompt": "..."} or {"messages": [{role, content}, ...]},
    with an optional "domain" (default "custom"). Pools keep file order; errors name the line."""
    from trainer.data import jsonl_objects

    pools: dict[str, list[Prompt]] = {}
    for lineno, raw in jsonl_objects(path):  # a line that is not JSON: DataError (a ValueError) naming it
        prompt = _prompt_of(raw)
        if prompt is None:
            raise ValueError(f"{path}:{lineno}: expected {{\"prompt\": text}} or {{\"messages\": [{{role, "
                             "content}, ...]}}, with an optional \"domain\"")
        pools.setdefault(prompt.domain, []).append(prompt)
    if not pools:
        raise ValueError(f"{path}: no prompts")
    return pools


def _prompt_of(raw) -> Optional[Prompt]:
    if not isinstance(raw, dict):
        return None
    domain = str(raw.get("domain") or "custom")
    if isinstance(raw.get("prompt"), str) and raw["prompt"].strip():
        return Prompt(({"role": "user", "content": raw["prompt"]},), domain)
    msgs = raw.get("messages")
    if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                               and m.get("role") in ("system", "user", "assistant") for m in msgs):
        return Prompt(tuple({"role": m["role"], "content": m["content"]} for m in msgs), domain)
    return None


class PromptCycle:
    """Prompts of each domain in pool order, starting over when a pool runs out (thread-safe). A prompt sent a
    second time may be scored by test-then-train evidence after the trainer learnt from its first answer, so
    every reuse is counted (`reused`, reported by the demo); size the pools to the run to keep it 0."""

    def __init__(self, pools: dict[str, list[Prompt]]) -> None:
        self.pools = pools
        self.next = {d: 0 for d in pools}
        self.reused = 0
        self.lock = threading.Lock()

    def take(self, domain: str) -> Prompt:
        with self.lock:
            pool = self.pools[domain]
            i = self.next[domain]
            self.reused += i >= len(pool)
            self.next[domain] = i + 1
            return pool[i % len(pool)]


@dataclass(frozen=True)
class SessionTurns:
    """One client's place in a long session: the turn to send next and the history before it (the system
    message, every earlier turn and the answers the served model gave)."""

    session: object  # bench/sessions.py Session
    turn: int
    history: tuple  # ({"role", "content"}, ...)

    @classmethod
    def start(cls, entry: Prompt) -> "SessionTurns":
        return cls(entry.session, 0, ({"role": "system", "content": entry.session.system},))

    def done(self) -> bool:
        return self.turn >= len(self.session.turns)

    def prompt(self) -> Prompt:
        return Prompt(self.history + tuple(self.session.turns[self.turn]), SESSIONS, session=self.session)

    def after(self, sent: Prompt, answer: "RequestResult") -> Optional["SessionTurns"]:
        """The next turn's place, the answer appended; None when the answer failed (the session ends)."""
        if not answer.ok:
            return None
        return SessionTurns(self.session, self.turn + 1, sent.messages + ({"role": "assistant", "content": answer.text},))


# ---- clients -------------------------------------------------------------------------------------
@dataclass
class Traffic:
    """Concurrent clients sending greedy requests until the phase plan ends or `stop` is set."""

    endpoint: str
    model: str
    phases: tuple[Phase, ...]
    prompts: PromptCycle
    clients: int
    max_tokens: int
    think_s: float
    on_result: Callable[[RequestResult], None]
    api_key: str = "demo"  # the gateway's API key, where it has any (serving.api_keys)
    passages: Sequence[str] = ()  # agent domains: what the search tool looks in
    stop: threading.Event = field(default_factory=threading.Event)
    t0: float = 0.0
    _count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        """Blocks until every client finished its last request."""
        self.t0 = time.time()
        threads = [threading.Thread(target=self._client, args=(i,), name=f"demo-client-{i}", daemon=True)
                   for i in range(self.clients)]
        for i, t in enumerate(threads):
            t.start()
            self.stop.wait(min(1.0, self.think_s))  # stagger the clients a little
        for t in threads:
            t.join()

    def elapsed(self) -> float:
        return time.time() - self.t0

    def phase_at(self, t: float) -> Optional[int]:
        return next((i for i, p in enumerate(self.phases) if p.start_s <= t < p.end_s), None)

    def _client(self, client_id: int) -> None:
        import openai

        client = openai.OpenAI(base_url=self.endpoint, api_key=self.api_key, max_retries=0, timeout=900)
        place: Optional[SessionTurns] = None  # this client's long session, turn by turn
        toolbox = agent.Toolbox(self.passages)  # agent domains: this client's tools (its own memory)
        task: Optional[Prompt] = None  # agent domains: the next turn of this client's task
        while not self.stop.is_set():
            started = self.elapsed()
            phase = self.phase_at(started)
            if phase is None:
                return
            with self._lock:
                index, self._count = self._count, self._count + 1
            domain = self.phases[phase].domain
            if domain == SESSIONS:
                if place is None or place.done():
                    place = SessionTurns.start(self.prompts.take(SESSIONS))
                prompt = place.prompt()
            elif domain in agent.TOOL_DOMAINS:
                if task is None or task.domain != domain:  # a task does not cross the drift: its tools changed
                    task = first_turn(self.prompts.take(domain), self.max_tokens)
                prompt = task
            else:
                prompt = self.prompts.take(domain)
            result = self._send(client, client_id, index, phase, started, prompt)
            if domain == SESSIONS:
                place = place.after(prompt, result)
            elif domain in agent.TOOL_DOMAINS:
                task = next_turn(prompt, result, toolbox, self.max_tokens)
            self.on_result(result)
            if self.think_s:
                self.stop.wait(self.think_s)

    def _send(self, client, client_id: int, index: int, phase: int, started: float, prompt: Prompt) -> RequestResult:
        base = dict(index=index, client=client_id, domain=prompt.domain, phase=phase, started_s=started, prompt=prompt)
        try:
            resp = client.chat.completions.create(**prompt.chat_body(self.model, self.max_tokens),
                                                  metadata={"domain": prompt.domain})
        except Exception as e:  # noqa: BLE001 - every failure is counted and reported, never raised
            return RequestResult(**base, finished_s=self.elapsed(), ok=False, error=f"{type(e).__name__}: {e}"[:300])
        spec = getattr(resp, "adaptive_eagle", None) or {}
        message = resp.choices[0].message if resp.choices else None
        text = message.content if message is not None else None
        calls = tuple((c.id, c.function.name, c.function.arguments) for c in (message.tool_calls or [])) \
            if message else ()
        if prompt.tools:
            text = agent.canonical(text, [(name, args) for _, name, args in calls])
        tokens = resp.usage.completion_tokens if resp.usage else 0
        ok, error = bool(text) and tokens > 0 and bool(spec), ""
        if not ok:
            error = "empty completion" if not text else "no adaptive_eagle metrics in the response"
        return RequestResult(**base, finished_s=self.elapsed(), ok=ok, error=error, request_id=resp.id,
                             text=text or "", completion_tokens=tokens, head_version=str(spec.get("head_version", "")),
                             accept_length=float(spec.get("accept_length", 0.0)),
                             verify_steps=int(spec.get("verify_steps", 0)),
                             tokens_per_s=float(spec.get("tokens_per_s", 0.0)), captured=str(spec.get("captured", "")),
                             by_context=tuple((str(b), int(n), int(a)) for b, n, a in spec.get("by_context") or ()),
                             arm=str(spec.get("arm", "served")), tpot_s=float(spec.get("tpot_s", 0.0)),
                             tool_calls=calls)


def first_turn(entry: Prompt, max_tokens: int) -> Prompt:
    """An agent task's first request: the task, the domain's tools, exactly one call required (no parallel calls:
    a task is one call and its result)."""
    turn = agent.first_turn(entry.messages[-1]["content"], entry.domain, max_tokens)
    return Prompt(turn.messages, entry.domain, tools=turn.tools, tool_choice=turn.tool_choice,
                  parallel_tool_calls=False, max_tokens=turn.max_tokens)


def next_turn(sent: Prompt, answer: RequestResult, toolbox: agent.Toolbox, max_tokens: int) -> Optional[Prompt]:
    """The request after `sent` in its agent task: the calls run and their results sent back (tool_choice auto);
    None when the task is over (the answer was the second turn's, failed, or called nothing)."""
    if sent.tool_choice != "required" or not answer.ok or not answer.tool_calls:
        return None
    turn = agent.second_turn(sent.messages, sent.tools, answer.tool_calls, toolbox, max_tokens)
    return Prompt(turn.messages, sent.domain, tools=turn.tools, tool_choice=turn.tool_choice)


__all__ = ["Prompt", "PromptCycle", "RequestResult", "SESSIONS", "SessionTurns", "Traffic", "bench_module", "first_turn",
           "jsonl_pools", "next_turn", "search_passages", "session_pool", "sharegpt_pools"]
