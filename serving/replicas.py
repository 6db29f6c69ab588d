"""Replicas from a ServingConfig: the one place that turns the config into running DecodeServers.

Owns: `ReplicaBuilder` (a picklable zero-argument builder of one DecodeServer: target, registry,
the head it starts with, engine tree parameters, capture policy, its own store writer) and
`build_replicas` (N of them in this process, or N ServerActors). Must not touch: HTTP (gateway.py),
routing (router.py), the stack's other parts (stack.py starts Ray, the store, trainer and policy).

Build inside, never ship a model. A ServerActor gets the builder, not a server: the target is loaded
in the actor's own process (transformers 5: a model unpickled into a fresh process returns no
hidden states), and so is the store writer (its flusher thread cannot be pickled either).

The starting head: `initial_head` when set, else the registry's champion ("none": plain decoding);
a head that cannot be loaded fails the build with its reason (a replica never starts on a head
other than the one asked for).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from adaptive_eagle.versions import PLAIN, engine_version
from serving.config import ServingConfig
from serving.server import DecodeServer, settle_heap

log = logging.getLogger(__name__)


def open_registry(config: ServingConfig):
    """The head registry of `config` (None when there is none)."""
    if config.registry_path is None:
        return None
    from adaptive_eagle.registry import HeadRegistry

    return HeadRegistry(config.registry_path)


def starting_head(config: ServingConfig, registry) -> str:
    """The version a replica starts on: initial_head, else the champion, else plain decoding."""
    if config.initial_head is not None:
        return config.initial_head
    return registry.champion() if registry is not None else PLAIN


def holdback_head(config: ServingConfig, registry, version: str) -> Optional[str]:
    """The holdback arm's frozen baseline: holdback_head, else the oldest head in `version`'s lineage (None: no
    registry, or plain decoding: nothing to hold back)."""
    if config.holdback_head is not None:
        return config.holdback_head
    if registry is None or version == PLAIN:
        return None
    return registry.lineage(version)[-1]


@dataclass(frozen=True)
class ReplicaBuilder:
    """`builder()` -> one DecodeServer named `name`. `index` offsets per-replica ports (SGLang);
    `target_builder` replaces loading `config.target` by name (tests: a tiny target with a tokenizer)."""

    config: ServingConfig
    name: str = "replica-0"
    index: int = 0
    target_builder: Optional[Callable[[], object]] = None

    def __call__(self) -> DecodeServer:
        cfg = self.config
        registry = open_registry(cfg)
        version = starting_head(cfg, registry)
        backend = self._sglang(registry, version) if cfg.backend == "sglang" else self._reference(registry, version)
        writer = None
        if cfg.store is not None:
            from feature_store.writer import StoreWriter

            writer = StoreWriter(cfg.store)
        log.info("replica %s: %s backend, head %s, store %s", self.name, cfg.backend, version,
                 cfg.store.backend if cfg.store else "none")
        return DecodeServer(backend, cfg.capture, writer, name=self.name, owns_writer=True)

    def _reference(self, registry, version: str):
        from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
        from serving.backend import ReferenceBackend

        cfg = self.config
        if self.target_builder is not None:
            target = self.target_builder()
        else:
            from adaptive_eagle.targets import load_target

            target = load_target(cfg.target, device=cfg.device)
        head = None
        if version != PLAIN:
            if registry is None:
                raise ValueError(f"initial_head {version!r} needs registry_path")
            head = registry.load(version, target, device=target.device)
        engine = SpeculativeEngine(target, head, EngineConfig(**cfg.engine.model_dump()),
                                   head_version=engine_version(version))
        backend = ReferenceBackend(engine, registry, cfg.max_prompt_tokens, swap_cpu_share=cfg.swap_cpu_share)
        if cfg.holdback_fraction > 0:
            baseline = holdback_head(cfg, registry, version)
            res = backend.set_holdback(baseline, cfg.holdback_fraction)
            (log.info if res.ok else log.error)("replica %s: %s", self.name, res.message)
        return backend

    def _sglang(self, registry, version: str):
        from transformers import AutoTokenizer

        from adaptive_eagle.targets import cached_fingerprint
        from serving.sglang_backend import SGLangBackend, launch_sglang

        sg = self.config.sglang
        sg = sg.model_copy(update={"port": sg.port + self.index})
        if registry is not None and version != PLAIN:
            sg = sg.model_copy(update={"draft_model_path": str(registry.get(version)), "weight_version": version})
        process = launch_sglang(sg) if sg.launch else None
        tokenizer = AutoTokenizer.from_pretrained(sg.model_path, local_files_only=True)
        return SGLangBackend(sg, tokenizer, registry, version, cached_fingerprint(Path(sg.model_path)),
                             process=process)


def replica_capacity(config: ServingConfig) -> int:
    """Requests one replica of `config` decodes at once (what its DecodeServer's backend reports as
    max_inflight): SGLang's batch (SGLangConfig.inflight_limit), else 1 (the reference engine)."""
    if config.backend == "sglang" and config.sglang is not None:
        return config.sglang.inflight_limit
    from serving.backend import ReferenceBackend

    return ReferenceBackend.max_inflight


def replica_builders(config: ServingConfig, target_builder: Optional[Callable[[], object]] = None,
                     prefix: str = "replica") -> list[ReplicaBuilder]:
    return [ReplicaBuilder(config, f"{prefix}-{i}", i, target_builder) for i in range(config.replicas)]


def build_replicas(config: ServingConfig, *, ray_actors: bool = False,
                   target_builder: Optional[Callable[[], object]] = None, actor_options: Optional[dict] = None,
                   prefix: str = "replica") -> list:
    """`config.replicas` replicas: DecodeServers in this process, or router.RayReplica handles over
    ServerActors (`actor_options`: Ray options such as num_cpus, num_gpus; each builds its server
    inside its own process). create_app takes either list."""
    builders = replica_builders(config, target_builder, prefix)
    if not ray_actors:
        servers = [b() for b in builders]
        settle_heap()
        return servers
    from serving.actor import remote_server_actor

    options = {"num_cpus": 1, **(actor_options or {})}
    return [remote_server_actor(b, b.name, max_inflight=replica_capacity(config), **options) for b in builders]


__all__ = ["ReplicaBuilder", "build_replicas", "open_registry", "replica_builders", "replica_capacity", "starting_head"]
