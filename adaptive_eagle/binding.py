"""Head bindings: a draft head made ready for one target, and how it is swapped in while serving.

Owns: validating a head against the target it will draft for, preparing it off the decode path
(the target's embedding shared, not copied; only the head's own linears packed on CPUs that run
fp16-packed weights), the immutable `HeadBinding` a request holds from its first step to its last,
`SwapResult`, and the acceptance calibration that travels with a head: persisted per
(head version, target fingerprint, compute mode) in the cache dir, seeded from `head.json` metrics.
Must not touch: the decode loop (engine.py flips its binding), the head registry, networking.

Why a binding. A request's draft-head KV cache, its calibration updates and its trace all belong
to one head: a swap in the middle of a request must not draft with the new head against the old
head's cache, nor credit the old head's steps to the new version. So a request reads the engine's
binding once, when it starts, and finishes on it; later requests get whatever is bound then.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adaptive_eagle.atomic import atomic_write_text
from adaptive_eagle.costmodel import AcceptCalibration, DraftGate
from adaptive_eagle.draft_head import Eagle3DraftHead, all_finite
from adaptive_eagle.targets import Target

log = logging.getLogger(__name__)


class HeadRefused(ValueError):
    """A head that cannot draft for this target; the message says why."""


@dataclass(frozen=True)
class SwapResult:
    ok: bool
    message: str  # one sentence: what is serving now, or why the head was refused
    version: str | None = None  # the version serving after the call (None = plain decoding)
    install_ms: float = 0.0  # validate + prepare + flip, on the caller's thread


@dataclass
class HeadBinding:
    """What a request decodes with. Never changed after construction except `calibration`, which the
    requests bound to it keep learning (it describes this head on this target and compute mode)."""

    head: Eagle3DraftHead | None  # prepared for the target's compute mode; None = plain decoding
    version: str | None
    calibration: AcceptCalibration = field(default_factory=AcceptCalibration)
    compute: str = ""
    lossless: str = "exact"
    calibration_source: str = "prior"  # "cache" | "head.json" | "prior"
    gate: DraftGate = field(default_factory=DraftGate)  # does drafting with this head pay on this machine?
    # the same head for reading a prompt, where the target prefills with another model (Target.prefill_model):
    # in that model's dtype, faster at a prompt's many rows than the packed head (prepare_head); None: `head` reads it
    prompt_head: Eagle3DraftHead | None = None

    @property
    def key(self) -> str | None:
        return None if self.head is None or not self.version else self.version


# ---- validation and preparation -----------------------------------------------------------------
def check_head(head: Eagle3DraftHead, target: Target) -> None:
    """Raises HeadRefused naming what does not fit: vocab, hidden size, aux layers, draft vocab map,
    non-finite weights."""
    c = head.cfg
    if c.vocab_size != target.config.vocab_size or c.target_hidden_size != target.config.hidden_size:
        raise HeadRefused(f"head was built for a target with vocab {c.vocab_size} / hidden {c.target_hidden_size}; "
                          f"this target has vocab {target.config.vocab_size} / hidden {target.config.hidden_size}")
    if tuple(c.aux_layer_ids) != tuple(target.aux_layer_ids):
        raise HeadRefused(f"head aux layers {list(c.aux_layer_ids)} != target aux layers {list(target.aux_layer_ids)}")
    d2t = head.draft_to_target
    if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= c.vocab_size):
        raise HeadRefused(f"draft vocab maps outside the target vocabulary [0, {c.vocab_size})")
    for name, p in head.named_parameters():
        if name.startswith("embed_tokens"):
            continue  # the target's, replaced when prepared
        if p.is_floating_point() and not all_finite(p):
            raise HeadRefused(f"head weight {name} has non-finite values")


def prepare_head(head: Eagle3DraftHead, target: Target, adopt: bool = False, prompt: bool = False) -> Eagle3DraftHead:
    """`head` ready to draft for `target`: on its device, in its compute dtype, reading the target's own
    input embedding (shared, never copied), with the head's linears fp16-packed when the target runs
    that way (cpu_linear.py). A copy, leaving the caller's head untouched, unless `adopt`: the caller
    hands the head over (one loaded for this engine alone, as a server's swap does) and it is prepared
    in place, so a hot swap does not copy every weight once more while requests decode.
    prompt: the copy that reads prompts where the target prefills with another model (Target.prefill_model):
    in that model's dtype and reading its embedding, never packed (HeadBinding.prompt_head)."""
    model = target.prefill_model if prompt else target.model
    embed = model.get_input_embeddings().weight
    packed = not prompt and target.compute.endswith("fp16-weights")
    dtype = torch.float32 if packed else next(model.parameters()).dtype
    if adopt:
        prepared = head
        prepared.embed_tokens.weight = torch.nn.Parameter(embed, requires_grad=False)
    else:  # deepcopy everything but the embedding, which becomes the target's (memo maps it to the target's)
        prepared = copy.deepcopy(head, memo={id(head.embed_tokens.weight): embed})
    for name, p in prepared.named_parameters():
        if not name.startswith("embed_tokens"):
            p.data = p.data.to(target.device, dtype)
    for name, b in prepared.named_buffers():
        module, _, attr = name.rpartition(".")
        owner = prepared.get_submodule(module) if module else prepared
        setattr(owner, attr, b.to(target.device) if not b.is_floating_point() else b.to(target.device, dtype))
    prepared.requires_grad_(False).eval()
    if packed:
        from adaptive_eagle.cpu_linear import pack_linears

        pack_linears(prepared)
    return prepared


# ---- calibration persistence --------------------------------------------------------------------
@dataclass
class CalibrationStore:
    """Calibrations on disk: `<root>/<sha>.json` for (head version, target fingerprint, compute).

    Saving is cheap (a few hundred bytes, atomic rename) and rate-limited per key; a corrupt file is
    ignored with a warning, counted in `refused`, and overwritten by the next save."""

    root: Path | None  # None: not persisted
    min_interval_s: float = 10.0
    refused: int = 0
    _last_save: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _path(self, version: str, fingerprint: str, compute: str) -> Path:
        digest = hashlib.sha256(f"{version}\n{fingerprint}\n{compute}".encode()).hexdigest()[:24]
        return Path(self.root) / f"{digest}.json"

    def load(self, version: str, fingerprint: str, compute: str) -> AcceptCalibration | None:
        if self.root is None:
            return None
        path = self._path(version, fingerprint, compute)
        if not path.exists():
            return None
        try:
            raw = json.loads(path.read_text())
            if (raw.get("head_version"), raw.get("target_fingerprint"), raw.get("compute")) != (
                    version, fingerprint, compute):
                raise ValueError("written for another head, target or compute mode")
            return AcceptCalibration.from_dict(raw["calibration"])
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
            self.refused += 1
            log.warning("calibration %s refused (%s); starting from the head's own probabilities", path, e)
            return None

    def save(self, binding: HeadBinding, fingerprint: str, force: bool = False) -> bool:
        """Write the binding's calibration (at most every min_interval_s per key unless forced)."""
        if self.root is None or binding.key is None:
            return False
        path = self._path(binding.key, fingerprint, binding.compute)
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last_save.get(path, -math.inf) < self.min_interval_s:
                return False
            self._last_save[path] = now
        doc = {"head_version": binding.key, "target_fingerprint": fingerprint, "compute": binding.compute,
               "updated_at": time.time(), "calibration": binding.calibration.to_dict()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(doc), fsync=False)  # a lost calibration is re-learnt
            return True
        except OSError as e:  # a read-only cache never fails a request
            log.warning("could not save calibration to %s: %s", path, e)
            return False


def seed_calibration(metrics: dict | None, fingerprint: str) -> AcceptCalibration | None:
    """A calibration shipped in head.json (`metrics.calibration`, keyed by target fingerprint), e.g.
    measured when the head was evaluated; None when absent or unreadable."""
    entry = ((metrics or {}).get("calibration") or {}).get(fingerprint)
    if not entry:
        return None
    try:
        return AcceptCalibration.from_dict(entry)
    except ValueError as e:
        log.warning("head.json calibration refused (%s)", e)
        return None


def make_binding(head: Eagle3DraftHead | None, version: str | None, target: Target, store: CalibrationStore,
                 metrics: dict | None = None, adopt: bool = False) -> HeadBinding:
    """Validate and prepare `head` for `target` (in place when `adopt`, see prepare_head), with its
    calibration (cache, then head.json, then the head's own probabilities). Raises HeadRefused."""
    label = target.lossless
    if head is None:
        return HeadBinding(None, None, compute=target.compute, lossless=label)
    check_head(head, target)
    # the prompt reader is copied first: an adopted head is prepared (packed) in place
    prompt_head = prepare_head(head, target, prompt=True) if reads_prompts_apart(target) else None
    prepared = prepare_head(head, target, adopt)
    calibration, source = None, "prior"
    if version:
        calibration, source = store.load(version, target.fingerprint, target.compute), "cache"
        if calibration is None:
            calibration, source = seed_calibration(metrics, target.fingerprint), "head.json"
    if calibration is not None:  # carried over from other traffic: a head start that live evidence overrules
        calibration = calibration.damped()
    return HeadBinding(prepared, version, calibration or AcceptCalibration(), target.compute, label,
                       source if calibration is not None else "prior", prompt_head=prompt_head)


def reads_prompts_apart(target: Target) -> bool:
    """Whether a head reads prompts with its own copy (HeadBinding.prompt_head): where the target prefills with a
    model in another dtype than the head drafts in (bf16 prompts, fp16-packed decoding). Drafts only: exactness
    is the target's, and the copy's keys and values join the drafting head's cache in its dtype."""
    return target.prefill_model is not None and target.compute.endswith("fp16-weights")
