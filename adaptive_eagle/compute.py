"""Compute modes of the target: which exist here, which are exact, what each costs on this machine,
and which one decoding uses.

Owns: the mode vocabulary, the exactness label of each mode, timing a loaded model's forward by
size, the timing table cached once per (machine, target fingerprint, torch version) under
``<cache>/compute/<key>.json``, and the pure choice of a mode from that table. Must not touch:
checkpoints and loading (targets.py hands in a ``make_model(mode)`` factory and the cache folder),
the engine, the environment.

Vocabulary.
    mode        how the target's forward runs: "bf16" (bfloat16 weights and math), "fp32",
                "fp32+fp16-weights" (fp32 activations over FBGEMM fp16-packed weights, CPU only,
                cpu_linear.py; offered only for bf16/fp16 checkpoints, whose weights fp16 holds
                exactly) and "fp16" (CUDA). ``Target.compute`` spells them "bfloat16", "float32",
                "float32+fp16-weights", "float16".
    exact       the math is fp32 (or wider), so greedy speculative output equals plain greedy
                token for token; bf16/fp16 are lossless only up to their rounding: a one-token and
                a tree forward may round a near-tie differently (the bench counts those flips).
    forward_ms  {q: ms} of one target forward of q tokens over a cached 64-token prefix (best of
                a few runs after a warm-up), q in PROBE_SIZES. q = 1 is plain decoding; q > 1 is a
                verify forward.
    score       expected committed tokens per ms. Plain: 1 / forward_ms[1]. Speculative: the
                cost model (costmodel.best_prefix) on REFERENCE_TREE, a documented stand-in draft
                tree, at the tree size that pays best; the drafting cost is DRAFT_FRACTION of a
                one-token forward in the same mode (the head is one decoder layer plus an LM head
                and runs in the target's mode).
"""

from __future__ import annotations

import datetime
import hashlib
import inspect
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from adaptive_eagle.costmodel import VerifyCost, best_prefix

CPU_MODES = ("bf16", "fp32", "fp32+fp16-weights")
CUDA_MODES = ("bf16", "fp16", "fp32")
COMPUTE_NAMES = {"bf16": "bfloat16", "fp32": "float32", "fp32+fp16-weights": "float32+fp16-weights",
                 "fp16": "float16"}  # mode -> Target.compute
_ALIASES = {**{v: k for k, v in COMPUTE_NAMES.items()}, "fp16-packed": "fp32+fp16-weights"}
MODE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp32+fp16-weights": torch.float32,
               "fp16": torch.float16}  # the dtype the weights are loaded in
PURPOSES = ("speculative", "plain")
PROBE_SIZES = (1, 2, 4, 8, 16, 17)
PROBE_PREFIX = 64
# what limits PyTorch's, oneDNN's and FBGEMM's kernels to an instruction set below the CPU's
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS")
TABLE_SCHEME = 4  # 2: row-stability check and verify residual; 3: a prefill block's cost; 4: threaded fp16 linears
PREFILL_ROWS = 256  # rows of the prefill forward timed per mode (EngineConfig.prefill_block's default)
DRAFT_FRACTION = 0.25  # drafting ms per step / one-token forward ms (~10 / 37 ms measured on an AVX2 CPU)


class ComputeTableError(ValueError):
    """A cached timing table that cannot be used (the reason says why); it is re-measured."""


def parse_compute(value: str, allow_auto: bool = True) -> str:
    """'auto' or a mode name (aliases: bfloat16, float32, float16, float32+fp16-weights, fp16-packed)."""
    name = str(value).strip().lower()
    name = _ALIASES.get(name, name)
    if name in MODE_DTYPES or (allow_auto and name == "auto"):
        return name
    allowed = (["auto"] if allow_auto else []) + list(MODE_DTYPES)
    raise ValueError(f"compute must be one of {', '.join(allowed)}; got {value!r}")


def mode_of(compute: str) -> str:
    """Target.compute ("float32+fp16-weights") -> mode ("fp32+fp16-weights")."""
    return _ALIASES.get(compute, compute)


