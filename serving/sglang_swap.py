"""Draft-only weight updates of a running SGLang 0.5.23 server, and the facts that decide whether one is safe.

Owns: `DraftWeights` (a head version's config and tensors as SGLang will load them, read from its
directory and checked against head.json's sha256), `hot_swap_blocker` (why a head cannot replace the
serving one in place), and `WeightSession` (one draft-only update over HTTP: /begin_weight_update,
/update_weights_from_tensor, /end_weight_update, all with the "draft" selector, and the per-selector
checksums of /weights_checker). Must not touch: processes and restarts, the serving gate, the decision
between an in-place update and a restart (sglang_backend.py), the head registry's files (read only).

Why the checks: SGLang loads a draft update with the draft model's `load_weights`, which skips any
name it does not know without a word, and an EAGLE-3 server takes the draft vocabulary map (`d2t`)
once, when it starts (eagle_worker_v2.init_lm_head copies the model's hot_token_id to the device). So a
head whose config or `d2t` differs from the launch head's needs a restart, and an update never sends the
vocabulary map at all (`NOT_SENT`): in 0.5.23 it would not merely be ignored, it kills the server.
ModelRunner's weight_updater.update_weights_from_tensor moves every received tensor to the GPU
(`_unwrap_tensor`: `tensor.to(device)`), then LlamaForCausalLMEagle3.load_weights computes
`hot_token_id = loaded_weight + torch.arange(n)` with a CPU arange: a device-mismatch RuntimeError that
neither the runner nor the scheduler's update_weights_from_tensor catches, and the scheduler SIGQUITs its
parent (scheduler.py), so the whole server exits. The checksums after an update are the only evidence the
draft really changed and the target did not.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Optional

import torch

from adaptive_eagle.checkpoint import file_sha256, read_config
from adaptive_eagle.draft_head import DraftHeadConfig
from serving.sglang_protocol import (DRAFT, ENDPOINTS, SGLangError, SGLangProtocolError, begin_update_body,
                                     checksum_body, end_update_body, engine_checksum, tensor_update_bodies)

WEIGHTS_FILE = "model.safetensors"
VOCAB_MAP = "d2t"  # read once at launch; in an update it crashes the server (module docstring), so never sent
# never sent in an update: `t2d` the EAGLE-3 loader skips (llama_eagle3.load_weights `continue`s on it);
# `d2t` the loader turns into hot_token_id with a CPU arange after the runner moved it to the GPU
NOT_SENT = (VOCAB_MAP, "t2d")


@dataclass(frozen=True)
class DraftWeights:
    """One head directory as an SGLang draft update sends it."""

    directory: Path
    config: DraftHeadConfig
    tensors: dict  # name -> CPU tensor, names as saved (midlayer.*, fc.weight, norm.weight, lm_head.weight, d2t, t2d)

    @classmethod
    def read(cls, directory, sha256: Optional[str] = None) -> "DraftWeights":
        """Raises ValueError naming the file and the problem (a MoE head, a checksum that differs)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        config = read_config(directory)
        if (why := unservable(config)) is not None:
            raise ValueError(f"{directory}: {why}")
        weights = directory / WEIGHTS_FILE
        if sha256 is not None and (digest := file_sha256(weights)) != sha256:
            raise ValueError(f"{weights}: sha256 {digest[:16]}… differs from head.json's {sha256[:16]}…")
        return cls(directory, config, load_file(str(weights)))

    def loadable(self) -> dict:
        """The tensors an update sends: the draft's parameters, never the vocabulary maps (NOT_SENT)."""
        return {k: t for k, t in self.tensors.items() if k not in NOT_SENT}

    def same_weights(self, other: "DraftWeights") -> bool:
        """True when an update from `other` to this head leaves the draft's parameters as they were."""
        mine, theirs = self.loadable(), other.loadable()
        return mine.keys() == theirs.keys() and all(
            mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]) for k in mine)


def unservable(config: DraftHeadConfig) -> Optional[str]:
    """Why SGLang's EAGLE-3 worker cannot serve a head of this config at all (restart or not), or None."""
    if config.num_experts > 1:
        return (f"a MoE-routed head ({config.num_experts} experts); SGLang's EAGLE-3 head has a dense MLP and "
                "cannot serve it")
    return None


