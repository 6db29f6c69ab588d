"""The reference decoding engine: EAGLE-3 speculative decoding, batch 1, lossless.

Owns: one request's decode loop as named steps — prefill → (draft → verify → accept → capture)*
— over a target KV cache and the draft head's KV cache, stop conditions, traces and hidden-state
capture. Must not touch: networking, the feature store, training. `head=None` runs plain decoding
through the same loop (an empty tree each step), for baselines.

Positions. After a step, the target cache holds every committed token except the newest one (the
bonus token, the tree's root). The head at position t reads (target aux feature of t, token t+1),
so its cache holds one entry per committed position whose feature is known; a draft node at depth
d sits at root_position - 1 + d in the head and at root_position + d in the target.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from adaptive_eagle.costmodel import AcceptCalibration, VerifyCost, best_prefix, min_useful_prob
from adaptive_eagle.draft_head import DraftKVCache, Eagle3DraftHead
from adaptive_eagle.targets import Target
from adaptive_eagle.trace import SamplingParams, TraceRecord, VerifyStep
from adaptive_eagle.lookup import BudgetSplit, suffix_match_continuation
from adaptive_eagle.tree import (DraftTree, build_tree, chain_tree, merge_trees, subset_tree, tree_attention_mask,
                                 tree_position_ids)
from adaptive_eagle.verify import VerifyResult, sampling_probs, verify_greedy, verify_sampling

LOOKUP_SURE = 0.8  # calibrated acceptance of the first lookup token above which the head does not expand
EMPTY_TREE = DraftTree(*(torch.zeros(0, dtype=torch.long) for _ in range(3)), torch.zeros(0), torch.zeros(0))


class GenerationError(ValueError):
    """A request the engine refuses (bad prompt, limits, head/target mismatch)."""


@dataclass(frozen=True)
class EngineConfig:
    depth: int = 5  # draft steps per tree
    topk: int = 4  # children per expanded node, and frontier width
    num_draft_tokens: int = 16  # nodes kept per tree (verified in one target forward)
    min_path_prob: float = 0.02  # stop drafting deeper once every frontier path is less likely than this
    prompt_lookup: bool = True  # merge suffix-match continuations from the request's context
    lookup_max_tokens: int = 16
    lookup_min_ngram: int = 2
    # verify only the part of each tree that pays for itself on this machine (costmodel.py): the
    # target's forward cost by size is measured when the engine starts and followed online
    cost_aware: bool = True

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1 or self.num_draft_tokens < 1:
            raise ValueError("depth, topk and num_draft_tokens must be >= 1")
        if self.lookup_max_tokens < 0 or self.lookup_min_ngram < 1:
            raise ValueError("lookup_max_tokens must be >= 0 and lookup_min_ngram >= 1")


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    trace: TraceRecord
    elapsed_s: float
    steps: list[VerifyStep] = field(default_factory=list)

    @property
    def accept_length_mean(self) -> float:
        return self.trace.accept_length_mean

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


class _HeadFeed:
    """The draft head's view of one request: its KV cache plus committed positions not yet fed
    (tokens and target features), fed in one head call when the head next drafts."""

    def __init__(self, engine: "SpeculativeEngine", cache: DraftKVCache) -> None:
        self.engine, self.cache = engine, cache
        self.tokens: list[int] = []
        self.aux: list[torch.Tensor] = []
        self.start = 0
        self.last: tuple | None = None  # (root hidden, root log-probs) after the last feed

    def add(self, tokens: list[int], aux: torch.Tensor, start_pos: int) -> None:
        if not self.tokens:
            self.start = start_pos
        self.tokens += tokens
        self.aux.append(aux)

    def root(self) -> tuple:
        if self.tokens:
            self.last = self.engine._head_extend(self.cache, self.tokens, torch.cat(self.aux), self.start)
            self.tokens, self.aux = [], []
        return self.last


class SpeculativeEngine:
    def __init__(self, target: Target, head: Eagle3DraftHead | None = None, config: EngineConfig | None = None,
                 head_version: str | None = None) -> None:
        self.target, self.head, self.config = target, head, config or EngineConfig()
        self.head_version = head_version if head is not None else None
        self.device = target.device
        if head is not None:
            c = head.cfg
            if c.vocab_size != target.config.vocab_size or c.target_hidden_size != target.config.hidden_size:
                raise GenerationError(
                    f"head was built for a target with vocab {c.vocab_size} / hidden {c.target_hidden_size}; this "
                    f"target has vocab {target.config.vocab_size} / hidden {target.config.hidden_size}")
            if tuple(c.aux_layer_ids) != tuple(target.aux_layer_ids):
                raise GenerationError(f"head aux layers {c.aux_layer_ids} != target aux layers {target.aux_layer_ids}")
            self.head = head.to(self.device).eval()
            if target.compute.endswith("fp16-weights"):  # the target's fast CPU path: the head takes it too
                import copy

                from adaptive_eagle.cpu_linear import pack_linears

                self.head = copy.deepcopy(self.head).float()
                pack_linears(self.head)
        self._cache_kw = _cache_kwarg(target.model)
        self.verify_cost, self.calibration = VerifyCost(), AcceptCalibration()
        self.overhead_ms = 0.0  # moving average of a step's time outside the verify forward (drafting, upkeep)
        self.rate = float("nan")  # moving average of committed tokens per ms
        if self.config.cost_aware and (head is not None or self.config.prompt_lookup):
            self.calibrate()
        eos = getattr(target.model.generation_config, "eos_token_id", None) or target.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        tok = target.tokenizer
        if tok is not None and tok.eos_token is not None:
            self.eos_ids.add(tok.convert_tokens_to_ids(tok.eos_token))

    # ---- inputs ---------------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        """A prompt as text (chat-templated as one user turn), chat messages, or token ids."""
        tok = self.target.tokenizer
        if isinstance(prompt, str):
            if not prompt.strip():
                raise GenerationError("empty prompt")
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if tok is None:
                raise GenerationError("this target has no tokenizer: pass token ids")
            out = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return [int(t) for t in ids]
        ids = [int(t) for t in prompt]
        if not ids:
            raise GenerationError("empty prompt")
        if any(t < 0 or t >= self.target.config.vocab_size for t in ids):
            raise GenerationError("prompt token id outside the target's vocabulary")
        return ids

    def _check_limits(self, n_prompt: int, sampling: SamplingParams) -> None:
        limit = self.target.config.max_position_embeddings
        if n_prompt >= limit:
            raise GenerationError(f"prompt has {n_prompt} tokens; the target's context is {limit}")
        lookahead = max(self.config.depth, self.config.lookup_max_tokens if self.config.prompt_lookup else 0) + 1
        if n_prompt + sampling.max_tokens + lookahead > limit:
            raise GenerationError(
                f"prompt ({n_prompt}) + max_tokens ({sampling.max_tokens}) exceeds the context ({limit})")

    # ---- cost model -----------------------------------------------------------------------------
    @torch.inference_mode()
    def calibrate(self, prefix: int = 64, reps: int = 2) -> dict[int, float]:
        """Time target forwards of 1, 2, 4, ... tokens over a `prefix`-token cache (best of `reps`)
        and seed the verify-cost model with them; returns {tokens: ms}."""
        from transformers import DynamicCache

        cfg = self.config
        top = max(cfg.num_draft_tokens, cfg.lookup_max_tokens if cfg.prompt_lookup else 0) + 1
        sizes = sorted({1, top} | {q for q in (2, 4, 8, 16, 32, 64) if q < top})
        vocab = self.target.config.vocab_size
        prefix = max(1, min(prefix, self.target.config.max_position_embeddings - top - 1))
        ids = [(7 * i + 3) % vocab for i in range(prefix + top)]
        cache = DynamicCache()
        self._target_forward(ids[:prefix], cache, torch.arange(prefix), None)
        for _ in range(2):  # warm up kernels and allocator at the largest size
            self._target_forward(ids[prefix:], cache, torch.arange(prefix, prefix + top), None)
            self._keep_cache(cache, torch.arange(prefix, device=self.device))
        measured = {}
        for q in sizes:
            best = float("inf")
            for _ in range(reps + 1):  # the first run warms up
                t0 = time.perf_counter()
                self._target_forward(ids[prefix : prefix + q], cache, torch.arange(prefix, prefix + q), None)
                self._sync()
                best = min(best, (time.perf_counter() - t0) * 1e3)
                self._keep_cache(cache, torch.arange(prefix, device=self.device))
            measured[q] = best
            self.verify_cost.points[q] = best
        return measured

    def _timed(self, t_step: float, t_verify: float, t_done: float, q: int, committed: int, decay: float = 0.9) -> None:
        """Follow this machine's costs: the verify forward of q tokens; everything else in the step
        (drafting, acceptance, cache upkeep, feeding the head) as the step's fixed cost; the rate."""
        now = self._clock()
        forward, step = (t_done - t_verify) * 1e3, (now - t_step) * 1e3
        self.verify_cost.observe(q, forward)
        fixed = step - forward
        self.overhead_ms = decay * self.overhead_ms + (1 - decay) * fixed if self.overhead_ms else fixed
        rate = committed / max(1e-6, step)
        self.rate = rate if not math.isfinite(self.rate) else decay * self.rate + (1 - decay) * rate

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _clock(self) -> float:
        self._sync()
        return time.perf_counter()

    def _accept_estimates(self, tree: DraftTree, eagle_paths: set, lookup: list[int]) -> torch.Tensor:
        """[N] estimated acceptance of each node from the calibrated draft path probability (EAGLE
        nodes) and the measured per-token lookup acceptance (nodes on the lookup chain)."""
        eagle = self.calibration.eagle(tree.scores.exp()) if eagle_paths else torch.zeros(tree.size)
        est = torch.zeros(tree.size)
        for i, path in enumerate(tree.token_paths):
            a = float(eagle[i]) if path in eagle_paths else 0.0
            if lookup[: len(path)] == list(path):
                a = max(a, self.calibration.lookup(len(path)))
            est[i] = a
        return est

    # ---- target ---------------------------------------------------------------------------------
    def _target_forward(self, ids: list[int], cache, positions: torch.Tensor, mask: torch.Tensor | None,
                        aux: bool = True):
        """(logits [Q, V], aux features [Q, n_aux * H] or None when aux=False)."""
        x = torch.tensor([ids], device=self.device)
        kw = {self._cache_kw: cache, "use_cache": True, "output_hidden_states": aux,
              "position_ids": positions[None].to(self.device)}
        if mask is not None:
            kw["attention_mask"] = mask.to(self.device)
        out = self.target.model(input_ids=x, **kw)
        if not aux:
            return out.logits[0], None
        hs = out.hidden_states
        return out.logits[0], torch.cat([hs[k] for k in self.target.aux_layer_ids], dim=-1)[0]

    @staticmethod
    def _keep_cache(cache, keep: torch.Tensor) -> None:
        """Keep only the rows `keep` (ascending) of every layer's keys and values (the accepted path)."""
        if int(keep[-1]) == keep.numel() - 1:  # a prefix: slice, no copy
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[..., : keep.numel(), :], layer.values[..., : keep.numel(), :]
            return
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)

    # ---- draft head -----------------------------------------------------------------------------
    def _head_extend(self, hcache: DraftKVCache, tokens: list[int], aux: torch.Tensor, start_pos: int) -> tuple:
        """Feed committed positions start_pos.. (aux features + next tokens) to the head; returns the
        last position's output hidden [H] and draft-vocab log-probs [Vd]."""
        head = self.head
        ids = torch.tensor([tokens], device=self.device)
        pos = torch.arange(start_pos, start_pos + len(tokens), device=self.device)[None]
        last = torch.zeros(1, len(tokens), dtype=torch.bool, device=self.device)
        last[0, -1] = True  # only the newest position drafts: no LM head over the rest (e.g. the prompt)
        out = head.step(ids, aux[None].to(head.dtype), pos, hcache.attend_fn(), logits_rows=last)
        return out.hidden[0, -1], torch.log_softmax(out.logits[-1].float(), -1)

    def _draft(self, hcache: DraftKVCache, root_hidden, root_logprobs, root_pos: int, budget: int,
               min_path_prob: float, depth: int) -> DraftTree:
        """Build the dynamic tree with the head; leaves the head cache as it found it."""
        head, cfg = self.head, self.config
        committed = hcache.length
        slot: dict[int, int] = {}  # candidate id -> head cache row
        hidden: dict[int, torch.Tensor] = {-1: root_hidden}  # candidate id -> its output hidden
        ancestors: dict[int, list[int]] = {-1: []}  # candidate id -> cache rows of itself + ancestors
        d2t = head.draft_to_target

        def expand(tokens, node_ids, parent_ids):
            k = tokens.numel()
            draft_tok = tokens  # draft ids while building; mapped to target ids below
            hid = torch.stack([hidden[int(p)] for p in parent_ids])[None]  # [1, k, H]
            depth = len(ancestors[int(parent_ids[0])]) + 1
            pos = torch.full((1, k), root_pos - 1 + depth, device=self.device)
            total = hcache.length + k
            mask = torch.full((1, 1, k, total), float("-inf"), device=self.device)
            mask[..., :committed] = 0
            for r, (n, p) in enumerate(zip(node_ids.tolist(), parent_ids.tolist())):
                rows = ancestors[p] + [hcache.length + r]
                mask[0, 0, r, rows] = 0
                slot[n] = hcache.length + r
                ancestors[n] = rows
            out = head.step(d2t[draft_tok][None], hid, pos, hcache.attend_fn(mask), logits_rows=True)
            for r, n in enumerate(node_ids.tolist()):
                hidden[n] = out.hidden[0, r]
            return torch.log_softmax(out.logits[0].float(), -1)

        min_score = math.log(min_path_prob) if min_path_prob > 0 else float("-inf")
        tree = build_tree(root_logprobs, expand, depth, cfg.topk, budget, min_score)
        hcache.crop(committed)
        return DraftTree(d2t[tree.tokens], tree.parents, tree.depths, tree.scores, tree.logprobs)

    # ---- proposals: EAGLE tree + model-free chain ------------------------------------------------
    def _propose(self, context: list[int], feed: "_HeadFeed | None", root_pos: int, split: BudgetSplit):
        """The draft tree for this step and, per node, whether the EAGLE tree / the lookup chain
        proposed it: (tree, (eagle_paths, lookup_tokens))."""
        cfg = self.config
        budget = cfg.num_draft_tokens
        cont = []
        if cfg.prompt_lookup and cfg.lookup_max_tokens:
            cont = suffix_match_continuation(context, min(cfg.lookup_max_tokens, budget), cfg.lookup_min_ngram)
        # when the lookup chain is a safe bet (the request is copying), the head would rarely add a
        # token: verify the chain alone and leave the head's features pending (fed in one call later)
        sure = cfg.cost_aware and len(cont) >= 2 and self.calibration.lookup(1) >= LOOKUP_SURE
        if feed is None or sure:
            tree, sources = (chain_tree(cont) if cont else EMPTY_TREE), (set(), cont)
        else:
            n_lookup = split.lookup_nodes(budget, len(cont))
            min_prob = cfg.min_path_prob
            if cfg.cost_aware:  # 0 until a rate has been measured
                min_prob = max(min_prob, min_useful_prob(self.verify_cost, budget, self.rate))
            root_hidden, root_lp = feed.root()
            eagle = self._draft(feed.cache, root_hidden, root_lp, root_pos, max(1, budget - n_lookup), min_prob,
                                cfg.depth)
            eagle_paths = set(eagle.token_paths)
            lookup = cont[:n_lookup]
            tree = merge_trees(eagle, chain_tree(lookup), budget) if lookup else eagle
            sources = (eagle_paths, lookup)
        if cfg.cost_aware and tree.size:
            est = self._accept_estimates(tree, *sources)
            keep = best_prefix(est, tree.parents, tree.depths, self.verify_cost, self.overhead_ms)
            if len(keep) < tree.size:
                tree = subset_tree(tree, keep)
                kept = set(tree.token_paths)
                lookup = sources[1]
                n = 0
                while n < len(lookup) and tuple(lookup[: n + 1]) in kept:
                    n += 1
                sources = (sources[0], lookup[:n])
        return tree, sources

    def _account(self, split: BudgetSplit, tree: DraftTree, sources, res: VerifyResult) -> None:
        """What each source got accepted: feeds the budget split and (cost-aware) the calibration."""
        eagle_paths, lookup = sources
        accepted = list(res.tokens[: res.accept_length])
        by_lookup = 0
        while by_lookup < min(len(lookup), len(accepted)) and lookup[by_lookup] == accepted[by_lookup]:
            by_lookup += 1
        by_eagle = sum(1 for k in range(1, len(accepted) + 1) if tuple(accepted[:k]) in eagle_paths)
        split.update(len(lookup), by_lookup, len(eagle_paths), by_eagle)
        if self.config.cost_aware and tree.size:
            taken = set(res.accepted_nodes)
            eagle_nodes = [i for i, path in enumerate(tree.token_paths) if path in eagle_paths]
            self.calibration.observe_eagle([math.exp(float(tree.scores[i])) for i in eagle_nodes],
                                           [i in taken for i in eagle_nodes])
            self.calibration.observe_lookup(len(lookup), by_lookup)

    # ---- the loop --------------------------------------------------------------------------------
    @torch.inference_mode()
    def stream(self, prompt, sampling: SamplingParams | None = None, stop: list[str] | None = None,
               capture: bool = False, request_id: str = "req", generator: torch.Generator | None = None
               ) -> Iterator[tuple[list[int], GenerationResult | None]]:
        """Yields (new token ids, None) per verify step, then ([], GenerationResult) once."""
        sampling = sampling or SamplingParams()
        prompt_ids = self.encode(prompt)
        self._check_limits(len(prompt_ids), sampling)
        t0 = time.perf_counter()
        from transformers import DynamicCache

        cache = DynamicCache()
        n = len(prompt_ids)
        need_aux = capture or self.head is not None  # plain decoding without capture skips them
        logits, aux = self._target_forward(prompt_ids, cache, torch.arange(n), None, need_aux)
        captured = [aux.float().cpu()] if capture else []
        first = self._sample_row(logits[-1:], sampling, generator)
        generated: list[int] = [first]
        steps: list[VerifyStep] = []
        feed = None
        split = BudgetSplit()
        if self.head is not None:
            feed = _HeadFeed(self, DraftKVCache.empty(self.head.cfg, 1, n + 64, self.head.dtype, self.device))
            feed.add(prompt_ids[1:] + [first], aux, 0)
        visible, finish = self._cut(generated, sampling, stop)
        emitted = 0
        while True:
            if len(visible) > emitted:
                yield visible[emitted:], None
                emitted = len(visible)
            if finish is not None:
                break
            root_pos = n + len(generated) - 1  # position of the root (newest, uncached) token
            t_step = time.perf_counter()
            tree, sources = self._propose(prompt_ids + generated, feed, root_pos, split)
            t_verify = time.perf_counter()
            mask = tree_attention_mask(tree, root_pos, self.target.dtype) if tree.size else None
            logits, aux = self._target_forward([generated[-1]] + tree.tokens.tolist(), cache,
                                               tree_position_ids(tree, root_pos), mask, need_aux)
            t_done = self._clock() if self.config.cost_aware else 0.0
            res = self._verify(tree, logits, sampling, generator)
            self._account(split, tree, sources, res)
            rows = torch.tensor([0] + [i + 1 for i in res.accepted_nodes], device=self.device)
            self._keep_cache(cache, torch.cat([torch.arange(root_pos, device=self.device), root_pos + rows]))
            new = list(res.tokens)
            steps.append(VerifyStep(tree.size, res.accept_length, res.accept_length, res.rejected_token,
                                    res.rejected_draft_prob, res.rejected_target_prob))
            if capture:
                captured.append(aux.index_select(0, rows).float().cpu())
            if feed is not None:
                feed.add(new, aux.index_select(0, rows), root_pos)
            generated.extend(new)
            if self.config.cost_aware:
                self._timed(t_step, t_verify, t_done, tree.size + 1, len(new))
            visible, finish = self._cut(generated, sampling, stop)
        yield [], self._result(prompt_ids, visible, finish, steps, captured, sampling, request_id, t0)

    def generate(self, prompt, sampling: SamplingParams | None = None, stop: list[str] | None = None,
                 capture: bool = False, request_id: str = "req", generator: torch.Generator | None = None
                 ) -> GenerationResult:
        result = None
        for _, res in self.stream(prompt, sampling, stop, capture, request_id, generator):
            result = res or result
        return result

    def _sample_row(self, logits_row, sampling: SamplingParams, generator) -> int:
        if sampling.temperature == 0:
            return int(logits_row[-1].argmax())
        probs = sampling_probs(logits_row[-1:], sampling.temperature, sampling.top_p, sampling.top_k)
        return int(torch.multinomial(probs[0].cpu(), 1, generator=generator))

    def _verify(self, tree, logits, sampling: SamplingParams, generator) -> VerifyResult:
        if sampling.temperature == 0:
            return verify_greedy(tree, logits)
        probs = sampling_probs(logits, sampling.temperature, sampling.top_p, sampling.top_k)
        return verify_sampling(tree, probs, generator)

    # ---- stopping --------------------------------------------------------------------------------
    def _cut(self, generated: list[int], sampling: SamplingParams, stop) -> tuple[list[int], str | None]:
        """The tokens to emit and why decoding ends (None: go on). Cuts after the first EOS (kept),
        after the token that completes the first stop string (kept), or at max_tokens."""
        for i, t in enumerate(generated):
            if t in self.eos_ids:
                return generated[: i + 1], "stop"
        if stop and self.target.tokenizer is not None:
            for i in range(1, len(generated) + 1):
                if any(s in self.target.tokenizer.decode(generated[max(0, i - 64) : i]) for s in stop):
                    return generated[:i], "stop"
        if len(generated) >= sampling.max_tokens:
            return generated[: sampling.max_tokens], "length"
        return generated, None

    def _result(self, prompt_ids, generated, finish, steps, captured, sampling, request_id, t0) -> GenerationResult:
        tok = self.target.tokenizer
        text = ""
        if tok is not None:
            body = [t for t in generated if t not in self.eos_ids]
            text = tok.decode(body, skip_special_tokens=True)
        ids = prompt_ids + generated
        aux = None
        if captured:
            aux = torch.cat(captured)[: len(ids)].numpy().astype(np.float32)
        trace = TraceRecord(
            request_id=request_id, target_fingerprint=self.target.fingerprint, head_version=self.head_version,
            backend="reference", input_ids=tuple(ids), loss_mask=tuple([0] * len(prompt_ids) + [1] * len(generated)),
            steps=tuple(steps), sampling=sampling, aux_hidden=aux,
            aux_layer_ids=tuple(self.target.aux_layer_ids) if aux is not None else (),
        )
        return GenerationResult(text, generated, finish, trace, time.perf_counter() - t0, steps)
