"""The reference decoding engine: EAGLE-3 speculative decoding, batch 1, lossless.

Owns: one request's decode loop as named steps — `run`: prefill → (draft → verify → accept →
capture)* → finish — over a target KV cache and the draft head's KV cache, the head binding, the
online cost model, traces and hidden-state capture. Its pieces have their own homes: the request and
result types (request.py), a request's state and the steps' hand-offs (decoding.py), a proposal's
bookkeeping (proposal.py), stop conditions and the output's text (stopping.py), the config
(engine_config.py). Must not touch: networking, the feature store, training. `head=None` runs plain
decoding through the same loop (an empty tree each step), for baselines.

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
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from adaptive_eagle.binding import (CalibrationStore, HeadBinding, HeadRefused, SwapResult, make_binding)
from adaptive_eagle.costmodel import VerifyCost, best_prefix, min_useful_prob
from adaptive_eagle.decoding import Accepted, DecodeState, Verified
from adaptive_eagle.draft_head import Eagle3DraftHead
from adaptive_eagle.drafting import HeadFeed, draft_tree
from adaptive_eagle.engine_config import EngineConfig
from adaptive_eagle.lookup import suffix_match_continuation
from adaptive_eagle.prefix_cache import CachedBlock, PrefixCache
from adaptive_eagle.proposal import Proposal, accept_estimates, account, restrict
from adaptive_eagle.request import GenerationRequest, GenerationResult, StepOutput
from adaptive_eagle.spans import answer_span
from adaptive_eagle.stopping import Committed, StopCheck, TextStream, cut_at_stop
from adaptive_eagle.suffix_index import SuffixIndex, SuffixIndexConfig
from adaptive_eagle.targets import Target, cache_dir
from adaptive_eagle.trace import SamplingParams, TraceRecord, VerifyStep
from adaptive_eagle.tree import (DraftTree, chain_tree, merge_trees, subset_tree, tree_attention_mask,
                                 tree_position_ids)
from adaptive_eagle.verify import sampling_probs, verify_greedy, verify_sampling

__all__ = ["EngineConfig", "GenerationError", "GenerationRequest", "GenerationResult", "SpeculativeEngine",
           "StepOutput"]

LOOKUP_SURE = 0.8  # calibrated acceptance of a model-free first token above which the head does not expand
EMPTY_TREE = DraftTree(*(torch.zeros(0, dtype=torch.long) for _ in range(3)), torch.zeros(0), torch.zeros(0))
# architectures whose causal-LM forward is lm_head(decoder(x)) (transformers' modeling files): a prefill block
# runs the decoder alone and the head on the row it needs (_head_splits); others go through logits_to_keep
SPLIT_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
PLAIN_STEP = Proposal(EMPTY_TREE)  # a step that drafts nothing: the target's next token alone


class GenerationError(ValueError):
    """A request the engine refuses (bad prompt, limits, head/target mismatch)."""


def _head_splits(model) -> bool:
    """Whether `model` computes logits as lm_head(decoder(x).last_hidden_state) and nothing more (an architecture
    of SPLIT_HEAD_TYPES: no logit softcapping or scaling), so that a forward may run the decoder alone and the
    head on chosen rows."""
    return (getattr(model.config, "model_type", "") in SPLIT_HEAD_TYPES and hasattr(model, "get_decoder")
            and model.get_decoder() is not model and model.get_output_embeddings() is not None)


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


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
        # prefill computes logits for its last row only where the model can (HF's logits_to_keep)
        self._keep_kw = "logits_to_keep" in inspect.signature(target.model.forward).parameters
        self._split_head = _head_splits(target.model)
        self._decoder_cache_kw = _cache_kwarg(target.model.get_decoder()) if self._split_head else self._cache_kw
        cfg = self.config
        self.prefix_cache = PrefixCache(cfg.prefill_block, int(cfg.prefix_cache_mb * 2 ** 20))
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
        self._grammars = None  # grammar.Grammars for this tokenizer, made at the first constrained request

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
    def grammar(self, response_format: dict):
        """A compiled grammar for an OpenAI response_format ({"type": "json_object"}, or "json_schema" with its
        schema and strict): pass it as `grammar=` (grammar.py: lossless under speculation). Raises
        grammar.GrammarError for a format it cannot serve; compiled grammars are cached."""
        if self._grammars is None:
            if self.target.tokenizer is None:
                raise GenerationError("this target has no tokenizer: output cannot be constrained")
            from adaptive_eagle.grammar import Grammars

            self._grammars = Grammars(self.target.tokenizer, self.target.config.vocab_size, sorted(self.eos_ids))
        return self._grammars.compile(response_format)

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
    def measure_verify_cost(self, prefix: int = 64, long_prefix: int = 512, reps: int = 2) -> dict[int, float]:
        """Time target forwards of 1, 2, 4, ... tokens over a `prefix`-token cache, and of a few sizes over a
        `long_prefix`-token one (best of `reps`), and seed the verify-cost model: its points at `prefix`, its
        per-cached-token slope from the difference (costmodel.VerifyCost). Returns {tokens: ms} at `prefix`."""
        top = self.config.num_draft_tokens + 1
        sizes = sorted({1, top} | {q for q in (2, 4, 8, 16, 32, 64) if q < top})
        limit = self.target.config.max_position_embeddings - top - 1
        prefix, long_prefix = max(1, min(prefix, limit)), min(long_prefix, limit)
        short = self._time_forwards(prefix, sizes, reps)
        cost = self.verify_cost
        cost.points.update(short)
        cost.ref = prefix
        if long_prefix > prefix:
            far = self._time_forwards(long_prefix, sorted({1, max(1, top // 2), top}), reps)
            cost.slope = {q: max(0.0, (ms - cost(q)) / (long_prefix - prefix)) for q, ms in far.items()}
        return short

    def _time_forwards(self, prefix: int, sizes: list[int], reps: int) -> dict[int, float]:
        """{q: best ms of `reps` target forwards of q tokens over a `prefix`-token cache}."""
        from adaptive_eagle.kv_cache import GrowingCache

        top, vocab = max(sizes), self.target.config.vocab_size
        ids = [(7 * i + 3) % vocab for i in range(prefix + top)]
        cache = GrowingCache()
        self._target_forward(ids[:prefix], cache, torch.arange(prefix), None, aux=False)
        keep = torch.arange(prefix, device=self.device)
        for _ in range(2):  # warm up kernels and allocator at the largest size
            self._target_forward(ids[prefix:], cache, torch.arange(prefix, prefix + top), None)
            self._keep_cache(cache, keep)
        measured = {}
        for q in sizes:
            best = float("inf")
            for _ in range(reps + 1):  # the first run warms up
                t0 = time.perf_counter()
                self._target_forward(ids[prefix : prefix + q], cache, torch.arange(prefix, prefix + q), None)
                self._sync()
                best = min(best, (time.perf_counter() - t0) * 1e3)
                self._keep_cache(cache, keep)
            measured[q] = best
        return measured

    def _timed(self, t_step: float, t_verify: float, t_done: float, q: int, committed: int, ctx: int,
               decay: float = 0.9) -> float:
        """Follow this machine's costs: the verify forward of q tokens; everything else in the step
        (drafting, acceptance, cache upkeep, feeding the head) as the step's fixed cost; the rate.
        Returns the step's ms. With pinned costs nothing is timed: the step is charged the pinned ones."""
        if self.config.pinned_costs is not None:
            step = self.verify_cost(q) + self.overhead_ms
        else:
            now = self._clock()
            forward, step = (t_done - t_verify) * 1e3, (now - t_step) * 1e3
            self.verify_cost.observe(q, forward, ctx)
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

    # ---- target ---------------------------------------------------------------------------------
    def _target_forward(self, ids: list[int], cache, positions: torch.Tensor, mask: torch.Tensor | None,
                        aux: bool = True, final: bool = False, logits: str = "all", model=None):
        """(logits: [Q, V] ("all"), the last row's [1, V] ("last") or None ("none": a prefill block before the
        prompt's last), aux features [Q, n_aux * H] or None when aux=False, final-norm hidden [Q, H] or None
        unless final=True: what capture stores so the trainer needs no target forward).

        "last" and "none" run the model's decoder and (for "last") its LM head on the last row as a [1, H]
        matrix, where the model is a plain decoder + LM head (_head_splits): HF's logits_to_keep=1 hands the LM
        head a [1, 1, H] view, which CPU kernels multiply by a transposed copy of the whole [V, H] weight (46 ms
        a call for SmolLM2 in bf16 on the 2-core EPYC, against 3 ms for the matrix)."""
        model = model or self.target.model
        x = torch.tensor([ids], device=self.device)
        split = logits != "all" and self._split_head
        kw = {self._decoder_cache_kw if split else self._cache_kw: cache, "use_cache": True,
              "output_hidden_states": aux or final, "position_ids": positions[None].to(self.device)}
        if mask is not None:
            kw["attention_mask"] = mask.to(self.device)
        if logits != "all" and not split and self._keep_kw:
            kw["logits_to_keep"] = 1  # "none" still computes the last row's here: the least such a model allows
        out = (model.get_decoder() if split else model)(input_ids=x, **kw)
        if not split:
            rows = out.logits[0] if logits != "none" else None
        else:
            rows = model.get_output_embeddings()(out.last_hidden_state[0, -1:]) if logits == "last" else None
        if not (aux or final):
            return rows, None, None
        hs = out.hidden_states
        feats = torch.cat([hs[k] for k in self.target.aux_layer_ids], dim=-1)[0] if aux else None
        return rows, feats, (hs[-1][0] if final else None)

    @staticmethod
    def _keep_cache(cache, keep: torch.Tensor) -> None:
        """Keep only the rows `keep` (ascending) of every layer's keys and values (the accepted path)."""
        from adaptive_eagle.kv_cache import keep_rows  # transformers is imported where a target is

        keep_rows(cache, keep)

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

    def _speculates(self, state: DecodeState) -> bool:
        """Whether this step drafts at all (always, unless cost-aware): the request's own gate compares the
        committed tokens per ms of its speculative steps with its plain ones (before one was measured: a plain
        forward's cost at this context), so a request that speculation slows decodes plainly, probing every
        few steps (costmodel.PlainGate); such steps are counted as plain steps."""
        return not self.config.cost_aware or state.plain_gate.allow(1.0 / self.verify_cost(1, state.root_pos))

    def _head_pays(self, state: DecodeState) -> bool:
        """Whether drafting with the head pays now (the binding's gate; always, unless cost-aware)."""
        return state.feed is None or not self.config.cost_aware or state.binding.gate.allow(
            1.0 / (self.verify_cost(1, state.root_pos) * 1.05))

    def _draft(self, state: DecodeState, head_ok: bool = True) -> Proposal:
        """Draft: this step's tree: the head's dynamic tree (unless `head_ok` is False: the gate found
        drafting with the head does not pay now), the lookup chain and the suffix-index tree merged,
        their node budget split by measured acceptance; then (cost-aware) the part that pays."""
        cfg, binding, feed, split = self.config, state.binding, state.feed, state.split
        cal, budget, root_pos = binding.calibration, cfg.num_draft_tokens, state.root_pos
        cont, suffix = self._model_free(state.context, state.request.tenant)
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
                min_prob = max(min_prob, min_useful_prob(self.verify_cost.at(root_pos), budget, self.rate))
            root = feed.root(cfg.prefill_block)
            tree = draft_tree(binding.head, feed.cache, root, root_pos, depth=cfg.depth, topk=cfg.topk,
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
            keep = best_prefix(accept_estimates(cal, p), tree.parents, tree.depths, self.verify_cost.at(root_pos),
                               self.overhead_ms)
            if len(keep) < tree.size:
                p = restrict(p, subset_tree(tree, keep))
        return p

    # ---- the loop: prefill -> (draft -> verify -> accept -> capture)* -> finish ------------------------
    def run(self, request: GenerationRequest) -> Iterator[StepOutput | GenerationResult]:
        """Decode `request`: a StepOutput per verify step that commits tokens (with the text that became
        final: stop strings cut, never half emitted), a last StepOutput with no tokens when text remains,
        then the GenerationResult."""
        return self._run(request, text=True)

    def stream(self, prompt, sampling: SamplingParams | None = None, stop: list[str] | None = None,
               capture: bool = False, request_id: str = "req", generator: torch.Generator | None = None,
               tenant: str = "default", index_output: bool = True, binding: HeadBinding | None = None,
               grammar=None) -> Iterator[tuple[list[int], GenerationResult | None]]:
        """Yields (new token ids, None) per verify step, then ([], GenerationResult) once. `prompt`: a
        GenerationRequest, or the prompt with the other arguments as keywords (GenerationRequest.of).
        index_output=False keeps this request's output out of the cross-request suffix index (a
        request that opted out of capture must not feed other requests' drafts either). binding: decode
        with this prepared head (`bind`) instead of the installed one (a canary's share of requests). grammar:
        constrain the output (`grammar(response_format)`)."""
        request = GenerationRequest.of(prompt, sampling, stop, capture, request_id, generator, tenant, index_output,
                                       binding, grammar)
        for item in self._run(request, text=False):
            if isinstance(item, GenerationResult):
                yield [], item
            elif item.token_ids:
                yield list(item.token_ids), None

    def generate(self, prompt, sampling: SamplingParams | None = None, stop: list[str] | None = None,
                 capture: bool = False, request_id: str = "req", generator: torch.Generator | None = None,
                 tenant: str = "default", index_output: bool = True,
                 binding: HeadBinding | None = None, grammar=None) -> GenerationResult:
        """`stream` to the end: the GenerationResult."""
        request = GenerationRequest.of(prompt, sampling, stop, capture, request_id, generator, tenant, index_output,
                                       binding, grammar)
        result = None
        for item in self._run(request, text=False):
            result = item if isinstance(item, GenerationResult) else result
        return result

    @torch.inference_mode()
    def _run(self, request: GenerationRequest, text: bool) -> Iterator[StepOutput | GenerationResult]:
        """The loop. text=False: no text is decoded along the way unless stop strings need it."""
        state, out = self._prefill(request, text)
        while True:
            if out.token_ids:
                yield StepOutput(out.token_ids, out.text)
            if out.finish is not None:
                break
            speculate = self._speculates(state)
            head_ok = speculate and self._head_pays(state)
            if head_ok and state.feed is not None and not state.feed.cache.length:
                self._read_prompt(state)
            t_step = time.perf_counter()
            proposal = self._draft(state, head_ok) if speculate else PLAIN_STEP
            bits = None
            if state.constraint is not None:  # drafts the grammar refuses pruned; every row's mask (grammar.py)
                tree, bits = state.constraint.plan(proposal.tree)
                proposal = proposal if tree is proposal.tree else restrict(proposal, tree)
            verified = self._verify(state, proposal.tree, bits)
            accepted = self._accept(state, proposal, verified)
            if state.constraint is not None:
                state.constraint.advance(accepted.tokens)
            self._capture(state, proposal.tree, verified, accepted)
            self._follow_costs(state, proposal, head_ok, t_step, verified, accepted)
            out = state.stops.commit(accepted.tokens)
        yield from self._finish(state)

    def _read_prompt(self, state: DecodeState) -> None:
        """The head reads the prompt (with the binding's prompt reader where there is one), in chunks of a prefill
        block: after the first token is out, so that the first token waits for the target's prefill alone, and
        only when the head is about to draft, so that a request that never drafts with it never pays for it; out
        of the step's timing, which the cost model learns a step's cost from."""
        state.feed.root(self.config.prefill_block, state.binding.prompt_head)

    def _prefill(self, request: GenerationRequest, text: bool) -> tuple[DecodeState, Committed]:
        """The prompt through the target (in blocks, _prefill_blocks), its first token sampled, the prompt queued
        for the head (_read_prompt)."""
        prompt_ids = self.encode(request.prompt)
        self.check_request(len(prompt_ids), request.sampling)
        binding = request.binding or self._binding  # this request drafts, calibrates and reports with this head
        if self._needs_costs(binding) and not self.verify_cost.points:
            self.measure_verify_cost()  # a head was installed into an engine that started without drafting
        t0 = time.perf_counter()
        from adaptive_eagle.kv_cache import GrowingCache

        cache, n = GrowingCache(), len(prompt_ids)
        need_aux = request.capture or binding.head is not None  # plain decoding without capture skips them
        logits, aux, final = self._prefill_blocks(prompt_ids, cache, need_aux, request.capture)
        constraint = request.grammar.constraint() if request.grammar is not None else None
        if constraint is not None:
            logits = constraint.mask(logits[-1:], constraint.plan(EMPTY_TREE)[1])
        first = self._sample_row(logits[-1:], request.sampling, request.generator)
        if constraint is not None:
            constraint.advance([first])
        feed = None
        if binding.head is not None:
            feed = HeadFeed.empty(binding.head, n + 64, self.device)
            feed.add(prompt_ids[1:] + [first], aux, 0)  # the head reads it once the first token is out (_run)
        stream = TextStream(self.detokenize, request.stop) if text or request.stop else None
        state = DecodeState(request, binding, prompt_ids, cache, need_aux, feed,
                            StopCheck(self.eos_ids, request.sampling.max_tokens, stream), t0, generated=[first],
                            constraint=constraint)
        if request.capture:
            state.captured.append(torch.cat([aux, final], -1).float().cpu())  # [n, n_aux * H + H]
        return state, state.stops.commit([first])

    def _prefill_blocks(self, ids: list[int], cache, aux: bool, final: bool):
        """The prompt through the target in blocks of prefill_block tokens at absolute positions, whole blocks
        read from and kept in the prefix cache (prefix_cache.py: exact by construction). Returns the last
        row's logits [1, V] and, when asked, the aux features and final hidden states of every prompt row.
        Where the target prefills with another model (Target.prefill_model: the same weights in a dtype faster
        at many rows), the blocks run there and `cache` receives their keys and values in its own dtype: every
        request, plain or speculative, starts decoding from the same bits."""
        prefill = self.target.prefill_model
        if prefill is None:
            return self._prefill_into(ids, cache, aux, final, None)
        from adaptive_eagle.kv_cache import GrowingCache

        own = GrowingCache()
        out = self._prefill_into(ids, own, aux, final, prefill)
        dtype = self.target.dtype
        for i, layer in enumerate(own.layers):
            cache.update(layer.keys.to(dtype), layer.values.to(dtype), i)
        return out

    def _prefill_into(self, ids: list[int], cache, aux: bool, final: bool, model):
        block, pc, n = self.config.prefill_block, self.prefix_cache, len(ids)
        keys = pc.keys(ids) if pc.max_bytes else []
        hit = pc.lookup(keys[: (n - 1) // block], aux, final) if keys else []  # the last token is always computed
        start = len(hit) * block
        if hit:
            for i in range(len(hit[0].keys)):
                cache.update(torch.cat([b.keys[i] for b in hit], -2), torch.cat([b.values[i] for b in hit], -2), i)
        pc.counts.lookups += 1
        pc.counts.hits += bool(hit)
        pc.counts.hit_tokens += start
        pc.counts.miss_tokens += n - start
        auxs = [b.aux for b in hit] if aux else []
        finals = [b.final for b in hit] if final else []
        logits = None
        while start < n:
            stop = min(start + block, n)
            rows, a, f = self._target_forward(ids[start:stop], cache, torch.arange(start, stop), None, aux, final,
                                              logits="last" if stop == n else "none", model=model)
            logits = rows if rows is not None else logits
            if aux:
                auxs.append(a)
            if final:
                finals.append(f)
            if stop - start == block and keys:
                pc.store(keys[start // block], CachedBlock(
                    tuple(layer.keys[..., start:stop, :].clone() for layer in cache.layers),
                    tuple(layer.values[..., start:stop, :].clone() for layer in cache.layers),
                    a.clone() if a is not None else None, f.clone() if f is not None else None))
            start = stop
        return logits[-1:], (torch.cat(auxs) if aux else None), (torch.cat(finals) if final else None)

    def _verify(self, state: DecodeState, tree: DraftTree, bits=None) -> Verified:
        """Verify: the root and the whole tree in one target forward, then the accepted path (`bits`: the
        grammar's mask of every row, for a constrained request)."""
        root_pos, sampling = state.root_pos, state.sampling
        t_verify = time.perf_counter()
        mask = tree_attention_mask(tree, root_pos, self.target.dtype) if tree.size else None
        logits, aux, final = self._target_forward([state.generated[-1]] + tree.tokens.tolist(), state.cache,
                                                  tree_position_ids(tree, root_pos), mask, state.need_aux,
                                                  state.request.capture)
        t_done = self._clock() if self.config.cost_aware and self.config.pinned_costs is None else 0.0
        if bits is not None:
            logits = state.constraint.mask(logits, bits)
        if sampling.temperature == 0:
            res = verify_greedy(tree, logits)
        else:
            res = verify_sampling(tree, sampling_probs(logits, sampling.temperature, sampling.top_p, sampling.top_k),
                                  state.request.generator)
        return Verified(res, aux, final, t_verify, t_done)

    def _accept(self, state: DecodeState, p: Proposal, v: Verified) -> Accepted:
        """Accept: what each source got accepted, the accepted path kept in the target cache and fed to
        the head, its tokens committed."""
        res, root_pos = v.result, state.root_pos
        # a constrained step's drafts were pruned by the grammar: its acceptance says nothing of the estimates'
        # calibration
        account(state.binding.calibration, state.split, p, res, self.config.cost_aware and state.constraint is None)
        rows = torch.tensor([0] + [i + 1 for i in res.accepted_nodes], device=self.device)
        self._keep_cache(state.cache, torch.cat([torch.arange(root_pos, device=self.device), root_pos + rows]))
        if state.feed is not None:
            state.feed.add(list(res.tokens), v.aux.index_select(0, rows), root_pos)
        state.generated.extend(res.tokens)
        return Accepted(rows, res.tokens)

    def _capture(self, state: DecodeState, tree: DraftTree, v: Verified, a: Accepted) -> None:
        """Capture: the step's record, and (capture) the hidden states of the accepted path."""
        res = v.result
        state.steps.append(VerifyStep(tree.size, res.accepted_drafts, res.accepted_drafts, res.rejected_token,
                                      res.rejected_draft_prob, res.rejected_target_prob))
        if state.request.capture:
            state.captured.append(torch.cat([v.aux, v.final], -1).index_select(0, a.rows).float().cpu())

    def _follow_costs(self, state: DecodeState, p: Proposal, head_ok: bool, t_step: float, v: Verified,
                      a: Accepted) -> None:
        """(Cost-aware) the step's timings into the cost model, and the gate's view of drafting."""
        if self.config.cost_aware:
            step_ms = self._timed(t_step, v.t_verify, v.t_done, p.tree.size + 1, len(a.tokens),
                                  state.root_pos - len(a.tokens))  # the context the verify read
            if p.head_drafted or (not head_ok and p is not PLAIN_STEP):  # steps the head gate decided (not copy
                state.binding.gate.observe(p.head_drafted, len(a.tokens), step_ms)  # runs, where lookup is sure)
            state.plain_gate.observe(p.tree.size > 0, len(a.tokens), step_ms)

    def _finish(self, state: DecodeState) -> Iterator[StepOutput | GenerationResult]:
        """The output indexed, the calibration saved, the text not shown yet, the result."""
        request, output = state.request, state.stops.kept
        if self.suffix_index is not None and request.consent:
            self.suffix_index.add(output, request.tenant)
        self.calibrations.save(state.binding, self.target.fingerprint)  # rate-limited; never raises
        full = self.detokenize(output)
        shown = cut_at_stop(full, request.stop)
        stream = state.stops.text
        if stream is not None and (rest := stream.rest_of(shown)):
            yield StepOutput((), rest)
        yield self._result(state, full if self.target.tokenizer is not None else "", shown)

    def _sample_row(self, logits_row, sampling: SamplingParams, generator) -> int:
        if sampling.temperature == 0:
            return int(logits_row[-1].argmax())
        probs = sampling_probs(logits_row[-1:], sampling.temperature, sampling.top_p, sampling.top_k)
        return int(torch.multinomial(probs[0].cpu(), 1, generator=generator))

    def detokenize(self, token_ids) -> str:
        """Generated tokens as a client reads them: EOS and special tokens skipped (a target without a
        tokenizer: the ids joined by spaces). Stop strings are looked for in this text."""
        tok = self.target.tokenizer
        if tok is None:
            return " ".join(str(t) for t in token_ids)
        return tok.decode([t for t in token_ids if t not in self.eos_ids], skip_special_tokens=True)

    def _result(self, state: DecodeState, text: str, shown: str) -> GenerationResult:
        request, prompt_ids, generated = state.request, state.prompt_ids, state.stops.kept
        ids = prompt_ids + generated
        aux = final = None
        if state.captured:
            rows = torch.cat(state.captured)[: len(ids)].numpy().astype(np.float32)
            width = rows.shape[1] - self.target.config.hidden_size
            aux, final = rows[:, :width], rows[:, width:]
        trace = TraceRecord(
            request_id=request.request_id, target_fingerprint=self.target.fingerprint,
            head_version=state.binding.version, backend="reference", input_ids=tuple(ids),
            loss_mask=tuple([0] * len(prompt_ids) + [1] * len(generated)), steps=tuple(state.steps),
            tenant=request.tenant, sampling=request.sampling, domain=request.domain,
            capture_consent=request.consent, aux_hidden=aux, final_hidden=final,
            aux_layer_ids=tuple(self.target.aux_layer_ids) if aux is not None else (),
            compute=state.binding.compute, lossless=state.binding.lossless,
            spans=answer_span(len(prompt_ids), len(ids), state.constraint is not None),
        )
        return GenerationResult(text, list(generated), state.stops.finish, trace, time.perf_counter() - state.t0,
                                state.steps, shown, state.constraint.mask_s if state.constraint is not None else 0.0)


def _unpack_head(head, version: str | None) -> tuple[Eagle3DraftHead | None, str | None, dict | None]:
    """(head module, version, head.json metrics) from an Eagle3DraftHead, a LoadedHead or None."""
    if head is None or isinstance(head, Eagle3DraftHead):
        return head, version if head is not None else None, None
    meta = getattr(head, "meta", None)
    if meta is None or not isinstance(getattr(head, "head", None), Eagle3DraftHead):
        raise GenerationError(f"head must be an Eagle3DraftHead, a LoadedHead or None, not {type(head).__name__}")
    return head.head, version or meta.version, meta.metrics
