"""StackConfig: the ONE YAML file that configures `adaptive-eagle up` (the whole loop on one machine or
a Ray cluster's head node). Pydantic, frozen; every field documented and range-checked; unknown keys
are refused with the key named.

Owns: the sections and their defaults — `ray`, `serving` (serving.config.ServingConfig), `store`
(feature_store.config.StoreConfig), `trainer` (stack fields + any trainer.config.NearlineConfig
field), `policy` (stack fields + any policies.config.PolicyConfig field), `registry` — reading a
file (`${ENV_VAR}` in a string is replaced from the environment, so secrets never sit in the file),
turning errors into one line per field, and printing the defaults as YAML. Must not touch: starting
anything (stack.py does).

Paths the stack fills in: the store's `local_root` (default `<state_dir>/store`), the serving
section's `store` and `registry_path`, and the trainer's `registry`, `work_dir` and `store`; setting
those in their sections is refused (one place each).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, ClassVar, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from feature_store.config import StoreConfig
from policies.config import PolicyConfig
from serving.config import ServingConfig
from trainer.config import NearlineConfig

DEFAULT_STATE_DIR = "~/.cache/adaptive-eagle/stack"
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class StackConfigError(ValueError):
    """A stack config was refused: the message names the file, each field and what is allowed."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RaySection(_Section):
    address: Optional[str] = Field(None, description="None: start Ray on this machine; 'auto' or host:port: "
                                   "join a running cluster (ray up)")
    num_cpus: Optional[int] = Field(None, ge=1, description="CPUs a local Ray may use (None: all of them)")
    dashboard: bool = Field(True, description="start the Ray dashboard when ray[default] is installed")
    replica_num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per server replica actor")
    replica_num_gpus: float = Field(0.0, ge=0, description="GPUs per server replica actor (SGLang: 1)")
    replica_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per "
                                                "replica actor (place replicas on node types that advertise them)")
    replicas_as_actors: bool = Field(True, description="False: replicas run inside the gateway's process")
    worker_niceness: int = Field(0, ge=0, le=19, description="CPU niceness of the Ray workers (replicas, trainer) "
                                 "when the stack starts Ray itself. Ray's own default, 15, lets any other process on "
                                 "the machine take the cores from the servers; 0 serves at normal priority (the "
                                 "trainer still yields to queued requests)")
    replica_max_restarts: int = Field(3, ge=-1, le=1000, description="Ray restarts a replica actor whose process "
                                      "died this often (it comes back serving the registry's champion; requests "
                                      "in flight on it get an error); -1: without limit")


class RegistrySection(_Section):
    path: Optional[str] = Field(None, description="head registry root (None: <state_dir>/registry); created "
                                "when missing")
    seed_head: Optional[str] = Field(None, description="a head version directory added and made champion when "
                                     "the registry has no champion yet (e.g. heads/smollm2-135m-english-v2)")


class _Wrapping(_Section):
    """A section with its own fields plus the fields of one inner config, checked by building it."""

    model_config = ConfigDict(frozen=True, extra="allow")
    inner: ClassVar[type[BaseModel]]
    filled: ClassVar[tuple[str, ...]] = ()  # inner fields the stack sets

    def inner_fields(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def placeholders(self) -> dict[str, Any]:
        return {}

    @model_validator(mode="after")
    def _check_inner(self):
        extra = self.inner_fields()
        for key in extra:
            if key in self.filled:
                raise ValueError(f"{key}: set by the stack; remove it from this section")
            if key not in self.inner.model_fields:
                raise ValueError(f"{key}: unknown key (allowed: {', '.join(sorted(_own(self) | _inner(self)))})")
        if not extra:
            return self
        try:
            self.inner(**{**self.placeholders(), **extra})
        except ValidationError as e:
            raise ValueError(explain(e, self.inner)) from None  # "field: why — doc", joined under the section
        return self


def _own(section: _Wrapping) -> set[str]:
    return set(type(section).model_fields)


def _inner(section: _Wrapping) -> set[str]:
    return set(section.inner.model_fields) - set(section.filled)


class TrainerSection(_Wrapping):
    """Stack fields, plus any NearlineConfig field (lr, candidate_every_tokens, ...)."""

    inner: ClassVar[type[BaseModel]] = NearlineConfig
    filled: ClassVar[tuple[str, ...]] = ("registry", "work_dir", "store")

    enabled: bool = Field(True, description="run the near-line trainer")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved for the trainer actor")
    num_gpus: float = Field(0.0, ge=0, description="GPUs for the trainer actor")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources of the trainer "
                                        "actor (e.g. {ae_head: 1} keeps it on the head node, next to the gateway)")
    max_restarts: int = Field(5, ge=0, le=1000, description="Ray restarts the trainer this often after a crash")
    yield_queue_depth: int = Field(1, ge=0, description="the trainer pauses while this many requests wait for a "
                                   "replica (0: never pauses)")
    yield_when_busy: bool = Field(False, description="also pause while any replica decodes (machines whose "
                                  "cores the trainer and the servers share)")

    def placeholders(self) -> dict[str, Any]:
        return {"registry": ".", "work_dir": ".", "store": StoreConfig(local_root=".")}

    def nearline(self, registry: str, work_dir: str, store: StoreConfig, target: str,
                 defaults: dict[str, Any] | None = None) -> NearlineConfig:
        """The trainer's config: the section's own fields over `defaults` (what the stack derives)."""
        return NearlineConfig(**{"target": target, **(defaults or {}), **self.inner_fields(), "registry": registry,
                                 "work_dir": work_dir, "store": store})


