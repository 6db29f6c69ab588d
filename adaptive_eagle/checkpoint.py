"""Head checkpoints: the on-disk formats of a draft head, their validation and conversions.

Owns: one version directory ``<version>/{config.json, model.safetensors, head.json}`` (SGLang's
``LlamaForCausalLMEagle3`` layout plus our provenance; a MoE head is saved as
``AdaptiveEagleMoEForCausalLMEagle3``, a name SGLang and vLLM refuse, since both would load it as
their dense head and silently skip the expert weights), the one function that upgrades old or
foreign config layouts (``upgrade_config``), the checks every load runs (``HeadValidationError``),
and the head's storage dtype names. Public beyond save / load (``__all__``), for a second loader such as
``interop.py``'s import: the readers (``read_json``, ``read_safetensors``), the tensor naming
(``canonical_key``), the checks (``parse_config``, ``check_target``, ``check_tensors``), the assembly of a
checked head (``storage_dtype``, ``fill_head``) and the config.json writer (``config_json``). Writes go
through ``atomic.py`` (``staging_dir`` is re-exported here for older callers). Must not touch: export to /
import from other stacks (``interop.py``), the head math (``draft_head.py``), the registry's champion pointer
or promotion log, the network. Only safetensors and JSON are read or written; nothing is ever unpickled.

Tensor names in ``model.safetensors`` are the head's state-dict keys minus ``embed_tokens.weight``
(embeddings come from the target, frozen). Loading also accepts SGLang's / speculators'
``layers.0.*`` for ``midlayer.*`` and an optional leading ``model.``.

Aux-layer ids: ``adaptive_eagle.aux_layer_ids`` holds OUR convention (k = input of target layer k,
see targets.py), and so does the top-level ``eagle_aux_hidden_state_layer_ids``, which vLLM reads
first and as is (vLLM captures the input of layer k); ``eagle_config.eagle_aux_hidden_state_layer_ids``
holds k - 1 for SGLang (which captures the input of layer id + 1 and ignores the top-level key).
Every place present must agree, and the ids must be strictly ascending and unique. The speculators
export (interop.py) writes k as is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from adaptive_eagle.atomic import atomic_write_text, staging_dir
from adaptive_eagle.draft_head import DraftHeadConfig, Eagle3DraftHead, all_finite, check_aux_layer_ids
from adaptive_eagle.pacing import Pacer, tick
from adaptive_eagle.targets import (
    DTYPES,
    Target,
    default_aux_layer_ids,
    from_sglang_config_layer_ids,
    parse_dtype,
    sglang_config_layer_ids,
)

FORMAT_VERSION = 2  # 2: MoE heads under MOE_ARCH; top-level eagle_aux_hidden_state_layer_ids (optional on load)
CONFIG_FILE, WEIGHTS_FILE, META_FILE = "config.json", "model.safetensors", "head.json"
EMBED_KEY = "embed_tokens.weight"
SGLANG_ARCH = "LlamaForCausalLMEagle3"  # dense heads: SGLang's and vLLM's EAGLE-3 class
MOE_ARCH = "AdaptiveEagleMoEForCausalLMEagle3"  # MoE heads: registered by neither, so both refuse to load them
TOP_LEVEL_IDS = "eagle_aux_hidden_state_layer_ids"  # our ids (input of layer k), where vLLM looks first
LAYER_ID_CONVENTION = (
    "aux_layer_ids[i] = k names the INPUT of target decoder layer k (transformers hidden_states[k]); "
    "the top-level eagle_aux_hidden_state_layer_ids holds k as is (vLLM reads it first); "
    "eagle_config.eagle_aux_hidden_state_layer_ids holds k - 1 because SGLang captures the input of "
    "layer id + 1"
)


class HeadValidationError(ValueError):
    """A checkpoint was refused. The message names the file and the reason."""

    def __init__(self, file: str | os.PathLike, reason: str) -> None:
        self.file, self.reason = str(file), reason
        super().__init__(f"{file}: {reason}")


def utc_now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pydantic_reason(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}" for err in e.errors())


# ---- head.json ------------------------------------------------------------------------------
class _HeadMetaFile(BaseModel):
    """head.json as read from disk (the boundary check behind HeadMeta.from_json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format_version: int = Field(ge=1, description="layout version of the head directory")
    version: str = Field(min_length=1, description="this head's version name (its directory name)")
    parent: str | None = Field(description="version this head was fine-tuned from; null for a root")
    target_name: str = Field(description="target the head drafts for")
    target_fingerprint: str = Field(description="targets.fingerprint_dir of that target; '' = not pinned")
    created: str = Field(description="ISO-8601 UTC time of saving")
    data: dict[str, Any] = Field(default_factory=dict, description="training data summary (window, tokens)")
    training: dict[str, Any] = Field(default_factory=dict, description="training recipe")
    metrics: dict[str, Any] = Field(default_factory=dict, description="evaluation figures")
    sha256: str = Field(pattern=r"^([0-9a-f]{64})?$", description="hex sha256 of model.safetensors")


@dataclass(frozen=True)
class HeadMeta:
    """Provenance of one head version (head.json)."""

    version: str
    parent: str | None
    target_name: str
    target_fingerprint: str
    created: str
    data: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    sha256: str = ""
    format_version: int = FORMAT_VERSION

    @classmethod
    def new(cls, version: str, target_name: str, target_fingerprint: str, parent: str | None = None, **kw):
        """A fresh meta stamped now (sha256 is filled in by save_head)."""
        return cls(version=version, parent=parent, target_name=target_name,
                   target_fingerprint=target_fingerprint, created=utc_now_iso(), **kw)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, file: str | os.PathLike = META_FILE) -> "HeadMeta":
        try:
            m = _HeadMetaFile.model_validate(json.loads(text))
        except json.JSONDecodeError as e:
            raise HeadValidationError(file, f"malformed JSON ({e})") from None
        except ValidationError as e:
            raise HeadValidationError(file, _pydantic_reason(e)) from None
        if m.format_version > FORMAT_VERSION:
            raise HeadValidationError(file, f"format_version {m.format_version} is newer than this code")
        return cls(**m.model_dump())