def registry_refusal(registry_path) -> "Callable[[str], Optional[str]]":
    """The policy's pre-check for a fleet of SGLang replicas: version -> why SGLang cannot serve it (its head
    config, read from the registry at `registry_path`), or None. Reads one small JSON file per call."""
    def refusal(version: str) -> Optional[str]:
        from adaptive_eagle.registry import HeadRegistry, RegistryError

        try:
            return unservable(read_config(HeadRegistry(registry_path).get(version)))
        except (RegistryError, OSError, ValueError) as e:
            return f"its head config cannot be read: {e}"
    return refusal


def hot_swap_blocker(new: DraftWeights, launched: DraftWeights) -> Optional[str]:
    """Why `new` cannot be loaded in place into a server launched with `launched`, or None when it can."""
    differ = [f.name for f in fields(DraftHeadConfig)
              if getattr(new.config, f.name) != getattr(launched.config, f.name)]
    if differ:
        return f"its config differs from the launch head's in {', '.join(differ)}"
    a, b = new.tensors.get(VOCAB_MAP), launched.tensors.get(VOCAB_MAP)
    if a is None or b is None or a.shape != b.shape or not torch.equal(a, b):
        return ("its draft vocabulary (d2t) differs from the launch head's, and a running SGLang EAGLE-3 worker "
                "keeps the vocabulary map it started with")
    return None


@dataclass(frozen=True)
class Checksums:
    target: str
    draft: str


class WeightSession:
    """Draft-only weight updates and checksums over one HTTP client (an httpx.Client on the server's URL)."""

    def __init__(self, client, tp_size: int = 1, max_update_bytes: int = 256 << 20) -> None:
        self.client, self.tp_size, self.max_update_bytes = client, tp_size, max_update_bytes

    def _post(self, name: str, body: dict) -> dict:
        ep = ENDPOINTS[name]
        r = self.client.request(ep.method, ep.path, json=body)
        if r.status_code == 404:
            raise SGLangError(f"{ep.path} answered 404: this SGLang has no such endpoint")
        try:
            answer = r.json()
        except ValueError:
            raise SGLangProtocolError(f"{ep.path} answered {r.status_code} without JSON: {r.text[:200]}") from None
        if not isinstance(answer, dict):
            raise SGLangProtocolError(f"{ep.path} answered {r.status_code} with {type(answer).__name__}, not an object")
        return answer

    def _step(self, name: str, body: dict) -> Optional[str]:
        """None when the step succeeded, else SGLang's reason."""
        answer = self._post(name, body)
        return None if answer.get("success") is True else str(answer.get("message") or answer)

    def checksums(self) -> Checksums:
        return Checksums(target=engine_checksum(self._post("checksum", checksum_body("target")), "target"),
                         draft=engine_checksum(self._post("checksum", checksum_body(DRAFT)), DRAFT))

    def load(self, weights: DraftWeights, version: str) -> tuple[Optional[str], bool]:
        """Load `weights` into the draft and label the server `version`, in one session. Returns (None, True)
        on success, else (SGLang's reason, whether any tensor may have been loaded: then the draft must be
        restored). Raises SGLangError / httpx errors when the server does not answer as 0.5.23 does."""
        why = self._step("begin_update", begin_update_body())
        if why is not None and "already open" in why:  # a session left open (this backend died in one): close it
            self._step("end_update", end_update_body())
            why = self._step("begin_update", begin_update_body())
        if why is not None:
            return f"/begin_weight_update refused: {why}", False
        touched = False
        try:
            for body in tensor_update_bodies(weights.loadable(), version, self.tp_size, self.max_update_bytes):
                touched = True
                if (why := self._step("tensor_update", body)) is not None:
                    return f"/update_weights_from_tensor refused: {why}", True
        finally:
            end_why = self._step("end_update", end_update_body())
        if end_why is not None:
            return f"/end_weight_update refused: {end_why}", touched
        return None, touched