def fp32_is_exact(device_type: str = "cpu") -> bool:
    """fp32 matmuls are true fp32 unless the process allowed TF32 / bf16 shortcuts for them."""
    if torch.get_float32_matmul_precision() != "highest":
        return False
    return not (device_type == "cuda" and torch.backends.cuda.matmul.allow_tf32)


def lossless_label(compute: str, device_type: str = "cpu") -> str:
    """'exact' for fp32 (or wider) math, else 'lossless up to bf16 rounding' and the like."""
    mode = mode_of(compute)
    if mode in ("bf16", "fp16"):
        return f"lossless up to {mode} rounding"
    if mode in ("fp32", "fp32+fp16-weights", "float64") and not fp32_is_exact(device_type):
        return "lossless up to tf32 rounding" if device_type == "cuda" else "lossless up to reduced-precision fp32 matmuls"
    return "exact"


def is_exact_mode(mode: str) -> bool:
    """By the mode alone (fp32 math); lossless_label adds this process's matmul-precision setting."""
    return mode_of(mode) in ("fp32", "fp32+fp16-weights", "float64")


def available_modes(device_type: str, checkpoint_dtype: str | None, fbgemm: bool) -> tuple[str, ...]:
    """Modes worth timing here. fp32+fp16-weights only on CPU, with FBGEMM, for bf16/fp16 checkpoints."""
    if device_type == "cuda":
        return CUDA_MODES
    packed = fbgemm and checkpoint_dtype in ("bfloat16", "float16")
    return tuple(m for m in CPU_MODES if m != "fp32+fp16-weights" or packed)


