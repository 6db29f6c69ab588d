"""LocalStack: the whole loop from one StackConfig — what `adaptive-eagle up` runs.

Owns: the order of starting and stopping, as named steps: the config check (check.py, nothing starts
when a stage could not work) → state dir and registry → admin token → store → Ray → server replicas
(ServerActors) → gateway (uvicorn) → load signal → trainer (TrainerActor) → policy (PolicyActor +
CandidateFeed) → the loop's metrics (metrics.py); stop runs them backwards. Also `StackInfo`, where
everything is. Must not touch: what each part does (serving, trainer, policies own that).

Where the policy runs: in the gateway's process, on an event loop thread of its own. The fleet it
drives (GatewayFleet: the router, the canary, the live samples) lives in the gateway, and is not
picklable into an actor; the PolicyActor class is its thin async shell either way.

The trainer yields to requests: the gateway publishes its queue depth into a LoadSignal file, and
the trainer's `yield_to` reads it before each step (load_signal.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from pydantic import SecretStr

from loop.config import StackConfig

log = logging.getLogger(__name__)
LOAD_FILE, TOKEN_FILE = "load.json", "admin_token"


@dataclass(frozen=True)
class StackInfo:
    endpoint: str  # OpenAI base URL (…/v1)
    metrics: str
    dashboard: Optional[str]
    promotion_log: str
    registry: str
    champion: str
    store: str
    state_dir: str
    admin_token: str  # where the admin token comes from (a file path or "config"); never the token
    replicas: list[str] = field(default_factory=list)
    trainer: bool = False
    policy: bool = False

    def lines(self) -> list[str]:
        return [f"endpoint       {self.endpoint}  (OpenAI API; model names: GET {self.endpoint}/models)",
                f"metrics        {self.metrics}",
                f"ray dashboard  {self.dashboard or 'off'}",
                f"promotion log  {self.promotion_log}  (adaptive-eagle promotions --registry {self.registry})",
                f"registry       {self.registry}  (champion {self.champion})",
                f"store          {self.store}",
                f"admin token    {self.admin_token}",
                f"replicas       {', '.join(self.replicas)}",
                f"trainer        {'running' if self.trainer else 'off'}",
                f"policy         {'running' if self.policy else 'off'}",
                f"state dir      {self.state_dir}"]


def store_label(store) -> str:
    if store.backend == "local":
        return f"local Arrow segments in {store.local_root}"
    url = store.redis_url.split("@")[-1]  # never the password
    return f"redis {url}" + (" (TLS)" if store.tls or store.redis_url.startswith("rediss://") else "")


class LocalStack:
    def __init__(self, config: StackConfig, *, target_builder: Optional[Callable[[], object]] = None,
                 echo: Callable[[str], None] = log.info) -> None:
        """target_builder: builds the target in each process that needs one (replicas, trainer) instead of
        loading `serving.target` by name (tests: a tiny target with a tokenizer)."""
        self.config, self.target_builder, self.echo = config, target_builder, echo
        self.ray_owned = False
        self.replicas: list = []
        self.gateway = self.app = self.trainer = self.policy = self.feed = None
        self.info: Optional[StackInfo] = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._policy_loop: Optional[asyncio.AbstractEventLoop] = None
        self._policy_stop: Optional[asyncio.Event] = None
        self.registry = self.serving = self.signal = self.watcher = None
        self.admin_token_source = "config"
        self.dashboard: Optional[str] = None

    # ---- start ------------------------------------------------------------------------------------
    def start(self) -> StackInfo:
        from loop.check import check_stack

        # before anything starts: a stage that cannot work is refused
        check = check_stack(self.config, serving_target=self.target_builder is None)
        check.raise_if_bad()
        for note in check.notes:
            self.echo(f"config check: {note}")
        try:
            for step in (self._state, self._admin_token, self._store, self._ray, self._replicas, self._gateway,
                         self._load_signal, self._trainer, self._policy, self._watch):
                step()
        except BaseException:
            self.stop()
            raise
        c = self.config
        self.info = StackInfo(
            endpoint=self.gateway.url + "/v1", metrics=self.gateway.url + "/metrics", dashboard=self.dashboard,
            promotion_log=str(c.promotion_log), registry=str(c.registry_path), champion=self.registry.champion(),
            store=store_label(c.store_config), state_dir=str(c.state_path), admin_token=self.admin_token_source,
            replicas=[s.replica.name for s in self.app.state.gateway.router.slots], trainer=self.trainer is not None,
            policy=self.policy is not None)
        return self.info

    def _state(self) -> None:
        from adaptive_eagle.registry import HeadRegistry

        c = self.config
        c.state_path.mkdir(parents=True, exist_ok=True)
        self.registry = HeadRegistry.create(c.registry_path)
        seed = c.registry.seed_head
        if seed and self.registry.champion() == "none" and not self.registry.versions():
            version = self.registry.add(os.path.expanduser(seed))
            change = self.registry.set_champion(version, expect="none", reason="seed head of the stack")
            self.echo(f"registry: seeded with {version} ({change.message})")

    def _admin_token(self) -> None:
        serving = self.config.serving_config()
        if serving.admin_token is None:
            path = self.config.state_path / TOKEN_FILE
            if not path.exists():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_urlsafe(24))
            serving = serving.model_copy(update={"admin_token": SecretStr(path.read_text().strip())})  # as validation makes it
            self.admin_token_source = f"{path} (Authorization: Bearer $(cat {path}))"
        self.serving = serving

    def _store(self) -> None:
        store = self.config.store_config
        if store.backend == "local":
            os.makedirs(store.local_root, exist_ok=True)
            return
        from feature_store.backend import open_backend

        try:
            backend = open_backend(store)
            backend.ping()
            backend.close()
        except Exception as e:  # noqa: BLE001 - requests never wait for the store: warn, keep going
            self.echo(f"WARNING: the store at {store_label(store)} does not answer ({e}); requests are served and "
                      "captures dropped (counted) until it does")

    def _ray(self) -> None:
        c = self.config
        if not (c.ray.replicas_as_actors or c.trainer.enabled):
            return
        import ray

        if ray.is_initialized():
            return  # someone else's Ray (tests): used, never shut down
        kw = {"address": c.ray.address} if c.ray.address else {"num_cpus": c.ray.num_cpus or os.cpu_count()}
        if not c.ray.address:
            kw["include_dashboard"] = None if c.ray.dashboard else False
            kw["_system_config"] = {"worker_niceness": c.ray.worker_niceness}
        # ray.init installs Ray's own SIGTERM handler in this driver, which logs and aborts the process (exit -6):
        # the handler `up` and the demo set to stop cleanly would never run, so it is put back afterwards
        handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        ctx = ray.init(log_to_driver=True, configure_logging=False, **kw)
        if threading.current_thread() is threading.main_thread():
            for s, handler in handlers.items():
                if handler is not None:
                    signal.signal(s, handler)
        self.ray_owned = True
        url = getattr(ctx, "dashboard_url", None)
        self.dashboard = f"http://{url}" if url and not url.startswith("http") else url or None
        if self.dashboard is None:  # say why it is off: the config turned it off, or Ray could not start it
            self.dashboard = ("off (ray.dashboard: false)" if not c.ray.dashboard
                              else "off (Ray did not start it; it needs ray[default])")

    def _replicas(self) -> None:
        from serving.replicas import build_replicas

        c = self.config
        options = {"num_cpus": c.ray.replica_num_cpus, "num_gpus": c.ray.replica_num_gpus,
                   "max_restarts": c.ray.replica_max_restarts, "max_task_retries": 0,  # a stream is never replayed
                   **({"resources": dict(c.ray.replica_resources)} if c.ray.replica_resources else {})}
        self.replicas = build_replicas(self.serving, ray_actors=c.ray.replicas_as_actors,
                                       target_builder=self.target_builder, actor_options=options)

    def _gateway(self) -> None:
        from serving.gateway import GatewayThread, create_app

        self.app = create_app(self.serving, self.replicas)
        self.gateway = GatewayThread(self.app, self.serving.host, self.serving.port)
        self.gateway.start(timeout=600.0)  # the lifespan waits for replicas that still load their target

    def _load_signal(self) -> None:
        from loop.load_signal import LoadPublisher, LoadSignal

        t = self.config.trainer
        self.signal = LoadSignal(str(self.config.state_path / LOAD_FILE), t.yield_queue_depth, t.yield_when_busy)
        publisher = LoadPublisher(self.signal, self.app.state.gateway.router)

        def loop() -> None:
            while not self._stop.wait(0.1):
                publisher.step()

        self._spawn(loop, "load-signal")

    def _trainer(self) -> None:
        c = self.config
        if not c.trainer.enabled:
            return
        from trainer.actor import remote_trainer_actor

        self.trainer = remote_trainer_actor(
            c.nearline_config(), self.target_builder, max_restarts=c.trainer.max_restarts, yield_to=self.signal,
            num_cpus=c.trainer.num_cpus, num_gpus=c.trainer.num_gpus,
            **({"resources": dict(c.trainer.resources)} if c.trainer.resources else {}))

    def _policy(self) -> None:
        from policies.actor import PolicyActor
        from loop.candidates import CandidateFeed

        c = self.config
        if not c.policy.enabled:
            return
        fleet = self.app.state.gateway.fleet
        self.policy = PolicyActor(c.registry_path, fleet, c.policy.gates(), c.promotion_log)
        self.feed = CandidateFeed(self.registry)
        ready = threading.Event()

        async def main() -> None:
            self._policy_loop, self._policy_stop = asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            await asyncio.gather(self.policy.run(c.policy.tick_s),
                                 self.feed.run(self.policy, c.policy.candidate_poll_s, self._policy_stop))

        self._spawn(lambda: asyncio.run(main()), "policy")
        ready.wait(10)

    def _watch(self) -> None:
        """The loop's own metrics on the gateway's /metrics (metrics.py): trainer, candidates, policy."""
        from loop.metrics import LoopCollector, LoopWatcher, PromotionLogFollower, newest_candidate_time

        trainer, c = self.trainer, self.config

        def trainer_status() -> dict:
            import ray

            return ray.get(trainer.status.remote(), timeout=10)

        policy_thread = next((t for t in self._threads if t.name == "policy"), None)
        self.watcher = LoopWatcher(
            trainer_status=trainer_status if trainer is not None else None,
            candidate_time=lambda: newest_candidate_time(self.registry),
            last_event=PromotionLogFollower(c.promotion_log),
            policy_running=lambda: policy_thread is not None and policy_thread.is_alive(),
            feed=(lambda: self.feed.counts()) if self.feed is not None else None)
        self.watcher.start()
        self.app.state.gateway.metrics.registry.register(LoopCollector(self.watcher))

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ---- stop -------------------------------------------------------------------------------------
    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop everything that started, backwards; each step's failure is logged and the next one runs."""
        for step in (self._stop_watch, self._stop_policy, self._stop_gateway, self._stop_trainer, self._stop_replicas,
                     self._stop_ray):
            try:
                step(timeout_s)
            except Exception:  # noqa: BLE001 - shutting down: carry on with the rest
                log.exception("stack: %s failed", step.__name__)

    def _stop_watch(self, timeout_s: float) -> None:
        if self.watcher is not None:
            self.watcher.stop(timeout_s)

    def _stop_policy(self, timeout_s: float) -> None:
        loop, stop = self._policy_loop, self._policy_stop
        if loop is not None and self.policy is not None:
            asyncio.run_coroutine_threadsafe(self.policy.stop(), loop).result(timeout_s)
            loop.call_soon_threadsafe(stop.set)
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        if self.signal is not None:
            self.signal.clear()

    def _stop_gateway(self, timeout_s: float) -> None:
        if self.gateway is not None:
            self.gateway.stop(timeout_s)

    def _stop_trainer(self, timeout_s: float) -> None:
        if self.trainer is None:
            return
        import ray

        try:
            ray.get(self.trainer.stop.remote(timeout_s), timeout=timeout_s + 10)
        finally:
            ray.kill(self.trainer, no_restart=True)
            self.trainer = None

    def _stop_replicas(self, timeout_s: float) -> None:
        for r in self.replicas:
            handle = getattr(r, "handle", None)
            if handle is None:
                r.close()
                continue
            import ray

            try:
                ray.get(handle.close.remote(), timeout=timeout_s)
            finally:
                ray.kill(handle, no_restart=True)
        self.replicas = []

    def _stop_ray(self, timeout_s: float) -> None:
        if self.ray_owned:
            import ray

            ray.shutdown()
            self.ray_owned = False


__all__ = ["LocalStack", "StackInfo", "store_label"]
