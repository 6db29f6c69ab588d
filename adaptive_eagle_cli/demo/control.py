"""The control run: the same traffic scored for the frozen shipped head, and the lossless check.

Owns, all in the demo's own process on its own copy of the target (the replica's target, same build):
- `FrozenDecoder`: every k-th request decoded again with the frozen head, interleaved with the live
  traffic (so both see the same machine load), through the same DecodeServer path a replica uses —
  its tokens/s and its text (greedy: it must equal the served text);
- `replay_frozen`: acceptance replay (trainer.replay) of the frozen head on the captured records of
  every request — exact for greedy traffic with the demo's engine settings (config.py);
- `greedy_checks`: a sample of responses decoded again with plain greedy decoding (no head at all);
  the text must be identical.
Must not touch: the stack, the registry's champion, the store's contents (read-only scan).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

from adaptive_eagle_cli.demo.config import MAX_PROMPT_TOKENS
from adaptive_eagle_cli.demo.traffic import RequestResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControlSample:
    request_id: str
    domain: str
    phase: int
    finished_s: float  # when the live request finished (its place on the timeline)
    tokens_per_s: float
    accept_length: float
    same_text: bool  # the frozen head's greedy output equals what the stack served


@dataclass(frozen=True)
class GreedyCheck:
    request_id: str
    domain: str
    equal: bool
    first_difference: Optional[int]  # character index, None when equal


def decode_server(target, head, engine_params: dict, max_prompt_tokens: int = MAX_PROMPT_TOKENS):
    """A DecodeServer like a replica's (no capture, no store) over `head` (a LoadedHead or None: plain)."""
    from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
    from serving.backend import ReferenceBackend
    from serving.server import DecodeServer

    config = EngineConfig(**engine_params) if head is not None else EngineConfig.plain()
    engine = SpeculativeEngine(target, head, config, head_version=head.meta.version if head is not None else None)
    return DecodeServer(ReferenceBackend(engine, None, max_prompt_tokens), name="demo-control")


def decode_again(server, result: RequestResult, max_tokens: int, tag: str):
    """`result`'s request decoded by `server`: (serving.messages.Finished or Refused, the answer's text as
    `result.text` holds it). A request with tools is read by the gateway's own parser (its tools carried, a
    required call's grammar) and its answer put in agent.canonical form."""
    from serving.messages import DecodeRequest

    rid = f"{tag}-{result.request_id}"
    if not result.prompt.tools:
        finished = server.generate(DecodeRequest(request_id=rid, messages=result.prompt.messages,
                                                 max_tokens=max_tokens, domain=result.domain, capture=False))
        return finished, getattr(finished, "text", "")
    from adaptive_eagle_cli.demo.agent import canonical
    from serving import tools
    from serving.openai_api import parse_chat

    body = result.prompt.chat_body("control", max_tokens)
    parsed, request = parse_chat(body, body["max_tokens"], max_tokens)
    finished = server.generate(request.model_copy(update={"request_id": rid, "domain": result.domain,
                                                          "capture": False}))
    content, calls = tools.parse(getattr(finished, "text", ""), parsed._tools)
    return finished, canonical(content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls])


class FrozenDecoder:
    """Decodes every k-th successful live request with the frozen head on a thread of its own."""

    def __init__(self, server, every: int, max_tokens: int) -> None:
        self.server, self.every, self.max_tokens = server, every, max_tokens
        self.samples: list[ControlSample] = []
        self.errors: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._seen = 0
        self._thread = threading.Thread(target=self._loop, name="demo-frozen", daemon=True)
        self._thread.start()

    def offer(self, result: RequestResult) -> None:
        if not result.ok:
            return
        self._seen += 1
        if self._seen % self.every == 1 or self.every == 1:
            self._queue.put(result)

    def close(self, timeout_s: float = 120.0) -> None:
        """Finish what is queued (bounded by timeout_s), then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while (result := self._queue.get()) is not None:
            try:
                finished, text = decode_again(self.server, result, self.max_tokens, "frozen")
                spec = finished.spec  # a Refused has none: caught below and reported
                self.samples.append(ControlSample(result.request_id, result.domain, result.phase, result.finished_s,
                                                  spec.tokens_per_s, spec.accept_length, text == result.text))
            except Exception as e:  # noqa: BLE001 - the control run reports its own failures
                self.errors.append(f"{result.request_id}: {type(e).__name__}: {e}")
                log.exception("frozen control decode failed")


@dataclass(frozen=True)
class StepCounts:
    """One request's draft tokens accepted per verify step: as served (its captured trace) and as the frozen
    head would have accepted them (acceptance replay on the same record)."""

    served: tuple[int, ...]
    frozen: tuple[int, ...]

    @staticmethod
    def accept_length(accepted: Sequence[int]) -> Optional[float]:
        """Tokens per verify step, bonus included, over every step but the last: the engine's last step may
        accept past max_tokens (cut afterwards), which a replay of the record cannot see; the other steps
        of the same head replay exactly. None with fewer than two steps."""
        return 1.0 + sum(accepted[:-1]) / (len(accepted) - 1) if len(accepted) > 1 else None


def replay_frozen(store_config, results: Sequence[RequestResult], target, head, engine_params: dict) -> dict:
    """request_id -> StepCounts: each request's captured trace, and the frozen head replayed on it."""
    from feature_store.reader import RecordFilter, scan_records
    from trainer.replay import TreeParams, replay_heads

    wanted = {r.request_id for r in results if r.ok}
    records = scan_records(store_config, RecordFilter()).records
    records = {r.request_id: r for r in records if r.request_id in wanted}
    tree = TreeParams(engine_params["depth"], engine_params["topk"], engine_params["num_draft_tokens"])
    # the store keeps hidden states with a lossy codec (int8 blocks); one target prefill per record gives
    # float32 features like the ones the engine drafted from, so near-ties fall the same way
    report = replay_heads({"frozen": head.head.float().eval()}, [r.without_hidden() for r in records.values()],
                          target, tree)
    return {rep.request_id: StepCounts(tuple(s.accept_length for s in records[rep.request_id].steps), rep.accepted)
            for rep in report.scores["frozen"].records}


def greedy_checks(server, results: Sequence[RequestResult], n: int, max_tokens: int) -> list[GreedyCheck]:
    """`n` successful responses, spread evenly over the run, decoded again with plain greedy decoding."""
    ok = [r for r in results if r.ok]
    if not ok or n == 0:
        return []
    picks = sorted({round(i * (len(ok) - 1) / max(1, n - 1)) for i in range(min(n, len(ok)))})
    out = []
    for i in picks:
        r = ok[i]
        text = decode_again(server, r, max_tokens, "plain")[1]
        diff = next((k for k, (a, b) in enumerate(zip(text, r.text)) if a != b), None)
        if diff is None and len(text) != len(r.text):
            diff = min(len(text), len(r.text))
        out.append(GreedyCheck(r.request_id, r.domain, diff is None, diff))
    return out


__all__ = ["ControlSample", "FrozenDecoder", "GreedyCheck", "StepCounts", "decode_again", "decode_server", "greedy_checks",
           "replay_frozen"]