# ---- machine and table keys ---------------------------------------------------------------------
def _cpuinfo() -> tuple[str, list[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), []
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
    flags = set()
    for ln in text.splitlines():
        if ln.startswith(("flags", "Features")):
            flags.update(ln.split(":", 1)[1].split())
    return model or platform.machine(), sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def machine_key(device: torch.device | str = "cpu") -> str:
    """The CUDA device name, or the CPU model name + the matmul-relevant flags + usable cores."""
    device = torch.device(device)
    if device.type == "cuda":
        return "cuda:" + torch.cuda.get_device_name(device)
    model, flags = _cpuinfo()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # kernels limited to another instruction set than the CPU's (make test-loaded CPU_ISA=avx2) are another machine
    forced = [f"{k}={os.environ[k]}" for k in ISA_ENV if os.environ.get(k)]
    return f"cpu:{model}|{','.join(flags) or 'no-simd-flags'}|{cores} cores" + "".join(f"|{f}" for f in forced)


def table_key(machine: str, fingerprint: str, torch_version: str = torch.__version__) -> str:
    blob = json.dumps([TABLE_SCHEME, machine, fingerprint, torch_version])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


# ---- the table --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ComputeTable:
    """Measured forward cost by size, per mode, for one target on one machine."""

    machine: str
    fingerprint: str
    torch_version: str
    forward_ms: dict[str, dict[int, float]]  # mode -> {q: ms}
    measured_at: str = ""
    busy: bool = False  # other work was running while it was timed: re-timed once the machine is quiet
    # mode -> whether every linear of the model gave each row the same bits at every call size here (shape_check)
    rows_stable: dict[str, bool] = field(default_factory=dict)
    # mode -> largest |logit| difference between a verify forward and one-token steps (attention's residual)
    verify_logit_diff: dict[str, float] = field(default_factory=dict)
    prefill_ms: dict[str, float] = field(default_factory=dict)  # mode -> ms of a PREFILL_ROWS-token forward

    def exact(self, mode: str) -> bool:
        """Exact here: fp32 math (is_exact_mode) whose linears passed the row-stability check on this machine."""
        return is_exact_mode(mode) and self.rows_stable.get(mode, False)

    @property
    def key(self) -> str:
        return table_key(self.machine, self.fingerprint, self.torch_version)

    def to_json(self) -> str:
        return json.dumps({"scheme": TABLE_SCHEME, "machine": self.machine, "fingerprint": self.fingerprint,
                           "torch_version": self.torch_version, "measured_at": self.measured_at,
                           "busy": self.busy, "rows_stable": self.rows_stable,
                           "verify_logit_diff": self.verify_logit_diff, "prefill_ms": self.prefill_ms,
                           "forward_ms": {m: {str(q): ms for q, ms in r.items()} for m, r in self.forward_ms.items()}},
                          indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "ComputeTable":
        """Parse and check a cached table; ComputeTableError with the reason when it is unusable."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ComputeTableError(f"not JSON ({e})") from None
        if not isinstance(raw, dict) or raw.get("scheme") != TABLE_SCHEME:
            raise ComputeTableError(f"scheme {raw.get('scheme') if isinstance(raw, dict) else None!r} != {TABLE_SCHEME}")
        rows = raw.get("forward_ms")
        if not isinstance(rows, dict) or not rows:
            raise ComputeTableError("no forward_ms rows")
        forward = {}
        for mode, row in rows.items():
            if mode not in MODE_DTYPES:
                raise ComputeTableError(f"unknown mode {mode!r}")
            try:
                forward[mode] = {int(q): float(ms) for q, ms in row.items()}
            except (AttributeError, TypeError, ValueError):
                raise ComputeTableError(f"mode {mode}: forward_ms is not a {{tokens: ms}} map") from None
            if set(forward[mode]) != set(PROBE_SIZES):
                raise ComputeTableError(f"mode {mode}: sizes {sorted(forward[mode])} != {list(PROBE_SIZES)}")
            if not all(math.isfinite(v) and v > 0 for v in forward[mode].values()):
                raise ComputeTableError(f"mode {mode}: a time is not a positive number")
        stable, diff = raw.get("rows_stable"), raw.get("verify_logit_diff")
        if not isinstance(stable, dict) or not set(forward) <= set(stable) or \
                not all(isinstance(v, bool) for v in stable.values()):
            raise ComputeTableError("no row-stability result for every mode (rows_stable)")
        if not isinstance(diff, dict) or not set(forward) <= set(diff) or \
                not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in diff.values()):
            raise ComputeTableError("no verify residual for every mode (verify_logit_diff, a number >= 0)")
        prefill = raw.get("prefill_ms")
        if not isinstance(prefill, dict) or not set(forward) <= set(prefill) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                for v in prefill.values()):
            raise ComputeTableError("no prefill cost for every mode (prefill_ms, a positive number of ms)")
        try:
            return cls(machine=str(raw["machine"]), fingerprint=str(raw["fingerprint"]),
                       torch_version=str(raw["torch_version"]), forward_ms=forward,
                       measured_at=str(raw.get("measured_at", "")), busy=bool(raw.get("busy", False)),
                       rows_stable={m: stable[m] for m in forward},
                       verify_logit_diff={m: float(diff[m]) for m in forward},
                       prefill_ms={m: float(prefill[m]) for m in forward})
        except KeyError as e:
            raise ComputeTableError(f"missing field {e}") from None


# ---- scores ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AcceptanceProfile:
    """A draft tree with each node's probability of being accepted (root → node path), tree order."""

    accept: tuple[float, ...]
    parents: tuple[int, ...]  # -1 = child of the root
    source: str

    @property
    def depths(self) -> tuple[int, ...]:
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return tuple(out)


# REFERENCE_TREE: a 16-node tree of a reasonably good EAGLE-3 head (not this project's small one):
# a main chain accepted with 0.6, 0.45, 0.35, 0.27, 0.21, 0.16, 0.12, 0.09 (cumulative, depths 1-8),
# second choices at depths 1-4 (0.15, 0.10, 0.07, 0.05), third choices at depths 1-2 (0.06, 0.04)
# and two children under the depth-1 second choice (0.09, 0.06). Full tree: 3.87 tokens per step.
REFERENCE_TREE = AcceptanceProfile(
    accept=(0.6, 0.45, 0.35, 0.27, 0.21, 0.16, 0.12, 0.09, 0.15, 0.10, 0.07, 0.05, 0.06, 0.04, 0.09, 0.06),
    parents=(-1, 0, 1, 2, 3, 4, 5, 6, -1, 0, 1, 2, -1, 0, 8, 14),
    source="reference tree (main chain 0.6, 0.45, 0.35, ...; 16 nodes)",
)


def profile_from_alpha(alpha: Sequence[float], max_depth: int = 16, source: str = "head alpha") -> AcceptanceProfile:
    """A chain from a head's per-depth conditional acceptance (head.json metrics ``heldout_*.alpha``:
    P(depth d accepted | depth d-1 was)): node d is accepted with alpha[0] * ... * alpha[d-1]."""
    accept, p = [], 1.0
    for a in list(alpha)[:max_depth]:
        p *= min(1.0, max(0.0, float(a)))
        if p <= 0:
            break
        accept.append(p)
    if not accept:
        raise ValueError("alpha gives no node a positive acceptance")
    return AcceptanceProfile(tuple(accept), tuple(range(-1, len(accept) - 1)), source)


def plain_score(forward_ms: dict[int, float]) -> float:
    """Tokens per ms of plain decoding: one token per one-token forward."""
    return 1.0 / forward_ms[1]


def speculative_score(forward_ms: dict[int, float], profile: AcceptanceProfile = REFERENCE_TREE
                      ) -> tuple[float, int]:
    """(expected committed tokens per ms, nodes verified) at the tree size that pays best."""
    cost = VerifyCost(points=dict(forward_ms))
    draft_ms = DRAFT_FRACTION * forward_ms[1]
    accept = torch.tensor(profile.accept)
    keep = best_prefix(accept, torch.tensor(profile.parents), torch.tensor(profile.depths), cost, draft_ms)
    # the engine drafts every step, so the drafting cost counts even when no node pays for its verify
    return (1.0 + float(accept[keep].sum())) / (draft_ms + cost(1 + len(keep))), len(keep)


def mode_scores(table: ComputeTable, profile: AcceptanceProfile = REFERENCE_TREE) -> dict[str, dict]:
    """Per mode: plain ms/token, both scores and the best tree size (what describe_compute prints)."""
    out = {}
    for mode, row in table.forward_ms.items():
        spec, nodes = speculative_score(row, profile)
        out[mode] = {"exact": table.exact(mode), "rows_stable": table.rows_stable.get(mode),
                     "verify_logit_diff": table.verify_logit_diff.get(mode),
                     "plain_ms_per_token": round(row[1], 3),
                     "plain_tokens_per_ms": round(plain_score(row), 5), "speculative_tokens_per_ms": round(spec, 5),
                     "best_tree_nodes": nodes, "forward_ms": {q: round(ms, 3) for q, ms in sorted(row.items())}}
    return out


# ---- the choice ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ComputeChoice:
    """Which mode a target runs in and why; `table` when a measurement backs it."""

    mode: str
    reason: str
    source: str  # "measured" | "cache" | "only exact mode" | "compute=" | "dtype=" | "ADAPTIVE_EAGLE_DTYPE" | "train"
    table: ComputeTable | None = None
    purpose: str = "decode"  # load_target's purpose: "decode" (= speculative), "plain" or "train"
    notes: tuple[str, ...] = field(default_factory=tuple)  # e.g. why a cached table was refused


def choose(table: ComputeTable, purpose: str = "speculative", allow_inexact: bool = False,
           modes: Iterable[str] | None = None, profile: AcceptanceProfile = REFERENCE_TREE) -> tuple[str, str]:
    """(mode, reason): the highest-scoring mode for `purpose` among the exact ones (and the inexact
    ones only when allow_inexact), restricted to `modes` when given."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}; got {purpose!r}")
    rows = {m: r for m, r in table.forward_ms.items() if modes is None or m in set(modes)}
    scores = {m: (plain_score(r) if purpose == "plain" else speculative_score(r, profile)[0]) for m, r in rows.items()}
    allowed = {m: s for m, s in scores.items() if allow_inexact or table.exact(m)}
    fallback = not allowed and not allow_inexact
    if fallback:  # no mode passed the row-stability check here: the fp32-math ones, labelled (Target.lossless)
        allowed = {m: s for m, s in scores.items() if is_exact_mode(m)}
    if not allowed:
        raise ValueError(f"no {'' if allow_inexact else 'exact '}compute mode in the table ({', '.join(rows) or 'empty'})")
    best = max(allowed, key=lambda m: (allowed[m], table.exact(m)))

    def label(m: str) -> str:
        return ("" if table.exact(m) else " (rows not stable here)" if is_exact_mode(m) else " (inexact)")

    unit = "tokens/ms predicted" if purpose == "speculative" else "tokens/ms"
    others = ", ".join(f"{m} {s:.4f}{label(m)}" for m, s in sorted(scores.items(), key=lambda kv: -kv[1]) if m != best)
    kind = "fp32-math" if fallback else "" if allow_inexact else "exact "
    reason = (f"{best}: fastest {kind}{' ' if fallback else ''}mode for {purpose} decoding "
              f"({allowed[best]:.4f} {unit}{'; others: ' + others if others else ''})")
    if fallback:
        reason += ("; no mode passed the row-stability check here (a linear's rows depend on how many rows its call "
                   "holds), so greedy speculative output may differ from plain greedy where two tokens nearly tie")
    faster = [m for m, s in scores.items() if s > allowed[best] and m not in allowed]
    if faster:
        reason += f"; {', '.join(faster)} would be faster but is not exact here (pass it explicitly to use it)"
    return best, reason


def choose_mode(table: ComputeTable, purpose: str = "speculative", allow_inexact: bool = False,
                profile: AcceptanceProfile = REFERENCE_TREE) -> str:
    """The fastest exact mode for `purpose` ("speculative", or "plain" when there is no head);
    inexact modes (bf16, fp16) only when allow_inexact."""
    return choose(table, purpose, allow_inexact, profile=profile)[0]


# ---- measuring -----------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Probe:
    """One model's forward of q tokens over a cached `prefix`-token cache, cut back after each run."""

    def __init__(self, model: torch.nn.Module, top: int, prefix: int) -> None:
        from transformers import DynamicCache

        self.model, self.prefix = model, prefix
        self.device = next(model.parameters()).device
        vocab = model.config.vocab_size
        self.ids = torch.tensor([[(7 * i + 3) % vocab for i in range(prefix + top)]], device=self.device)
        params = inspect.signature(model.forward).parameters  # transformers >= 5.24 renamed past_key_values
        self.kw = "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"
        self.cache = DynamicCache()
        model(input_ids=self.ids[:, :prefix], use_cache=True, **{self.kw: self.cache})
        for _ in range(2):  # warm up kernels and the allocator at the largest size
            self.forward(top)

    def forward(self, q: int) -> None:
        p = self.prefix
        self.model(input_ids=self.ids[:, p:p + q], use_cache=True, **{self.kw: self.cache},
                   position_ids=torch.arange(p, p + q, device=self.device)[None])
        for layer in self.cache.layers:  # back to the prefix (Cache.crop's argument changed meaning across versions)
            layer.keys, layer.values = layer.keys[..., :p, :], layer.values[..., :p, :]

    def time(self, q: int) -> float:
        self.forward(q)  # the first run at a new size warms up
        _sync(self.device)
        t0 = time.perf_counter()
        self.forward(q)
        _sync(self.device)
        return (time.perf_counter() - t0) * 1e3


@dataclass(frozen=True)
class ShapeCheck:
    """What compute-mode measurement found about a model's dependence on a call's shape, on this machine.

    rows_stable: every linear gave each of its input rows the same bits in every call of 1..MAX_ROWS rows
    (cpu_linear.py); a verify forward multiplies q rows at once, plain decoding one, so an exact mode needs it.
    verify_logit_diff: the largest |logit| difference between a verify forward (a chain under the engine's tree
    mask) and the same tokens fed one at a time. Attention reduces over the keys in an order that depends on
    the number of keys and queries (SDPA and eager alike), so this is not 0 even with stable rows: it bounds
    how near a tie of the top two logits must be for greedy speculative output to differ from plain greedy."""

    rows_stable: bool
    verify_logit_diff: float


def _linears(model: torch.nn.Module) -> dict[tuple, torch.nn.Module]:
    """One linear module per (kind, in, out): the shapes a forward multiplies at."""
    out = {}
    for m in model.modules():
        if hasattr(m, "in_features") and hasattr(m, "out_features") and not list(m.children()):
            out.setdefault((type(m).__name__, m.in_features, m.out_features), m)
    return out


@torch.inference_mode()
def rows_stable(model: torch.nn.Module, max_rows: int | None = None, seed: int = 0) -> bool:
    """Whether every linear of `model` (one per kind and shape) gives each row the same bits whether its call
    holds 1, 2, ... or max_rows rows (default cpu_linear.MAX_ROWS), here."""
    from adaptive_eagle.cpu_linear import MAX_ROWS

    n = max_rows or MAX_ROWS
    g = torch.Generator().manual_seed(seed)
    for module in _linears(model).values():
        param = next(module.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        dtype = param.dtype if param is not None and param.dtype.is_floating_point else torch.float32
        x = torch.randn(n, module.in_features, generator=g).to(device=device, dtype=dtype)
        whole = module(x)
        if not all(torch.equal(module(x[:m]), whole[:m]) for m in range(1, n)):
            return False
    return True


@torch.inference_mode()
def verify_logit_diff(model: torch.nn.Module, prefix: int = 24, steps: int = 6) -> float:
    """After the same `prefix`-token prefill: `steps` tokens fed one at a time (plain decoding) vs the same
    tokens verified at once as a chain under the engine's tree mask (tree.tree_attention_mask, as
    engine._verify passes it); the largest |logit| difference (0.0: bit for bit)."""
    from transformers import DynamicCache

    from adaptive_eagle.tree import chain_tree, tree_attention_mask, tree_position_ids

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    ids = [(13 * i + 5) % vocab for i in range(prefix + steps)]
    params = inspect.signature(model.forward).parameters
    kw = "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"

    def prefilled() -> DynamicCache:
        cache = DynamicCache()
        model(input_ids=torch.tensor([ids[:prefix]], device=device), use_cache=True, **{kw: cache},
              position_ids=torch.arange(prefix, device=device)[None])
        return cache

    cache = prefilled()
    one = torch.stack([model(input_ids=torch.tensor([[t]], device=device), use_cache=True, **{kw: cache},
                             position_ids=torch.tensor([[prefix + i]], device=device)).logits[0, -1]
                       for i, t in enumerate(ids[prefix:])])
    chain = chain_tree(ids[prefix + 1:])
    dtype = next(model.parameters()).dtype
    out = model(input_ids=torch.tensor([ids[prefix:]], device=device), use_cache=True, **{kw: prefilled()},
                position_ids=tree_position_ids(chain, prefix)[None].to(device),
                attention_mask=tree_attention_mask(chain, prefix, dtype).to(device))
    return float((one.float() - out.logits[0].float()).abs().max())


def shape_check(model: torch.nn.Module) -> ShapeCheck:
    """rows_stable and verify_logit_diff of `model` here (a few seconds for SmolLM2-135M)."""
    return ShapeCheck(rows_stable(model), verify_logit_diff(model))


@torch.inference_mode()
def time_forwards(models: dict[str, torch.nn.Module], sizes: Sequence[int] = PROBE_SIZES,
                  prefix: int = PROBE_PREFIX, reps: int = 3) -> dict[str, dict[int, float]]:
    """{mode: {q: ms}}: the best of `reps` forwards per mode and size, the modes INTERLEAVED (every
    round times each mode at each size) so that a burst of other load on the machine hits all modes
    alike instead of deciding the ranking."""
    probes = {m: _Probe(model, max(sizes), prefix) for m, model in models.items()}
    out = {m: {q: math.inf for q in sizes} for m in models}
    for _ in range(reps):
        for q in sizes:
            for m, probe in probes.items():
                out[m][q] = min(out[m][q], probe.time(q))
    return out


def time_forward(model: torch.nn.Module, sizes: Sequence[int] = PROBE_SIZES, prefix: int = PROBE_PREFIX,
                 reps: int = 3) -> dict[int, float]:
    """{q: ms} for one model (time_forwards with one mode)."""
    return time_forwards({"model": model}, sizes, prefix, reps)["model"]


def machine_busy(threshold: float = 0.5) -> bool:
    """Whether other work is running (1-minute load average above `threshold` per usable core):
    timings taken now would be noisy."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return load > threshold * cores


def measure_table(make_model: Callable[[str], torch.nn.Module], modes: Sequence[str], machine: str,
                  fingerprint: str, reps: int = 3) -> ComputeTable:
    """Time every mode's model (built by make_model(mode), all held at once, dropped after) over
    PROBE_SIZES, interleaved, after checking each one's shape dependence (`shape_check`); `busy` records
    whether other work was running when timing started."""
    busy = machine_busy()
    models = {mode: make_model(mode) for mode in modes}
    checks = {mode: shape_check(model) for mode, model in models.items()}
    rows = time_forwards(models, PROBE_SIZES, PROBE_PREFIX, reps)
    prefill = time_prefills(models, PREFILL_ROWS, reps)
    del models
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    stable = {m: c.rows_stable for m, c in checks.items()}
    return ComputeTable(machine, fingerprint, torch.__version__, rows, now, busy, stable,
                        {m: c.verify_logit_diff for m, c in checks.items()}, prefill)


@torch.inference_mode()
def time_prefills(models: dict[str, torch.nn.Module], rows: int = PREFILL_ROWS, reps: int = 3) -> dict[str, float]:
    """{mode: ms}: the best of `reps` forwards of `rows` tokens from an empty cache (last row's logits only), per
    mode, interleaved after a warm-up round."""
    out = {m: math.inf for m in models}
    for i in range(reps + 1):
        for m, model in models.items():
            device = next(model.parameters()).device
            ids = (torch.arange(rows, device=device)[None] * 7 + 3) % model.config.vocab_size
            _sync(device)
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
            _sync(device)
            if i:
                out[m] = min(out[m], (time.perf_counter() - t0) * 1e3)
    return out


def read_table(path: Path, machine: str, fingerprint: str, modes: Sequence[str]) -> ComputeTable:
    """The cached table at `path`, checked against this machine, target and mode list."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ComputeTableError(f"unreadable ({e.strerror})") from None
    table = ComputeTable.from_json(text)
    for what, got, want in (("machine", table.machine, machine), ("fingerprint", table.fingerprint, fingerprint),
                            ("torch version", table.torch_version, torch.__version__)):
        if got != want:
            raise ComputeTableError(f"{what} {got!r} != {want!r}")
    missing = [m for m in modes if m not in table.forward_ms]
    if missing:
        raise ComputeTableError(f"modes not measured: {', '.join(missing)}")
    return table


def write_table(path: Path, table: ComputeTable) -> None:
    """Atomically (atomic.py: a temp file in the same folder, then a rename)."""
    from adaptive_eagle.atomic import atomic_write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, table.to_json())


def cached_table(folder: Path, make_model: Callable[[str], torch.nn.Module], modes: Sequence[str], machine: str,
                 fingerprint: str, reps: int = 3, refresh: bool = False) -> tuple[ComputeTable, str, tuple[str, ...]]:
    """(table, "cache" | "measured", notes): the table cached in `folder` for this machine and target,
    or a fresh measurement written there (a missing or unusable file is re-measured; notes say why;
    refresh=True measures again whatever is cached)."""
    path = Path(folder) / f"{table_key(machine, fingerprint)}.json"
    notes: tuple[str, ...] = ()
    if path.exists() and not refresh:
        try:
            table = read_table(path, machine, fingerprint, modes)
            if not (table.busy and not machine_busy()):
                return table, "cache", ()
            notes = (f"cached compute table {path} was timed while the machine was busy; re-measured now that "
                     "it is quiet",)
        except ComputeTableError as e:
            notes = (f"cached compute table {path} refused: {e}; re-measured",)
    table = measure_table(make_model, modes, machine, fingerprint, reps)
    try:
        write_table(path, table)
    except OSError as e:
        notes += (f"could not cache the compute table at {path} ({e.strerror}); it is measured again next time",)
    return table, "measured", notes
