"""The reference decoding engine: EAGLE-3 speculative decoding, batch 1, lossless.

Owns: one request's decode loop as named steps — prefill → (draft → verify → accept → capture)*
— over a target KV cache and the draft head's KV cache, stop conditions, traces and hidden-state
capture. Must not touch: networking, the feature store, training. `head=None` runs plain decoding
through the same loop (an empty tree each step), for baselines.

Positions. After a step, the target cache holds every committed token except the newest one (the
bonus token, the tree's root). The head at position t reads (target aux feature of t, token t+1),
so its cache holds one entry per committed position whose feature is known; a draft node at depth
d sits at root_position - 1 + d in the head and at root_position + d in the target.

Head binding. A request reads the engine's `HeadBinding` (head, version, calibration) once, when it
starts, and finishes on it; `set_head` prepares a new head off the decode path and flips the
binding for the requests that start after it (binding.py).
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from adaptive_eagle.binding import (CalibrationStore, HeadBinding, HeadRefused, SwapResult, make_binding)
from adaptive_eagle.costmodel import PinnedCosts, VerifyCost, best_prefix, min_useful_prob
from adaptive_eagle.draft_head import Eagle3DraftHead
from adaptive_eagle.drafting import HeadFeed, draft_tree
from adaptive_eagle.lookup import BudgetSplit, suffix_match_continuation
from adaptive_eagle.suffix_index import SuffixIndex, SuffixIndexConfig
from adaptive_eagle.targets import Target, cache_dir
from adaptive_eagle.trace import SamplingParams, TraceRecord, VerifyStep
from adaptive_eagle.tree import (DraftTree, chain_tree, merge_trees, subset_tree, tree_attention_mask,
                                 tree_position_ids)
from adaptive_eagle.verify import VerifyResult, sampling_probs, verify_greedy, verify_sampling

LOOKUP_SURE = 0.8  # calibrated acceptance of a model-free first token above which the head does not expand
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
    # charge these costs instead of timing this machine: drafting decisions that depend on acceptance
    # alone, the same on any machine and under any load (tests, paired benchmarks); None: measure
    pinned_costs: PinnedCosts | None = None
    # merge continuations of recently served outputs (cross-request suffix index, same tenant when
    # the index isolates tenants); the index is updated when a request finishes
    suffix_drafting: bool = True
    # where acceptance calibrations persist per (head version, target, compute mode); None: the
    # cache dir's calibration/; "" disables persistence
    calibration_dir: str | None = None

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1 or self.num_draft_tokens < 1:
            raise ValueError("depth, topk and num_draft_tokens must be >= 1")
        if self.lookup_max_tokens < 0 or self.lookup_min_ngram < 1:
            raise ValueError("lookup_max_tokens must be >= 0 and lookup_min_ngram >= 1")
        if isinstance(self.pinned_costs, dict):  # from a config file or a pydantic dump
            object.__setattr__(self, "pinned_costs", PinnedCosts(**self.pinned_costs))
        if self.pinned_costs is not None and not isinstance(self.pinned_costs, PinnedCosts):
            raise ValueError(f"pinned_costs must be a PinnedCosts or None, not {type(self.pinned_costs).__name__}")


    @classmethod
    def plain(cls) -> "EngineConfig":
        """Plain decoding: no drafting of any kind (for baselines)."""
        return cls(prompt_lookup=False, suffix_drafting=False)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    trace: TraceRecord
    elapsed_s: float
    steps: list[VerifyStep] = field(default_factory=list)

    @property
    def head_version(self) -> str | None:
        """The head this request was bound to (None: plain decoding)."""
        return self.trace.head_version

    @property
    def compute(self) -> str:
        """How the target ran, e.g. "float32" or "float32+fp16-weights"."""
        return self.trace.compute

    @property
    def lossless(self) -> str:
        """"exact", or "lossless up to bf16 rounding"."""
        return self.trace.lossless

    @property
    def accept_length_mean(self) -> float:
        return self.trace.accept_length_mean

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


@dataclass(frozen=True)
class Proposal:
    """One step's draft tree and which source proposed each path (for acceptance bookkeeping)."""

    tree: DraftTree
    eagle_paths: frozenset = frozenset()  # token paths the draft head proposed
    lookup: tuple[int, ...] = ()  # the prompt-lookup chain as offered (a prefix of the tree's paths)
    suffix: dict = field(default_factory=dict)  # token path -> empirical probability (suffix index)
    head_drafted: bool = False  # the head ran this step (its cost was paid even if the pruning kept none)

    def offered(self) -> dict[str, int]:
        return {"eagle": len(self.eagle_paths), "lookup": len(self.lookup), "suffix": len(self.suffix)}