class PolicySection(_Wrapping):
    """Stack fields, plus any PolicyConfig field (canary_fraction, min_samples, ...)."""

    inner: ClassVar[type[BaseModel]] = PolicyConfig

    enabled: bool = Field(True, description="run the promotion policy (candidates -> gates -> canary -> promote)")
    tick_s: float = Field(2.0, gt=0, le=3600, description="the policy judges the canary / watch this often")
    candidate_poll_s: float = Field(5.0, gt=0, le=3600, description="look for new candidates this often")
    log_path: Optional[str] = Field(None, description="promotion log (None: <registry>/promotions.jsonl)")

    def gates(self) -> PolicyConfig:
        return PolicyConfig(**self.inner_fields())


class StackConfig(_Section):
    state_dir: str = Field(DEFAULT_STATE_DIR, description="where the stack keeps its registry, store, trainer "
                           "work dir and admin token unless a section says otherwise")
    ray: RaySection = Field(default_factory=RaySection, description="Ray: local or a cluster, actor resources")
    serving: ServingConfig = Field(default_factory=ServingConfig, description="gateway and replicas")
    store: StoreConfig = Field(default_factory=lambda: StoreConfig(local_root=DEFAULT_STATE_DIR + "/store"),
                               description="feature store (local Arrow segments under <state_dir>/store, or Redis)")
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="near-line trainer")
    policy: PolicySection = Field(default_factory=PolicySection, description="promotion policy")
    registry: RegistrySection = Field(default_factory=RegistrySection, description="head registry")

    @model_validator(mode="before")
    @classmethod
    def _fill_store_root(cls, data: Any) -> Any:
        if isinstance(data, dict):
            store = data.get("store") or {}
            if isinstance(store, dict) and store.get("backend", "local") == "local" and not store.get("local_root"):
                state = data.get("state_dir", DEFAULT_STATE_DIR)
                data = {**data, "store": {**store, "local_root": f"{state}/store"}}
        return data

    @model_validator(mode="after")
    def _check(self) -> "StackConfig":
        for key in ("store", "registry_path"):
            if getattr(self.serving, key) is not None:
                raise ValueError(f"serving.{key}: set by the stack from the top-level "
                                 f"{'store' if key == 'store' else 'registry'} section; remove it")
        if self.store.backend == "local" and self.serving.replicas > 1 and self.ray.replicas_as_actors:
            raise ValueError("serving.replicas: the local store takes one writer process, so replicas as Ray actors "
                             "must be 1 (allowed: 1 with store.backend 'local'); use store.backend 'redis' for more")
        return self

    # ---- resolved paths ------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return Path(self.state_dir).expanduser()

    @property
    def registry_path(self) -> Path:
        return Path(self.registry.path).expanduser() if self.registry.path else self.state_path / "registry"

    @property
    def store_config(self) -> StoreConfig:
        if self.store.backend == "local":
            return self.store.model_copy(update={"local_root": str(Path(self.store.local_root).expanduser())})
        return self.store

    @property
    def promotion_log(self) -> Path:
        if self.policy.log_path:
            return Path(self.policy.log_path).expanduser()
        from policies.log import LOG_NAME

        return self.registry_path / LOG_NAME

    def serving_config(self, **update: Any) -> ServingConfig:
        """The serving section with the stack's store and registry filled in."""
        return self.serving.model_copy(update={"store": self.store_config, "registry_path": str(self.registry_path),
                                               **update})

    def nearline_config(self) -> NearlineConfig:
        """The trainer's config. Unless the trainer section sets them: a test-then-train snapshot gathers
        evidence until the policy's offline gate must decide (offline_max_samples); with held-out evidence, a
        candidate is written once the offline gate has enough held-out records to judge it (min_samples), and
        the held-out pool keeps at least that many records of a domain (a single-domain workload must be able to
        reach it) and at least the gate's per-domain minimum."""
        return self.trainer.nearline(str(self.registry_path), str(self.state_path / "trainer"), self.store_config,
                                     self.serving.target, defaults=self.trainer_defaults())

    def trainer_defaults(self) -> dict[str, int]:
        """The trainer fields the stack derives from the policy (the trainer section's own values win)."""
        gates = self.policy.gates()
        pool = max(NearlineConfig.model_fields["heldout_per_domain"].default, gates.min_samples)
        return {"min_candidate_heldout": gates.min_samples, "heldout_per_domain": pool,
                "candidate_evidence_records": gates.offline_max_samples}