# ---- config.json ----------------------------------------------------------------------------
class _HeadConfigFile(BaseModel):
    """The head-shaping fields of an upgraded config.json, with range checks."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    hidden_size: int = Field(gt=0, description="draft hidden width H (= target embedding width)")
    target_hidden_size: int = Field(gt=0, description="width of each target aux feature")
    intermediate_size: int = Field(gt=0, description="dense MLP width")
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0, description="the target's vocabulary")
    draft_vocab_size: int = Field(gt=0, description="reduced draft vocabulary (lm_head rows)")
    aux_layer_ids: tuple[int, ...] = Field(min_length=1, description="input-of-layer convention (targets.py)")
    rms_norm_eps: float = Field(gt=0, lt=1)
    rope_theta: float = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    num_experts: int = Field(ge=1, description="1 = dense MLP")
    num_experts_per_tok: int = Field(ge=1)
    moe_intermediate_size: int | None = Field(default=None, gt=0)
    router_aux_loss_coef: float = Field(ge=0)


_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "vocab_size", "draft_vocab_size", "target_hidden_size", "rms_norm_eps", "rope_theta")
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef")


def config_json(f: dict, torch_dtype: str) -> dict:
    """config.json in the current layout (what save_head writes) from DraftHeadConfig.to_dict()-shaped fields
    `f` and the storage dtype's name (storage_dtype_name). Public: the speculators export builds its
    transformer_layer_config from it."""
    ids = [int(k) for k in f["aux_layer_ids"]]
    return {
        "architectures": [MOE_ARCH if f["num_experts"] > 1 else SGLANG_ARCH], "model_type": "llama",
        "num_hidden_layers": 1,
        **{k: f[k] for k in _SHAPE_KEYS},
        "rope_scaling": None, "max_position_embeddings": f["max_position_embeddings"], "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": torch_dtype,
        TOP_LEVEL_IDS: ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_config_layer_ids(ids),
                         "use_aux_hidden_state": True},
        "adaptive_eagle": {"format_version": FORMAT_VERSION, **{k: f[k] for k in _MOE_KEYS}, "aux_layer_ids": ids,
                           "layer_id_convention": LAYER_ID_CONVENTION},
    }


def _from_speculators(raw: dict) -> dict:
    """A speculators ``eagle3`` config flattened to SGLang keys; aux ids kept as ours (no -1)."""
    if raw.get("speculators_model_type") != "eagle3":
        raise HeadValidationError(CONFIG_FILE, f"speculators_model_type {raw.get('speculators_model_type')!r} "
                                               "is not eagle3")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(flag):
            raise HeadValidationError(CONFIG_FILE, f"speculators option {flag}=true is not supported by this head")
    layer = dict(raw.get("transformer_layer_config") or {})
    # speculators writes transformer_layer_config with to_diff_dict() (defaults left out) and reads it
    # back through AutoConfig.for_model: resolve the defaults the same way
    from transformers import AutoConfig

    flat = AutoConfig.for_model(layer.pop("model_type", "llama"), **layer).to_dict()
    flat.update(architectures=[SGLANG_ARCH], draft_vocab_size=raw.get("draft_vocab_size"),
                target_hidden_size=raw.get("target_hidden_size"),
                torch_dtype=raw.get("torch_dtype") or flat.get("torch_dtype"))
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        flat["adaptive_eagle"] = {"aux_layer_ids": list(raw["eagle_aux_hidden_state_layer_ids"])}
    return flat


def _aux_ids(cfg: dict, block: dict, num_target_layers: int | None) -> list[int]:
    """Our aux ids, from whichever places the config holds them: all present must agree, ascending."""
    found: list[tuple[str, list[int]]] = []  # (field as written in config.json, ids in our convention)
    if (ours := block.get("aux_layer_ids")) is not None:
        found.append(("adaptive_eagle.aux_layer_ids", [int(k) for k in ours]))
    if (top := cfg.get(TOP_LEVEL_IDS)) is not None:
        found.append((f"{TOP_LEVEL_IDS} (top level, read by vLLM as is)", [int(k) for k in top]))
    if (sglang_ids := (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")) is not None:
        found.append((f"eagle_config.eagle_aux_hidden_state_layer_ids {list(sglang_ids)} (+1 = input of layer, "
                      "read by SGLang)", list(from_sglang_config_layer_ids(sglang_ids))))
    if not found:
        if num_target_layers is None:
            raise HeadValidationError(CONFIG_FILE, "no aux layer ids (no eagle_config, no top-level ids): the "
                                                   "default [2, L//2, L-3] depends on the target's layer count; "
                                                   "pass the target")
        found.append((f"the default aux layer ids for a {num_target_layers}-layer target",
                      list(default_aux_layer_ids(num_target_layers))))
    field0, ids = found[0]
    for field_, other in found[1:]:
        if other != ids:
            raise HeadValidationError(CONFIG_FILE, f"{field_} = {other} disagree with {field0} = {ids} "
                                                   "(input-of-layer convention)")
    try:
        return list(check_aux_layer_ids(ids, field0))
    except ValueError as e:
        raise HeadValidationError(CONFIG_FILE, str(e)) from None


def _check_architecture(archs: list[str], block: dict) -> None:
    """Dense heads are LlamaForCausalLMEagle3 (or a foreign EAGLE-3 name), MoE heads MOE_ARCH.

    A format-1 MoE head saved under the dense name is upgraded (the caller rewrites the name); from
    format 2 on that mismatch is refused, as is MOE_ARCH on a dense config.
    """
    if not any("Eagle3" in a for a in archs):
        raise HeadValidationError(CONFIG_FILE, f"architectures {archs} is not an EAGLE-3 head")
    experts, version = block.get("num_experts", 1), block.get("format_version", FORMAT_VERSION)
    if MOE_ARCH in archs and not (isinstance(experts, int) and experts > 1):
        raise HeadValidationError(CONFIG_FILE, f"architectures {archs} names a MoE head but adaptive_eagle.num_experts "
                                               f"is {experts!r}; a dense head is [{SGLANG_ARCH!r}]")
    if isinstance(experts, int) and experts > 1 and MOE_ARCH not in archs and version >= 2:
        raise HeadValidationError(CONFIG_FILE, f"architectures {archs} with adaptive_eagle.num_experts {experts}: "
                                               f"a MoE head must be [{MOE_ARCH!r}] (SGLang and vLLM would load it as "
                                               "their dense head and skip the expert weights)")


def upgrade_config(raw: dict, *, num_target_layers: int | None = None) -> dict:
    """Map any known config.json layout to the current one (what save_head writes).

    Known layouts: ours (format_version 2; format 1 wrote MoE heads under the dense name and no
    top-level aux ids); SGLang / SpecForge / official EAGLE-3
    (``LlamaForCausalLMEagle3``, no ``adaptive_eagle`` block, maybe no ``eagle_config``); vLLM
    speculators ``eagle3``. Without any aux ids, SGLang and vLLM capture [2, L//2, L-3] of the
    target (input-of-layer, as ours): that needs ``num_target_layers``, else this raises.
    """
    if not isinstance(raw, dict):
        raise HeadValidationError(CONFIG_FILE, "top level must be a JSON object")
    cfg = _from_speculators(raw) if "speculators_model_type" in raw else dict(raw)
    if cfg.get("num_hidden_layers", 1) != 1:
        raise HeadValidationError(CONFIG_FILE, f"num_hidden_layers {cfg['num_hidden_layers']}: only 1-layer heads")
    block = dict(cfg.get("adaptive_eagle") or {})
    if block.get("format_version", FORMAT_VERSION) > FORMAT_VERSION:
        raise HeadValidationError(CONFIG_FILE, f"adaptive_eagle.format_version {block['format_version']} is newer")
    _check_architecture(list(cfg.get("architectures") or [SGLANG_ARCH]), block)
    required = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    if missing := [k for k in required if cfg.get(k) is None]:
        raise HeadValidationError(CONFIG_FILE, f"missing fields {missing}")
    heads, hidden, vocab = cfg["num_attention_heads"], cfg["hidden_size"], cfg["vocab_size"]
    fields = dict(
        hidden_size=hidden, intermediate_size=cfg["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // max(1, int(heads)),
        vocab_size=vocab, draft_vocab_size=cfg.get("draft_vocab_size") or vocab,  # SGLang: None = full vocab
        target_hidden_size=cfg.get("target_hidden_size") or hidden, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        aux_layer_ids=_aux_ids(cfg, block, num_target_layers),
        num_experts=block.get("num_experts", 1), num_experts_per_tok=block.get("num_experts_per_tok", 2),
        moe_intermediate_size=block.get("moe_intermediate_size"),
        router_aux_loss_coef=block.get("router_aux_loss_coef", 0.01),
    )
    return config_json(fields, str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"))


def read_json(path: Path) -> Any:
    """A head directory's JSON file; a missing or malformed file is refused (HeadValidationError naming it)."""
    if not path.is_file():
        raise HeadValidationError(path, "missing")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeadValidationError(path, f"malformed JSON ({e})") from None


def parse_config(raw: dict, path: Path, target: Target | None) -> tuple[DraftHeadConfig, dict]:
    """A config.json of any known layout (`raw`, read from `path`) as (the checked DraftHeadConfig, the
    config upgraded to the current layout: upgrade_config). `target` supplies the layer count when the file
    names no aux layer ids. Any refusal is a HeadValidationError naming `path`."""
    try:
        upgraded = upgrade_config(raw, num_target_layers=target.num_layers if target is not None else None)
        flat = {**upgraded, **upgraded["adaptive_eagle"]}
        return DraftHeadConfig(**_HeadConfigFile.model_validate(flat).model_dump()), upgraded
    except HeadValidationError as e:
        raise HeadValidationError(path, e.reason) from None
    except ValidationError as e:
        raise HeadValidationError(path, _pydantic_reason(e)) from None
    except (ValueError, TypeError) as e:  # DraftHeadConfig.__post_init__ cross-field checks, non-int ids
        raise HeadValidationError(path, str(e)) from None


def read_config(directory: str | os.PathLike, target: Target | None = None) -> DraftHeadConfig:
    """The DraftHeadConfig of a head directory (any known layout; see upgrade_config)."""
    path = Path(directory) / CONFIG_FILE
    return parse_config(read_json(path), path, target)[0]


# ---- tensors --------------------------------------------------------------------------------
def file_sha256(path: str | os.PathLike, pace: Pacer | None = None) -> str:
    """Hex sha256 of a file; with `pace`, in 1 MiB units paced by it (a hot swap's share of a core)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20 if pace is not None else 1 << 22), b""):
            h.update(chunk)
            tick(pace)
    return h.hexdigest()


def canonical_key(name: str) -> str:
    """A tensor's name in our layout: SGLang's / speculators' ``layers.0.*`` reads as ``midlayer.*``, a leading
    ``model.`` is dropped."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, on the CPU (the only way a head's weights are read: nothing is
    unpickled); a missing, truncated or corrupt file is refused (HeadValidationError naming it)."""
    if not path.is_file():
        raise HeadValidationError(path, "missing")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise HeadValidationError(path, f"unreadable safetensors file, truncated or corrupt ({e})") from None


def check_tensors(head: Eagle3DraftHead, raw: dict[str, torch.Tensor], where: Path | str,
                  pace: Pacer | None = None) -> dict[str, torch.Tensor]:
    """`raw` under canonical names (canonical_key; the embeddings dropped: they come from the target), checked
    against `head`'s layout: names, shapes, dtypes, finiteness and the d2t / t2d vocab map. `head` may live on
    the meta device (only its layout is read). Refusals are HeadValidationErrors naming `where`."""
    tensors: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        key = canonical_key(name)
        if key in tensors:
            raise HeadValidationError(where, f"tensor {name!r} duplicates {key!r}")
        tensors[key] = t
    tensors.pop(EMBED_KEY, None)  # embeddings always come from the target
    expected = {k: v for k, v in head.state_dict().items() if k != EMBED_KEY}
    if unexpected := sorted(set(tensors) - set(expected)):
        raise HeadValidationError(where, f"unexpected tensors {unexpected}")
    if missing := sorted(set(expected) - set(tensors)):
        raise HeadValidationError(where, f"missing tensors {missing}")
    for key, ref in expected.items():
        t = tensors[key]
        if tuple(t.shape) != tuple(ref.shape):
            raise HeadValidationError(where, f"tensor {key!r} has shape {list(t.shape)}, the config implies "
                                             f"{list(ref.shape)}")
        if ref.is_floating_point():
            if not t.is_floating_point():
                raise HeadValidationError(where, f"tensor {key!r} has dtype {t.dtype}, expected a floating dtype")
            if not all_finite(t):
                raise HeadValidationError(where, f"tensor {key!r} has non-finite values (NaN or inf)")
            tick(pace)
        elif t.dtype != ref.dtype and not (key == "d2t" and t.dtype == torch.int32):
            raise HeadValidationError(where, f"tensor {key!r} has dtype {t.dtype}, expected {ref.dtype}")
    _check_vocab_map(head.cfg, tensors["d2t"].long(), tensors["t2d"], where)
    return tensors


def _check_vocab_map(cfg: DraftHeadConfig, d2t: torch.Tensor, t2d: torch.Tensor, where: Path | str) -> None:
    n = cfg.draft_vocab_size
    if int(t2d.sum()) != n:
        raise HeadValidationError(where, f"t2d marks {int(t2d.sum())} target tokens, draft_vocab_size is {n}")
    ids = torch.arange(n) + d2t  # [draft_vocab] target id of each draft id
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise HeadValidationError(where, f"d2t maps draft ids outside the target vocab [0, {cfg.vocab_size})")
    if ids.unique().numel() != n or not bool(t2d[ids].all()):
        raise HeadValidationError(where, "d2t and t2d disagree: arange + d2t must hit exactly the True rows of t2d")


def check_target(cfg: DraftHeadConfig, target: Target, where: Path, meta: HeadMeta | None = None, *,
                 allow_fingerprint_mismatch: bool = False) -> None:
    """Refuse (HeadValidationError naming `where`) a head config that cannot draft for `target`: vocab, widths
    and aux layer ids must match; with `meta`, a pinned target fingerprint must too, unless
    `allow_fingerprint_mismatch`."""
    tc, n = target.config, target.num_layers
    if cfg.vocab_size != tc.vocab_size:
        raise HeadValidationError(where, f"vocab_size {cfg.vocab_size} != target {target.name!r} vocab_size "
                                         f"{tc.vocab_size}")
    if cfg.target_hidden_size != tc.hidden_size:
        raise HeadValidationError(where, f"target_hidden_size {cfg.target_hidden_size} != target hidden_size "
                                         f"{tc.hidden_size}")
    if cfg.hidden_size != (width := target.input_embeddings().shape[1]):
        raise HeadValidationError(where, f"hidden_size {cfg.hidden_size} != target embedding width {width}")
    if bad := [k for k in cfg.aux_layer_ids if not 0 < k < n]:
        raise HeadValidationError(where, f"aux layer ids {bad} out of range 1..{n - 1} for a {n}-layer target")
    if tuple(cfg.aux_layer_ids) != tuple(target.aux_layer_ids):
        raise HeadValidationError(where, f"aux layer ids {list(cfg.aux_layer_ids)} != the target's configured "
                                         f"{list(target.aux_layer_ids)} (input-of-layer convention)")
    if (meta is not None and meta.target_fingerprint and meta.target_fingerprint != target.fingerprint
            and not allow_fingerprint_mismatch):
        raise HeadValidationError(where.parent / META_FILE, f"target fingerprint {meta.target_fingerprint} != loaded "
                                  f"target {target.fingerprint} (allow_fingerprint_mismatch=True loads anyway)")


def _cast(t: torch.Tensor, dtype: torch.dtype, pace: Pacer | None) -> torch.Tensor:
    """t in dtype; with `pace`, a large tensor is converted in blocks of rows (~1 MiB each), paced."""
    if t.dtype == dtype or pace is None or t.dim() == 0 or t.numel() * t.element_size() <= 1 << 20:
        out = t.to(dtype)
        tick(pace)
        return out
    out = torch.empty(t.shape, dtype=dtype)
    rows = max(1, (1 << 20) // max(1, t[0].numel() * t.element_size()))
    for i in range(0, t.shape[0], rows):
        out[i:i + rows].copy_(t[i:i + rows])
        tick(pace)
    return out


def fill_head(head: Eagle3DraftHead, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
              target: Target | None, share_embeddings: bool = False, pace: Pacer | None = None) -> Eagle3DraftHead:
    """Make `head` hold exactly `tensors` (cast to dtype) and the target's frozen embeddings (zeros without one;
    a copy unless `share_embeddings`, which reads the target's own tensor when its dtype is `dtype`)."""
    state = {k: _cast(t, dtype, pace) if t.is_floating_point() else t for k, t in tensors.items()}
    state["d2t"] = state["d2t"].long()
    if target is None:
        state[EMBED_KEY] = torch.zeros(head.cfg.vocab_size, head.cfg.hidden_size, dtype=dtype)
    elif share_embeddings:  # on the target's device; `load_head` moves the head there
        state[EMBED_KEY] = target.input_embeddings().detach().to(dtype=dtype)
    else:
        state[EMBED_KEY] = target.input_embeddings().detach().to("cpu", dtype).clone()
    head.load_state_dict(state, strict=True, assign=True)
    head.embed_tokens.weight.requires_grad_(False)
    return head