class SpeculativeEngine:
    def __init__(self, target: Target, head=None, config: EngineConfig | None = None,
                 head_version: str | None = None, suffix_index: SuffixIndex | None = None) -> None:
        """head: an Eagle3DraftHead, a checkpoint.LoadedHead (its version and head.json calibration
        are used), or None for plain decoding. Raises GenerationError for a head that does not fit."""
        self.target, self.config = target, config or EngineConfig()
        self.device = target.device
        root = self.config.calibration_dir
        self.calibrations = CalibrationStore(None if root == "" else Path(root) if root else cache_dir() / "calibration")
        self.suffix_index = (suffix_index or SuffixIndex(SuffixIndexConfig())) if self.config.suffix_drafting else None
        self._cache_kw = _cache_kwarg(target.model)
        pinned = self.config.pinned_costs
        self.verify_cost = pinned.verify_cost() if pinned is not None else VerifyCost()
        # moving average of a step's time outside the verify forward (drafting, upkeep); fixed when pinned
        self.overhead_ms = pinned.overhead_ms if pinned is not None else 0.0
        self.rate = float("nan")  # moving average of committed tokens per ms
        head, version, metrics = _unpack_head(head, head_version)
        try:
            self._binding = make_binding(head, version, target, self.calibrations, metrics)
        except HeadRefused as e:
            raise GenerationError(str(e)) from None
        if self._needs_costs(self._binding):
            self.measure_verify_cost()
        eos = getattr(target.model.generation_config, "eos_token_id", None) or target.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        tok = target.tokenizer
        if tok is not None and tok.eos_token is not None:
            self.eos_ids.add(tok.convert_tokens_to_ids(tok.eos_token))

    # ---- the head binding -------------------------------------------------------------------------
    @property
    def binding(self) -> HeadBinding:
        return self._binding

    @property
    def head(self) -> Eagle3DraftHead | None:
        return self._binding.head

    @property
    def head_version(self) -> str | None:
        return self._binding.version

    @property
    def calibration(self):
        return self._binding.calibration

    def set_head(self, head, version: str | None = None, *, adopt: bool = False) -> SwapResult:
        """Hot swap: validate and prepare `head` (Eagle3DraftHead, LoadedHead or None = plain decoding)
        on the caller's thread, then flip the binding. Requests in flight finish on the head they
        started with; requests that start later use the new one. A refused head changes nothing.
        `head` may also be a HeadBinding this engine prepared earlier (`bind`, or one it served before):
        then the swap is the flip alone. `adopt`: the head is handed over and prepared in place (no copy)."""
        t0 = time.perf_counter()
        try:
            binding = head if isinstance(head, HeadBinding) else self.bind(head, version, adopt=adopt)
            if binding.compute != self.target.compute:
                raise GenerationError(f"the binding was prepared for compute {binding.compute!r}, this engine "
                                      f"runs {self.target.compute!r}")
        except GenerationError as e:
            ms = (time.perf_counter() - t0) * 1e3
            name = version or getattr(head, "version", None) or "head"
            return SwapResult(False, f"refused {name}: {e}; {self.head_version or 'plain decoding'} "
                                     "keeps serving", self.head_version, ms)
        # the verify-cost table, if still missing, is measured by the next request on the decode
        # thread: timing forwards here would run the target concurrently with a request in flight
        old, self._binding = self._binding, binding  # the flip: one reference assignment
        self.calibrations.save(old, self.target.fingerprint, force=True)
        ms = (time.perf_counter() - t0) * 1e3
        what = f"head {binding.version}" if binding.head is not None else "plain decoding"
        return SwapResult(True, f"{what} serving (calibration from {binding.calibration_source}); in-flight "
                                f"requests finish on {old.version or 'plain decoding'}", binding.version, ms)

    def bind(self, head, version: str | None = None, *, adopt: bool = False) -> HeadBinding:
        """Validate and prepare `head` (Eagle3DraftHead, LoadedHead or None) into a binding without installing
        it: a canary on one replica passes it to `stream(binding=...)` for its share of requests. `adopt`:
        the caller hands the head over, prepared in place instead of copied. Raises GenerationError naming
        why a head cannot draft for this target."""
        try:
            head, version, metrics = _unpack_head(head, version)
            return make_binding(head, version, self.target, self.calibrations, metrics, adopt)
        except HeadRefused as e:
            raise GenerationError(str(e)) from None

    def save_calibration(self) -> bool:
        """Persist the bound head's acceptance calibration now (also done as requests finish)."""
        return self.calibrations.save(self._binding, self.target.fingerprint, force=True)

    def _needs_costs(self, binding: HeadBinding) -> bool:
        cfg = self.config
        return cfg.cost_aware and cfg.pinned_costs is None and (
            binding.head is not None or cfg.prompt_lookup or cfg.suffix_drafting)

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

    def check_request(self, n_prompt: int, sampling: SamplingParams) -> None:
        """Raises GenerationError when a prompt of n_prompt tokens with these sampling params cannot be served
        (the target's context, with room for the last draft tree)."""
        limit = self.target.config.max_position_embeddings
        if n_prompt >= limit:
            raise GenerationError(f"prompt has {n_prompt} tokens; the target's context is {limit}")
        lookahead = self.config.num_draft_tokens + 1  # no draft path is longer than the tree's node budget
        if n_prompt + sampling.max_tokens + lookahead > limit:
            raise GenerationError(
                f"prompt ({n_prompt}) + max_tokens ({sampling.max_tokens}) exceeds the context ({limit})")

    # ---- cost model -----------------------------------------------------------------------------
    @torch.inference_mode()
    def measure_verify_cost(self, prefix: int = 64, reps: int = 2) -> dict[int, float]:
        """Time target forwards of 1, 2, 4, ... tokens over a `prefix`-token cache (best of `reps`)
        and seed the verify-cost model with them; returns {tokens: ms}."""
        from transformers import DynamicCache

        cfg = self.config
        top = cfg.num_draft_tokens + 1
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

    def _timed(self, t_step: float, t_verify: float, t_done: float, q: int, committed: int, decay: float = 0.9
               ) -> float:
        """Follow this machine's costs: the verify forward of q tokens; everything else in the step
        (drafting, acceptance, cache upkeep, feeding the head) as the step's fixed cost; the rate.
        Returns the step's ms. With pinned costs nothing is timed: the step is charged the pinned ones."""
        if self.config.pinned_costs is not None:
            step = self.verify_cost(q) + self.overhead_ms
        else:
            now = self._clock()
            forward, step = (t_done - t_verify) * 1e3, (now - t_step) * 1e3
            self.verify_cost.observe(q, forward)
            fixed = step - forward
            self.overhead_ms = decay * self.overhead_ms + (1 - decay) * fixed if self.overhead_ms else fixed
        rate = committed / max(1e-6, step)
        self.rate = rate if not math.isfinite(self.rate) else decay * self.rate + (1 - decay) * rate
        return step

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _clock(self) -> float:
        self._sync()
        return time.perf_counter()

    def _accept_estimates(self, binding: HeadBinding, p: Proposal) -> torch.Tensor:
        """[N] estimated acceptance of each node: the best of its sources' calibrated estimates (the
        draft's path probability for EAGLE nodes, the index's empirical probability for suffix
        nodes, the measured per-depth rate for the lookup chain)."""
        cal, tree = binding.calibration, p.tree
        eagle = cal.eagle(tree.scores.exp()) if p.eagle_paths else None
        suffix_paths = [path for path in tree.token_paths if path in p.suffix]
        suffix = dict(zip(suffix_paths, cal.suffix(torch.tensor([p.suffix[q] for q in suffix_paths])).tolist())) \
            if suffix_paths else {}
        lookup = list(p.lookup)
        est = torch.zeros(tree.size)
        for i, path in enumerate(tree.token_paths):
            a = float(eagle[i]) if eagle is not None and path in p.eagle_paths else 0.0
            a = max(a, suffix.get(path, 0.0))
            if lookup[: len(path)] == list(path):
                a = max(a, cal.lookup(len(path)))
            est[i] = a
        return est

    # ---- target ---------------------------------------------------------------------------------
    def _target_forward(self, ids: list[int], cache, positions: torch.Tensor, mask: torch.Tensor | None,
                        aux: bool = True, final: bool = False):
        """(logits [Q, V], aux features [Q, n_aux * H] or None when aux=False, final-norm hidden [Q, H] or
        None unless final=True: what capture stores so the trainer needs no target forward)."""
        x = torch.tensor([ids], device=self.device)
        kw = {self._cache_kw: cache, "use_cache": True, "output_hidden_states": aux or final,
              "position_ids": positions[None].to(self.device)}
        if mask is not None:
            kw["attention_mask"] = mask.to(self.device)
        out = self.target.model(input_ids=x, **kw)
        if not (aux or final):
            return out.logits[0], None, None
        hs = out.hidden_states
        feats = torch.cat([hs[k] for k in self.target.aux_layer_ids], dim=-1)[0] if aux else None
        return out.logits[0], feats, (hs[-1][0] if final else None)

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

    # ---- proposals: EAGLE tree + model-free drafts ------------------------------------------------
    def _model_free(self, context: list[int], tenant: str) -> tuple[list[int], DraftTree | None]:
        """The prompt-lookup chain (request's own context) and the suffix-index tree (recent outputs)."""
        cfg = self.config
        cont = []
        if cfg.prompt_lookup and cfg.lookup_max_tokens:
            cont = suffix_match_continuation(context, min(cfg.lookup_max_tokens, cfg.num_draft_tokens),
                                             cfg.lookup_min_ngram)
        suffix = None
        if self.suffix_index is not None:
            suffix = self.suffix_index.propose(context, cfg.num_draft_tokens, tenant)
            if suffix is not None and suffix.size == 0:
                suffix = None
        return cont, suffix

    def _propose(self, binding: HeadBinding, context: list[int], feed: "HeadFeed | None", root_pos: int,
                 split: BudgetSplit, tenant: str, head_ok: bool = True) -> Proposal:
        """This step's draft tree: the head's dynamic tree (unless `head_ok` is False: the gate found
        drafting with the head does not pay now), the lookup chain and the suffix-index tree merged,
        their node budget split by measured acceptance; then (cost-aware) the part that pays."""
        cfg, cal = self.config, binding.calibration
        budget = cfg.num_draft_tokens
        cont, suffix = self._model_free(context, tenant)
        # when a model-free draft is a safe bet (the request is copying, or repeating a served
        # output), the head would rarely add a token: verify those drafts alone and leave the head's
        # features pending (fed in one call later)
        sure = cfg.cost_aware and (
            (len(cont) >= 2 and cal.lookup(1) >= LOOKUP_SURE)
            or (suffix is not None and float(cal.suffix(suffix.scores[:1].exp())[0]) >= LOOKUP_SURE))
        alloc = split.allocate(budget, {"lookup": len(cont), "suffix": suffix.size if suffix is not None else 0})
        if feed is not None and not sure and head_ok:
            min_prob = cfg.min_path_prob
            if cfg.cost_aware:  # 0 until a rate has been measured
                min_prob = max(min_prob, min_useful_prob(self.verify_cost, budget, self.rate))
            tree = draft_tree(binding.head, feed.cache, feed.root(), root_pos, depth=cfg.depth, topk=cfg.topk,
                              budget=alloc["eagle"], min_path_prob=min_prob)
            eagle_paths, drafted = frozenset(tree.token_paths), True
        else:
            tree, eagle_paths, drafted = EMPTY_TREE, frozenset(), False
            alloc = {"lookup": len(cont), "suffix": budget}
        lookup = cont[: alloc.get("lookup", 0)]
        if lookup:
            tree = merge_trees(tree, chain_tree(lookup), budget) if tree.size else chain_tree(lookup)
        suffix_probs = {}
        if suffix is not None and alloc.get("suffix", 0):
            part = subset_tree(suffix, list(range(min(suffix.size, alloc["suffix"]))))
            suffix_probs = dict(zip(part.token_paths, part.scores.exp().tolist()))
            tree = merge_trees(tree, part, budget) if tree.size else part
        p = Proposal(tree, eagle_paths, tuple(lookup), suffix_probs, drafted)
        if cfg.cost_aware and tree.size:
            keep = best_prefix(self._accept_estimates(binding, p), tree.parents, tree.depths, self.verify_cost,
                               self.overhead_ms)
            if len(keep) < tree.size:
                p = _restrict(p, subset_tree(tree, keep))
        return p

    def _account(self, binding: HeadBinding, split: BudgetSplit, p: Proposal, res: VerifyResult) -> None:
        """What each source got accepted: feeds the budget split and (cost-aware) the calibration."""
        accepted = tuple(res.tokens[: res.accept_length])
        prefixes = [accepted[:k] for k in range(1, len(accepted) + 1)]
        by_lookup = 0
        while by_lookup < min(len(p.lookup), len(accepted)) and p.lookup[by_lookup] == accepted[by_lookup]:
            by_lookup += 1
        got = {"eagle": sum(q in p.eagle_paths for q in prefixes), "lookup": by_lookup,
               "suffix": sum(q in p.suffix for q in prefixes)}
        split.update(p.offered(), got)
        if self.config.cost_aware and p.tree.size:
            cal, taken = binding.calibration, set(res.accepted_nodes)
            paths = p.tree.token_paths
            eagle_nodes = [i for i, path in enumerate(paths) if path in p.eagle_paths]
            cal.observe_eagle([math.exp(float(p.tree.scores[i])) for i in eagle_nodes],
                              [i in taken for i in eagle_nodes])
            suffix_nodes = [i for i, path in enumerate(paths) if path in p.suffix]
            cal.observe_suffix([p.suffix[paths[i]] for i in suffix_nodes], [i in taken for i in suffix_nodes])
            cal.observe_lookup(len(p.lookup), by_lookup)

    # ---- the loop --------------------------------------------------------------------------------
    @torch.inference_mode()
    def stream(self, prompt, sampling: SamplingParams | None = None, stop: list[str] | None = None,
               capture: bool = False, request_id: str = "req", generator: torch.Generator | None = None,
               tenant: str = "default", index_output: bool = True, binding: HeadBinding | None = None
               ) -> Iterator[tuple[list[int], GenerationResult | None]]:
        """Yields (new token ids, None) per verify step, then ([], GenerationResult) once.
        index_output=False keeps this request's output out of the cross-request suffix index (a
        request that opted out of capture must not feed other requests' drafts either). binding: decode
        with this prepared head (`bind`) instead of the installed one (a canary's share of requests)."""
        sampling = sampling or SamplingParams()
        prompt_ids = self.encode(prompt)
        self.check_request(len(prompt_ids), sampling)
        binding = binding or self._binding  # this request drafts, calibrates and reports with this head
        gate = binding.gate
        if self._needs_costs(binding) and not self.verify_cost.points:
            self.measure_verify_cost()  # a head was installed into an engine that started without drafting
        t0 = time.perf_counter()
        from transformers import DynamicCache

        cache = DynamicCache()
        n = len(prompt_ids)
        need_aux = capture or binding.head is not None  # plain decoding without capture skips them
        logits, aux, final = self._target_forward(prompt_ids, cache, torch.arange(n), None, need_aux, capture)
        captured = [torch.cat([aux, final], -1).float().cpu()] if capture else []  # [n, n_aux * H + H] rows
        first = self._sample_row(logits[-1:], sampling, generator)
        generated: list[int] = [first]
        steps: list[VerifyStep] = []
        feed = None
        split = BudgetSplit()
        if binding.head is not None:
            feed = HeadFeed.empty(binding.head, n + 64, self.device)
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
            # draft
            head_ok = feed is None or not self.config.cost_aware or gate.allow(1.0 / (self.verify_cost(1) * 1.05))
            p = self._propose(binding, prompt_ids + generated, feed, root_pos, split, tenant, head_ok)
            tree = p.tree
            # verify: the whole tree in one target forward
            t_verify = time.perf_counter()
            mask = tree_attention_mask(tree, root_pos, self.target.dtype) if tree.size else None
            logits, aux, final = self._target_forward([generated[-1]] + tree.tokens.tolist(), cache,
                                                      tree_position_ids(tree, root_pos), mask, need_aux, capture)
            t_done = self._clock() if self.config.cost_aware and self.config.pinned_costs is None else 0.0
            res = self._verify(tree, logits, sampling, generator)
            # accept: keep the accepted path in the target cache, feed it to the head
            self._account(binding, split, p, res)
            rows = torch.tensor([0] + [i + 1 for i in res.accepted_nodes], device=self.device)
            self._keep_cache(cache, torch.cat([torch.arange(root_pos, device=self.device), root_pos + rows]))
            new = list(res.tokens)
            if feed is not None:
                feed.add(new, aux.index_select(0, rows), root_pos)
            generated.extend(new)
            # capture
            steps.append(VerifyStep(tree.size, res.accept_length, res.accept_length, res.rejected_token,
                                    res.rejected_draft_prob, res.rejected_target_prob))
            if capture:
                captured.append(torch.cat([aux, final], -1).index_select(0, rows).float().cpu())
            if self.config.cost_aware:
                step_ms = self._timed(t_step, t_verify, t_done, tree.size + 1, len(new))
                if p.head_drafted or not head_ok:  # steps the gate decided (not copy runs, where lookup is sure)
                    gate.observe(p.head_drafted, len(new), step_ms)
            visible, finish = self._cut(generated, sampling, stop)
        if self.suffix_index is not None and index_output:
            self.suffix_index.add(visible, tenant)
        self.calibrations.save(binding, self.target.fingerprint)  # rate-limited; never raises
        yield [], self._result(binding, prompt_ids, visible, finish, steps, captured, sampling, request_id, tenant,
                               t0)

    def generate(self, prompt, sampling: SamplingParams | None = None, stop: list[str] | None = None,
                 capture: bool = False, request_id: str = "req", generator: torch.Generator | None = None,
                 tenant: str = "default", index_output: bool = True,
                 binding: HeadBinding | None = None) -> GenerationResult:
        result = None
        for _, res in self.stream(prompt, sampling, stop, capture, request_id, generator, tenant, index_output,
                                  binding):
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

    def _result(self, binding: HeadBinding, prompt_ids, generated, finish, steps, captured, sampling, request_id,
                tenant, t0) -> GenerationResult:
        tok = self.target.tokenizer
        text = ""
        if tok is not None:
            body = [t for t in generated if t not in self.eos_ids]
            text = tok.decode(body, skip_special_tokens=True)
        ids = prompt_ids + generated
        aux = final = None
        if captured:
            rows = torch.cat(captured)[: len(ids)].numpy().astype(np.float32)
            width = rows.shape[1] - self.target.config.hidden_size
            aux, final = rows[:, :width], rows[:, width:]
        trace = TraceRecord(
            request_id=request_id, target_fingerprint=self.target.fingerprint, head_version=binding.version,
            backend="reference", input_ids=tuple(ids), loss_mask=tuple([0] * len(prompt_ids) + [1] * len(generated)),
            steps=tuple(steps), tenant=tenant, sampling=sampling, aux_hidden=aux, final_hidden=final,
            aux_layer_ids=tuple(self.target.aux_layer_ids) if aux is not None else (),
            compute=binding.compute, lossless=binding.lossless,
        )
        return GenerationResult(text, generated, finish, trace, time.perf_counter() - t0, steps)


def _unpack_head(head, version: str | None) -> tuple[Eagle3DraftHead | None, str | None, dict | None]:
    """(head module, version, head.json metrics) from an Eagle3DraftHead, a LoadedHead or None."""
    if head is None or isinstance(head, Eagle3DraftHead):
        return head, version if head is not None else None, None
    meta = getattr(head, "meta", None)
    if meta is None or not isinstance(getattr(head, "head", None), Eagle3DraftHead):
        raise GenerationError(f"head must be an Eagle3DraftHead, a LoadedHead or None, not {type(head).__name__}")
    return head.head, version or meta.version, meta.metrics


def _restrict(p: Proposal, tree: DraftTree) -> Proposal:
    """The proposal cut to `tree` (an ancestor-closed part of p.tree)."""
    kept = set(tree.token_paths)
    n = 0
    while n < len(p.lookup) and p.lookup[: n + 1] in kept:
        n += 1
    return Proposal(tree, p.eagle_paths & kept, p.lookup[:n], {q: v for q, v in p.suffix.items() if q in kept},
                    p.head_drafted)