# ---- reading, errors, defaults ------------------------------------------------------------------------
def expand_env(value: Any, where: str = "") -> Any:
    """`${NAME}` in every string replaced from the environment; a missing variable is an error naming it."""
    if isinstance(value, dict):
        return {k: expand_env(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str):
        def sub(m: re.Match) -> str:
            if m.group(1) not in os.environ:
                raise StackConfigError(f"{where}: environment variable {m.group(1)} is not set")
            return os.environ[m.group(1)]

        return _ENV.sub(sub, value)
    return value


def explain(error: ValidationError, model: type[BaseModel] = None) -> str:
    """One line per bad field: its dotted name, what is wrong, the value given, and the field's documented
    meaning and range. Unknown keys list the keys allowed there."""
    model = model or StackConfig
    lines = []
    for err in error.errors():
        loc = [str(p) for p in err["loc"]]
        msg = err["msg"].removeprefix("Value error, ")
        inner = re.match(r"^([A-Za-z_][\w.]*): (.*)$", msg, re.S)
        if inner and (not loc or inner.group(1) != loc[-1]):  # a section's own check names the field
            loc, msg = loc + [inner.group(1)], inner.group(2)
            lines.append(f"{'.'.join(loc)}: {msg}")
            continue
        name = ".".join(loc)
        if not name:  # a model-level check: its message names the fields
            lines.append(msg)
            continue
        if err["type"] == "extra_forbidden":
            parent = _model_at(model, loc[:-1])
            allowed = ", ".join(parent.model_fields) if parent is not None else ""
            lines.append(f"{name}: unknown key" + (f" (allowed: {allowed})" if allowed else ""))
            continue
        field = _field_at(model, loc)
        doc = field.description if field is not None and field.description else ""
        given = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        lines.append(f"{name}: {msg}{given}" + (f" — {doc}" if doc else ""))
    return "; ".join(lines)


def _model_at(model: Optional[type[BaseModel]], loc: list[str]) -> Optional[type[BaseModel]]:
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        ann = field.annotation if field is not None else None
        ann = next((a for a in getattr(ann, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)), ann)
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model


def _field_at(model: type[BaseModel], loc: list[str]):
    parent = _model_at(model, loc[:-1]) if loc else None
    return getattr(parent, "model_fields", {}).get(loc[-1]) if loc else None


def parse_stack_config(data: Any, source: str = "config") -> StackConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise StackConfigError(f"{source}: expected a mapping of sections, got {type(data).__name__}")
    try:
        return StackConfig.model_validate(expand_env(data))
    except ValidationError as e:
        raise StackConfigError(f"{source}: {explain(e)}") from None


def load_stack_config(path: Optional[str | os.PathLike]) -> StackConfig:
    """The config in `path` (YAML), or the defaults when None. A missing file is an error."""
    if path is None:
        return StackConfig()
    p = Path(path).expanduser()
    if not p.is_file():
        raise StackConfigError(f"{p}: no such config file")
    import yaml

    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise StackConfigError(f"{p}: not valid YAML: {e}") from None
    return parse_stack_config(data, str(p))


def defaults_yaml() -> str:
    """Every section with its default values (trainer and policy list their inner configs' fields too)."""
    import yaml

    cfg = StackConfig()
    data = cfg.model_dump(mode="json")
    data["serving"] = {k: v for k, v in data["serving"].items() if k not in ("store", "registry_path")}
    data["store"]["local_root"] = None  # <state_dir>/store
    inner = NearlineConfig.model_fields
    data["trainer"].update({k: f.get_default(call_default_factory=True) for k, f in inner.items()
                            if k not in TrainerSection.filled})
    data["trainer"] = _jsonable(data["trainer"])
    data["policy"].update(PolicyConfig().model_dump(mode="json"))
    head = ("# adaptive-eagle up: the stack's defaults. Every key is optional; unknown keys are refused.\n"
            "# store.local_root null = <state_dir>/store; ${ENV_VAR} in a string is read from the environment.\n")
    return head + yaml.safe_dump(data, sort_keys=False)


def _jsonable(d: dict) -> dict:
    return {k: (v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else str(v)) for k, v in d.items()}


__all__ = ["StackConfig", "StackConfigError", "defaults_yaml", "expand_env", "load_stack_config",
           "parse_stack_config"]
