"""Interop with other EAGLE-3 stacks: export to vLLM ``speculators``, import from SpecForge / SGLang.

Owns: the speculators export layout (``Eagle3Speculator`` config.json + ``layers.0.*`` tensors) and
reading foreign EAGLE-3 checkpoints (single or sharded safetensors) into one of our head version
directories. The upstream files each layout follows are cited in the function docstrings. Must not
touch: our own on-disk format, its validation and the config upgrade (``checkpoint.py``: every
import goes through its checks and ``save_head``), the head math (``draft_head.py``), the
registry, the network. Only safetensors and JSON are read or written; nothing is ever unpickled.

Aux-layer ids: the speculators export writes our k as is (vLLM captures the input of layer k);
foreign configs are mapped to our convention by ``checkpoint.upgrade_config``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from adaptive_eagle.atomic import staging_dir
from adaptive_eagle.checkpoint import (  # the format's public checks and readers, the ones load_head runs
    CONFIG_FILE,
    EMBED_KEY,
    TOP_LEVEL_IDS,
    WEIGHTS_FILE,
    HeadMeta,
    HeadValidationError,
    canonical_key,
    check_target,
    check_tensors,
    config_json,
    file_sha256,
    fill_head,
    load_head,
    parse_config,
    read_json,
    read_safetensors,
    save_head,
    storage_dtype,
    storage_dtype_name,
)
from adaptive_eagle.draft_head import Eagle3DraftHead
from adaptive_eagle.targets import Target


# ---- vLLM speculators export -----------------------------------------------------------------
def export_speculators(head_dir: str | os.PathLike, out_dir: str | os.PathLike, *, target: Target | None = None,
                       verifier_name_or_path: str | None = None, speculative_tokens: int = 3,
                       overwrite: bool = False) -> Path:
    """Write a vLLM ``speculators`` EAGLE-3 checkpoint (config.json + model.safetensors) of a dense head.

    Followed (vllm-project/speculators): ``src/speculators/models/eagle3/config.py``
    (Eagle3SpeculatorConfig: speculators_model_type "eagle3", architectures ["Eagle3Speculator"],
    transformer_layer_config, draft_vocab_size, norm_before_residual, target_hidden_size,
    eagle_aux_hidden_state_layer_ids); ``src/speculators/config.py`` (speculators_config: algorithm,
    proposal_methods, default_proposal_method, verifier{name_or_path, architectures});
    ``src/speculators/proposals/greedy.py`` (proposal_type "greedy", speculative_tokens);
    ``src/speculators/convert/eagle/eagle3_converter.py`` (renames ``midlayer.*`` to ``layers.0.*``,
    keeps fc / norm / lm_head / d2t / t2d; embed_tokens optional). vLLM side:
    ``vllm/transformers_utils/configs/speculators/{base,algos}.py`` read those fields (aux ids as
    is) and ``vllm/model_executor/models/llama_eagle3.py`` loads ``layers.0.*`` (or ``midlayer.*``),
    loads d2t, skips t2d and shares the target's embeddings when the file has none.
    Our layer keeps the un-normed hidden stream as the residual: norm_before_residual = false, written
    out always, because vLLM's ``update_eagle3`` defaults an absent key to true.
    """
    loaded = load_head(head_dir, target)
    cfg, meta = loaded.config, loaded.meta
    if cfg.num_experts != 1:
        raise ValueError(f"{head_dir}: speculators/vLLM EAGLE-3 has a dense MLP; a {cfg.num_experts}-expert head "
                         "cannot be exported")
    tensors = {_speculators_key(k): t.detach().cpu().contiguous()
               for k, t in loaded.head.state_dict().items() if k != EMBED_KEY}
    dtype_name = storage_dtype_name(loaded.head.fc.weight.dtype)
    arch = (getattr(target.config, "architectures", None) or [type(target.model).__name__]) if target else None
    layer = {k: v for k, v in config_json(cfg.to_dict(), dtype_name).items()
             if k not in ("architectures", "eagle_config", "adaptive_eagle", "draft_vocab_size", "target_hidden_size",
                          TOP_LEVEL_IDS)}
    verifier = {"name_or_path": verifier_name_or_path or (str(target.path) if target else meta.target_name),
                "architectures": list(arch or ["LlamaForCausalLM"])}
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": {**layer, "mlp_bias": False},
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": False,  # pinned: vLLM reads an absent key as true
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),  # vLLM: input of layer k, no -1
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy", "verifier": verifier,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        },
        "torch_dtype": dtype_name,
        "adaptive_eagle": {"version": meta.version, "sha256": meta.sha256,
                           "target_fingerprint": meta.target_fingerprint},
    }
    final = Path(out_dir)
    with staging_dir(final, overwrite) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    return final


def _speculators_key(key: str) -> str:
    return "layers.0." + key.removeprefix("midlayer.") if key.startswith("midlayer.") else key


# ---- SpecForge / official EAGLE-3 import ------------------------------------------------------
def _read_source_weights(src: Path) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of a foreign checkpoint (single or sharded safetensors) and a digest of its files."""
    index = src / "model.safetensors.index.json"
    if (src / WEIGHTS_FILE).is_file():
        files = [src / WEIGHTS_FILE]
    elif index.is_file():
        files = [src / f for f in sorted(set(read_json(index).get("weight_map", {}).values()))]
    else:
        files = sorted(src.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in src.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        raise HeadValidationError(src, f"pickle checkpoints are not loaded; convert to safetensors ({pickles})"
                                  if pickles else "no model.safetensors")
    tensors: dict[str, torch.Tensor] = {}
    h = hashlib.sha256()
    for f in files:
        tensors.update(read_safetensors(f))
        h.update(file_sha256(f).encode())
    return tensors, h.hexdigest()


def import_specforge(src_dir: str | os.PathLike, out_dir: str | os.PathLike, target: Target | None = None,
                     version: str | None = None, *, dtype: torch.dtype | None = None,
                     overwrite: bool = False) -> HeadMeta:
    """Import a SpecForge / official EAGLE-3 / SGLang (or speculators) checkpoint into our layout.

    Key names confirmed in sgl-project/SpecForge ``specforge/modeling/draft/llama3_eagle.py``
    (LlamaForCausalLMEagle3: embed_tokens, midlayer.{input_layernorm, hidden_norm,
    self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}, fc (no bias),
    norm, lm_head, buffers t2d bool / d2t int64) and SGLang ``python/sglang/srt/models/llama_eagle3.py``
    load_weights (tries ``name`` then ``model.name``; d2t -> hot_token_id = d2t + arange; t2d
    skipped). ``embed_tokens.weight`` is dropped (the target's is used); ``layers.0.*``
    (speculators / vLLM) reads as ``midlayer.*``. Only safetensors is read: ``pytorch_model.bin`` is
    refused, never unpickled. Without d2t/t2d, only draft_vocab_size == vocab_size (identity) passes.
    Without `target` the head is not pinned to a fingerprint (head.json target_fingerprint "").
    """
    src = Path(src_dir)
    raw = read_json(src / CONFIG_FILE)
    cfg, upgraded = parse_config(raw, src / CONFIG_FILE, target)
    tensors, digest = _read_source_weights(src)
    canon = {canonical_key(k) for k in tensors}
    if not {"d2t", "t2d"} & canon and cfg.draft_vocab_size == cfg.vocab_size:
        n = cfg.vocab_size
        tensors.update(d2t=torch.zeros(n, dtype=torch.long), t2d=torch.ones(n, dtype=torch.bool))
    if target is not None:
        check_target(cfg, target, src / CONFIG_FILE)
    head = Eagle3DraftHead(cfg)
    tensors = check_tensors(head, tensors, src)
    float_dtype = dtype or storage_dtype(upgraded, tensors)
    head = fill_head(head, tensors, float_dtype, target)
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    meta = HeadMeta.new(
        version=version or f"import-{digest[:12]}",
        target_name=target.name if target is not None else (verifier or "unknown"),
        target_fingerprint=target.fingerprint if target is not None else "",
        data={"imported_from": str(src), "source_sha256": digest,
              "source_layout": "speculators" if "speculators_model_type" in raw else "eagle3"},
        training={"recipe": "imported"},
    )
    return save_head(head, out_dir, meta, dtype=float_dtype, overwrite=overwrite)


__all__ = ["export_speculators", "import_specforge"]
