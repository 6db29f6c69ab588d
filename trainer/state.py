"""Resumable training state of a draft head: weights, optimizer and a JSON sidecar, without pickle.

Owns: the on-disk layout every training loop resumes from (`head.safetensors` without the frozen
embedding, `optimizer.safetensors` with the AdamW moments, `trainer.json` with the head config,
the optimizer's param groups and whatever the loop adds). The caller decides where and when
(offline.py and the near-line trainer's checkpointing.py write it inside an atomic staging directory). Must not touch: data,
the registry, the store.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import torch
from safetensors.torch import load_file, save_file

from adaptive_eagle.draft_head import DraftHeadConfig, Eagle3DraftHead
from adaptive_eagle.targets import Target

STATE_FILES = ("head.safetensors", "optimizer.safetensors", "trainer.json")
POOL_FILE = "pool.arrow"  # the near-line trainer's replay buffer and held-out records (encoded trace records)


def head_weights(head: Eagle3DraftHead) -> dict[str, torch.Tensor]:
    """The head's tensors on the CPU without the frozen embedding (the target supplies it again)."""
    return {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items() if k != "embed_tokens.weight"}


def head_from_weights(head_config: dict, weights: dict[str, torch.Tensor], target: Target) -> Eagle3DraftHead:
    """Rebuild a head from its config dict (`cfg.to_dict()`) and `head_weights`, with `target`'s embedding."""
    hc = dict(head_config)
    hc["aux_layer_ids"] = tuple(hc["aux_layer_ids"])
    with torch.device("meta"):  # no random init to throw away: every tensor is assigned below
        head = Eagle3DraftHead(DraftHeadConfig(**hc))
    # owned float32 copies (weights may be read-only buffers, e.g. a data-parallel worker's received payload)
    state = {k: v.to(torch.float32, copy=True) if v.is_floating_point() else v.clone() for k, v in weights.items()}
    state["embed_tokens.weight"] = target.input_embeddings().detach().to("cpu", torch.float32, copy=True)
    head.load_state_dict(state, assign=True)
    return head


def write_state(d: Path, head: Eagle3DraftHead, opt: torch.optim.Optimizer, meta: dict) -> None:
    """Write the three state files into directory `d` (which the caller stages and renames)."""
    save_file(head_weights(head), d / "head.safetensors")
    opt_sd = opt.state_dict()
    tensors = {f"{idx}.{name}": val.detach().cpu().contiguous()
               for idx, st in opt_sd["state"].items() for name, val in st.items() if torch.is_tensor(val)}
    save_file(tensors, d / "optimizer.safetensors")
    (d / "trainer.json").write_text(json.dumps({**meta, "head_config": head.cfg.to_dict(),
                                                "optimizer": {"param_groups": opt_sd["param_groups"]}}, indent=1))


def read_state(d: Path, target: Target) -> tuple[Eagle3DraftHead, dict, dict]:
    """(head in float32 with the target's embedding, trainer.json, optimizer tensors) from directory `d`."""
    meta = json.loads((d / "trainer.json").read_text())
    head = head_from_weights(meta["head_config"], load_file(d / "head.safetensors"), target)
    return head, meta, load_file(d / "optimizer.safetensors")


def restore_optimizer(opt: torch.optim.Optimizer, tensors: dict, meta: dict) -> None:
    """Load AdamW moments and param groups written by `write_state` into `opt` (built over the same head)."""
    sd = opt.state_dict()
    state: dict = {}
    for key, val in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = val
    sd["state"] = state
    sd["param_groups"] = meta["optimizer"]["param_groups"]
    opt.load_state_dict(sd)


def write_pool(path: Path, replay: list[tuple[str, bytes]], heldout: list[tuple[str, bytes]]) -> None:
    """(domain, encoded trace record) pairs of the replay buffer and the held-out pool, as one Arrow file."""
    rows = [("replay", d, p) for d, p in replay] + [("heldout", d, p) for d, p in heldout]
    table = pa.table({"role": pa.array([r[0] for r in rows], pa.string()),
                      "domain": pa.array([r[1] for r in rows], pa.string()),
                      "payload": pa.array([r[2] for r in rows], pa.binary())})
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)


def read_pool(path: Path) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
    """(replay, heldout) as written by `write_pool`."""
    rows = pa.ipc.open_file(pa.memory_map(str(path))).read_all().to_pylist()
    pick = lambda role: [(r["domain"], r["payload"]) for r in rows if r["role"] == role]  # noqa: E731
    return pick("replay"), pick("heldout")


__all__ = ["POOL_FILE", "STATE_FILES", "head_from_weights", "head_weights", "read_pool", "read_state",
           "restore_optimizer", "write_pool", "write_state"]