def storage_dtype_name(dtype: torch.dtype) -> str:
    """The name config.json records for a head stored in `dtype` ("bfloat16", "float32", "float16":
    torch's own spelling, which targets.DTYPES, the one dtype table, also accepts)."""
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) != dtype:
        raise ValueError(f"dtype {dtype} cannot be stored; use one of bfloat16, float32, float16")
    return name


def storage_dtype(config: dict, tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype a head was stored in: its (upgraded) config's torch_dtype, else that of its first floating
    tensor, else float32."""
    try:
        return parse_dtype(config["torch_dtype"])
    except (KeyError, ValueError, AttributeError):  # absent, unknown or not a string: the tensors decide
        return next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)


# ---- save / load ----------------------------------------------------------------------------
def save_head(head: Eagle3DraftHead, directory: str | os.PathLike, meta: HeadMeta,
              dtype: torch.dtype = torch.bfloat16, *, overwrite: bool = False) -> HeadMeta:
    """Write one version directory atomically; returns `meta` with sha256 (and created) filled in.

    Refuses (HeadValidationError) a head whose weights are non-finite after the cast to `dtype`, or
    whose aux layer ids are not strictly ascending and unique (no serving stack could feed it).
    """
    final = Path(directory)
    dtype_name = storage_dtype_name(dtype)
    try:
        check_aux_layer_ids(head.cfg.aux_layer_ids)
    except ValueError as e:
        raise HeadValidationError(f"{final} (head being saved)", str(e)) from None
    tensors = {k: (t.detach().to("cpu", dtype) if t.is_floating_point() else t.detach().cpu()).contiguous()
               for k, t in head.state_dict().items() if k != EMBED_KEY}
    tensors["d2t"], tensors["t2d"] = tensors["d2t"].long(), tensors["t2d"].bool()
    check_tensors(head, tensors, f"{final} (head being saved as {dtype_name})")
    with staging_dir(final, overwrite) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(config_json(head.cfg.to_dict(), dtype_name), indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        meta = dataclasses.replace(meta, sha256=file_sha256(tmp / WEIGHTS_FILE), format_version=FORMAT_VERSION,
                                   created=meta.created or utc_now_iso())
        (tmp / META_FILE).write_text(meta.to_json())
    return meta


def update_metrics(directory: str | os.PathLike, metrics: dict) -> HeadMeta:
    """Merge evaluation results into head.json's metrics (weights and sha256 untouched), atomically."""
    d = Path(directory)
    meta = HeadMeta.from_json((d / META_FILE).read_text(), d / META_FILE)
    meta = dataclasses.replace(meta, metrics={**meta.metrics, **metrics})
    atomic_write_text(d / META_FILE, meta.to_json())
    return meta


@dataclass(frozen=True)
class LoadedHead:
    head: Eagle3DraftHead
    meta: HeadMeta
    config: DraftHeadConfig


def load_head(directory: str | os.PathLike, target: Target | None = None, *, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None, verify_checksum: bool = True,
              allow_fingerprint_mismatch: bool = False, share_embeddings: bool = False,
              pace: Pacer | None = None) -> LoadedHead:
    """Validate and load a head version; with `target`, also check compatibility and attach its embeddings.

    dtype None keeps the saved dtype (bit-exact). Without a target, embed_tokens is zeros; with one, a copy
    of its input embeddings, or (`share_embeddings`: a head loaded only to draft for that target, as a
    server's swap does, with the target's dtype and device) the target's own tensor, never to be written. A head.json
    whose target_fingerprint is "" (imported without a target) is not pinned: only the vocab, width
    and aux checks apply. `pace`: do the work in small units paced by it (a server's hot swap shares the cores
    with requests decoding). Raises HeadValidationError on any refusal.
    """
    d = Path(directory)
    for name in (CONFIG_FILE, WEIGHTS_FILE, META_FILE):
        if not (d / name).is_file():
            raise HeadValidationError(d / name, "missing")
    meta = HeadMeta.from_json((d / META_FILE).read_text(), d / META_FILE)
    cfg, upgraded = parse_config(read_json(d / CONFIG_FILE), d / CONFIG_FILE, target)
    if target is not None:
        check_target(cfg, target, d / CONFIG_FILE, meta, allow_fingerprint_mismatch=allow_fingerprint_mismatch)
    if verify_checksum and (digest := file_sha256(d / WEIGHTS_FILE, pace)) != meta.sha256:
        raise HeadValidationError(d / WEIGHTS_FILE, f"sha256 mismatch: file {digest[:16]}…, head.json "
                                                    f"{meta.sha256[:16]}…")
    with torch.device("meta"):  # the reference layout without storage: every tensor comes from the file or the target
        head = Eagle3DraftHead(cfg)  # (a randomly initialised head would cost a hot swap ~0.25 s of CPU for nothing)
    tensors = check_tensors(head, read_safetensors(d / WEIGHTS_FILE), d / WEIGHTS_FILE, pace)
    head = fill_head(head, tensors, dtype or storage_dtype(upgraded, tensors), target, share_embeddings,
                      pace).to(device)
    return LoadedHead(head=head, meta=meta, config=cfg)


__all__ = [
    "CONFIG_FILE", "EMBED_KEY", "FORMAT_VERSION", "META_FILE", "MOE_ARCH", "SGLANG_ARCH", "TOP_LEVEL_IDS",
    "WEIGHTS_FILE", "HeadMeta", "HeadValidationError", "LoadedHead",
    "canonical_key", "check_target", "check_tensors", "config_json", "file_sha256", "fill_head", "load_head",
    "parse_config", "read_config", "read_json", "read_safetensors", "save_head", "staging_dir", "storage_dtype",
    "storage_dtype_name", "update_metrics", "upgrade_config", "utc_now_iso",
]
