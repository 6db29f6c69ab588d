"""Shared fixtures of the policy tests: one registry of three tiny heads per session (tests copy it)."""

from __future__ import annotations

import pytest
import torch

from adaptive_eagle.checkpoint import HeadMeta
from adaptive_eagle.draft_head import DraftHeadConfig, Eagle3DraftHead, init_weights
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.targets import tiny_target

VERSIONS = ("v1", "v2", "v3")


@pytest.fixture(scope="session")
def registry_template(tmp_path_factory):
    """A registry of three tiny heads (v1, v2, v3; champion 'none'), built once: tests copy it."""
    target = tiny_target(num_layers=8)
    root = tmp_path_factory.mktemp("template") / "registry"
    reg = HeadRegistry.create(root)
    for i, name in enumerate(VERSIONS):
        torch.manual_seed(i)
        cfg = DraftHeadConfig.from_target(target.config, draft_vocab_size=40, aux_layer_ids=target.aux_layer_ids)
        head = Eagle3DraftHead(cfg)
        init_weights(head)
        head.set_draft_vocab(torch.randperm(cfg.vocab_size)[:40].sort().values)
        reg.register(head, HeadMeta.new(name, target.name, target.fingerprint), dtype=torch.float32)
    return root
