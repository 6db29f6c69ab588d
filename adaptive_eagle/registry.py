"""Head registry: immutable head versions, the champion pointer, and the pin / block lists.

Owns: one registry root (a local directory, or a shared filesystem path in a cluster)::

    <root>/<version>/{config.json, model.safetensors, head.json}   immutable, written by checkpoint.save_head
    <root>/champion.json    the champion pointer: version, previous, set_at, reason, generation
    <root>/pinned.json      at most one pinned version (on-call: "serve this one, promote nothing else")
    <root>/blocked.json     versions that must never become champion, each with its reason
    <root>/.lock            exists only while a writer changes one of the three files above

Must not touch: the head math and the checkpoint format (``checkpoint.py``), promotion decisions
and ``promotions.jsonl`` (the policy), servers and hot swap (``engine.set_head``), the network.

Vocabulary: a *version* is one immutable head directory; the *champion* is the version servers
decode with, ``"none"`` meaning plain decoding (no head); *pinned* freezes the champion to one
version; *blocked* versions may never become champion; the *generation* counts champion changes.

Compare-and-set. ``set_champion(version, expect=...)`` changes the champion only if it still is
``expect``. Every change of a control file runs under ``<root>/.lock``, created with
``O_CREAT | O_EXCL`` (atomic on local filesystems and on NFSv3+): one writer holds it, the others
wait up to ``lock_timeout_s`` and then raise ``RegistryLockedError``. Holding it, a writer reads the
current champion, pin and blocks, checks ``expect`` and the rules, and replaces ``champion.json`` by
``atomic.atomic_write_text`` (temp file, fsync, rename). So of two writers expecting the same
champion, the second reads the first's pointer and is refused (``ChampionChange.ok`` False): both
can never win. Readers take no lock; the rename gives them the old pointer or the new one, never
a torn one. A writer that dies holding the lock leaves ``.lock`` behind (its pid, host and time are
in it, and the error names them); ``break_lock()`` removes it once its holder is known to be dead.
Nothing breaks a lock automatically, since two breakers could then both believe they hold it.

Refusals. A root that does not exist is an error naming it (``HeadRegistry.create`` makes one); no
read creates anything. A missing, malformed or inconsistent control file is refused with its path
and the reason, never read as empty. Versions are never overwritten.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adaptive_eagle.atomic import atomic_write_text, staging_dir
from adaptive_eagle.checkpoint import (
    CONFIG_FILE,
    META_FILE,
    WEIGHTS_FILE,
    HeadMeta,
    HeadValidationError,
    LoadedHead,
    file_sha256,
    load_head,
    save_head,
    utc_now_iso,
)
from adaptive_eagle.draft_head import Eagle3DraftHead
from adaptive_eagle.evidence import EVIDENCE_DIR
from adaptive_eagle.targets import Target
from adaptive_eagle.versions import PLAIN  # the champion that means plain decoding (no head)

CHAMPION_FILE, PINNED_FILE, BLOCKED_FILE, LOCK_FILE = "champion.json", "pinned.json", "blocked.json", ".lock"
CONTROL_FILES = (CHAMPION_FILE, PINNED_FILE, BLOCKED_FILE)
REGISTRY_FORMAT = 1
VERSION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
_RESERVED = {PLAIN, *CONTROL_FILES, EVIDENCE_DIR}  # candidates' test-then-train evidence (adaptive_eagle.evidence)


class RegistryError(ValueError):
    """The registry refused an operation or a file. The message names the path and the reason."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path, self.reason = str(path), reason
        super().__init__(f"{path}: {reason}")


class RegistryLockedError(RegistryError):
    """Another writer held ``<root>/.lock`` for longer than the lock timeout."""


# ---- results (frozen) -------------------------------------------------------------------------
@dataclass(frozen=True)
class Champion:
    """The champion pointer (champion.json)."""

    version: str  # a version of this registry, or "none" (plain decoding)
    previous: str | None  # the champion before this one; None for the first pointer
    set_at: str  # ISO-8601 UTC
    reason: str
    generation: int  # 0 for the pointer create() writes, +1 per change

    @property
    def plain(self) -> bool:
        return self.version == PLAIN


@dataclass(frozen=True)
class ChampionChange:
    """What set_champion did: ok False means refused (stale expect, blocked, pinned), with the reason."""

    ok: bool
    message: str
    champion: Champion  # the pointer after the call (the winner's, when refused)


@dataclass(frozen=True)
class Pin:
    version: str  # a version, or "none"
    reason: str
    pinned_at: str


@dataclass(frozen=True)
class Block:
    version: str
    reason: str
    blocked_at: str


@dataclass(frozen=True)
class HeadVersion:
    """One version's lineage and figures, from its head.json."""

    version: str
    path: Path
    parent: str | None  # the version it was fine-tuned from (maybe outside this registry)
    created: str
    target_name: str
    target_fingerprint: str
    sha256: str
    data: dict = field(default_factory=dict)  # training data summary; "window" is the traffic window, if any
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)

    @property
    def window(self) -> object | None:
        return self.data.get("window")


# ---- control files as read from disk (pydantic) ---------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _ChampionFile(_Strict):
    format_version: int = Field(ge=1, le=REGISTRY_FORMAT, description="layout version of the control files")
    version: str = Field(min_length=1, description="champion version, or 'none' for plain decoding")
    previous: str | None = Field(description="the champion before this one")
    set_at: str = Field(min_length=1, description="ISO-8601 UTC time of the change")
    reason: str = Field(description="why it changed (free text)")
    generation: int = Field(ge=0, description="number of champion changes so far")


class _PinEntry(_Strict):
    version: str = Field(min_length=1)
    reason: str
    pinned_at: str = Field(min_length=1)


class _PinnedFile(_Strict):
    format_version: int = Field(ge=1, le=REGISTRY_FORMAT)
    pinned: _PinEntry | None = Field(description="the pinned version, or null")


class _BlockEntry(_Strict):
    reason: str = Field(min_length=1, description="why this version must never become champion")
    blocked_at: str = Field(min_length=1)


class _BlockedFile(_Strict):
    format_version: int = Field(ge=1, le=REGISTRY_FORMAT)
    blocked: dict[str, _BlockEntry] = Field(description="version -> why it is blocked")


def check_version_name(name: str) -> str:
    """`name` if it can name a version directory, else ValueError (letters, digits, . _ + -; not 'none')."""
    if not isinstance(name, str) or not VERSION_NAME.match(name) or name in _RESERVED:
        raise ValueError(f"{name!r} is not a valid version name (1-128 of [A-Za-z0-9._+-], starting with a letter "
                         f"or digit, not one of {sorted(_RESERVED)})")
    return name


def _dump(model: BaseModel) -> str:
    return json.dumps(model.model_dump(), indent=2, sort_keys=True) + "\n"


class HeadRegistry:
    """A registry root. Reads never write; writes go through staging_dir (versions) or the lock (control files)."""

    def __init__(self, root: str | os.PathLike, *, lock_timeout_s: float = 10.0) -> None:
        self.root = Path(root)
        self.lock_timeout_s = lock_timeout_s
        if not self.root.is_dir():
            what = "is not a directory" if self.root.exists() else "does not exist"
            raise RegistryError(self.root, f"registry root {what} (HeadRegistry.create(root) makes one)")

    @classmethod
    def create(cls, root: str | os.PathLike, **kw) -> "HeadRegistry":
        """Make `root` a registry: the directory and any missing control file (champion 'none', no pin,
        no blocks). Existing versions and control files are kept, so this is safe to rerun."""
        Path(root).mkdir(parents=True, exist_ok=True)
        reg = cls(root, **kw)
        with reg._locked():
            now = utc_now_iso()
            initial = {
                CHAMPION_FILE: _ChampionFile(format_version=REGISTRY_FORMAT, version=PLAIN, previous=None, set_at=now,
                                             reason="registry created", generation=0),
                PINNED_FILE: _PinnedFile(format_version=REGISTRY_FORMAT, pinned=None),
                BLOCKED_FILE: _BlockedFile(format_version=REGISTRY_FORMAT, blocked={}),
            }
            for name, model in initial.items():
                if not (reg.root / name).exists():
                    atomic_write_text(reg.root / name, _dump(model))
        return reg

    # ---- versions ------------------------------------------------------------------------------
    def register(self, head: Eagle3DraftHead, meta: HeadMeta, *, dtype: torch.dtype = torch.bfloat16) -> str:
        """Save `head` as the new version `meta.version` (checkpoint.save_head, staged then renamed).
        An existing version is never overwritten: RegistryError."""
        name = self._new_name(meta.version)
        try:
            save_head(head, self.root / name, meta, dtype=dtype)
        except FileExistsError:
            raise RegistryError(self.root / name, "version exists; versions are immutable") from None
        return name

    def add(self, src: str | os.PathLike) -> str:
        """Import an existing version directory (validated by checkpoint.load_head, checksum included) under
        the version its head.json names; the copy's checksum is checked again before it is renamed in."""
        src = Path(src)
        meta = load_head(src).meta  # config, tensors, vocab map, finiteness, sha256: refuses with the reason
        name = self._new_name(meta.version)
        try:
            with staging_dir(self.root / name, overwrite=False) as tmp:
                for f in (CONFIG_FILE, WEIGHTS_FILE, META_FILE):
                    shutil.copyfile(src / f, tmp / f)
                if (digest := file_sha256(tmp / WEIGHTS_FILE)) != meta.sha256:
                    raise RegistryError(src / WEIGHTS_FILE, f"changed while copied (sha256 {digest[:16]}…, head.json "
                                                            f"{meta.sha256[:16]}…)")
        except FileExistsError:
            raise RegistryError(self.root / name, "version exists; versions are immutable") from None
        return name

    def _new_name(self, version: str) -> str:
        try:
            name = check_version_name(version)
        except ValueError as e:
            raise RegistryError(self.root, str(e)) from None
        if (self.root / name).exists():
            raise RegistryError(self.root / name, "version exists; versions are immutable")
        return name

    def __contains__(self, version: object) -> bool:
        return (isinstance(version, str) and version not in _RESERVED and bool(VERSION_NAME.match(version))
                and (self.root / version).is_dir())

    def get(self, version: str) -> Path:
        """The directory of `version`; RegistryError if it is not in the registry ('none' has no directory)."""
        if version == PLAIN:
            raise RegistryError(self.root, "'none' is plain decoding and has no head directory")
        if version not in self:
            raise RegistryError(self.root / str(version), "no such version in the registry")
        return self.root / version

    def version(self, version: str) -> HeadVersion:
        """One version's head.json (lineage, data, metrics); refuses a head.json naming another version."""
        d = self.get(version)
        if not (d / META_FILE).is_file():
            raise RegistryError(d / META_FILE, "missing: not a head version")
        try:
            meta = HeadMeta.from_json((d / META_FILE).read_text(), d / META_FILE)
        except HeadValidationError as e:
            raise RegistryError(e.file, e.reason) from None
        if meta.version != version:
            raise RegistryError(d / META_FILE, f"names version {meta.version!r}, but lies in directory {version!r}")
        return HeadVersion(version=version, path=d, parent=meta.parent, created=meta.created,
                           target_name=meta.target_name, target_fingerprint=meta.target_fingerprint,
                           sha256=meta.sha256, data=meta.data, training=meta.training, metrics=meta.metrics)

    def versions(self) -> list[HeadVersion]:
        """Every version, oldest first (by head.json's created, then name). Staging directories and other
        names that cannot be versions are not listed; a version with a bad head.json is refused."""
        names = [p.name for p in self.root.iterdir()
                 if p.is_dir() and VERSION_NAME.match(p.name) and p.name not in _RESERVED]
        found = [self.version(n) for n in names]
        return sorted(found, key=lambda v: (v.created, v.version))

    def lineage(self, version: str) -> list[str]:
        """`version`, its parent, grandparent, ...: as far as the chain stays inside this registry."""
        chain = [self.version(version).version]
        while (parent := self.version(chain[-1]).parent) is not None and parent in self and parent not in chain:
            chain.append(parent)
        return chain

    def load(self, version: str, target: Target | None = None, **kw) -> LoadedHead:
        """checkpoint.load_head of `version` (every check, sha256 included; kw: device, dtype, ...),
        refusing a head.json that names another version."""
        d = self.get(version)
        loaded = load_head(d, target, **kw)
        if loaded.meta.version != version:
            raise RegistryError(d / META_FILE, f"names version {loaded.meta.version!r}, but lies in directory "
                                               f"{version!r}")
        return loaded

    # ---- control files: reads ----------------------------------------------------------------
    def _read(self, name: str, model: type[BaseModel]) -> BaseModel:
        path = self.root / name
        if not path.is_file():
            raise RegistryError(path, "missing: not an initialised registry (HeadRegistry.create(root) adds the "
                                      "control files and keeps the versions)")
        try:
            return model.model_validate(json.loads(path.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RegistryError(path, f"malformed JSON ({e}); refusing to treat it as empty") from None
        except ValidationError as e:
            reasons = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}" for err in e.errors())
            raise RegistryError(path, f"{reasons}; refusing to treat it as empty") from None

    def _known(self, version: str, file: str, what: str) -> None:
        if version != PLAIN and version not in self:
            raise RegistryError(self.root / file, f"{what} {version!r} is not a version of this registry")

    def champion_pointer(self) -> Champion:
        m = self._read(CHAMPION_FILE, _ChampionFile)
        self._known(m.version, CHAMPION_FILE, "champion")
        return Champion(version=m.version, previous=m.previous, set_at=m.set_at, reason=m.reason,
                        generation=m.generation)

    def champion(self) -> str:
        """The champion version; 'none' means plain decoding."""
        return self.champion_pointer().version

    def pinned(self) -> Pin | None:
        entry = self._read(PINNED_FILE, _PinnedFile).pinned
        if entry is None:
            return None
        self._known(entry.version, PINNED_FILE, "pinned version")
        return Pin(version=entry.version, reason=entry.reason, pinned_at=entry.pinned_at)

    def blocked(self) -> dict[str, Block]:
        entries = self._read(BLOCKED_FILE, _BlockedFile).blocked
        for name in entries:
            self._known(name, BLOCKED_FILE, "blocked version")
            if name == PLAIN:
                raise RegistryError(self.root / BLOCKED_FILE, "blocks 'none' (plain decoding cannot be blocked)")
        return {name: Block(version=name, reason=e.reason, blocked_at=e.blocked_at) for name, e in entries.items()}

    # ---- control files: writes (under the lock) ------------------------------------------------
    def set_champion(self, version: str, *, expect: str, reason: str = "") -> ChampionChange:
        """Compare-and-set: make `version` ('none' = plain decoding) the champion if the champion is still
        `expect`. Refused (ok False, with the reason) when the champion moved on, `version` is blocked, or
        another version is pinned. An unknown version or a bad control file raises RegistryError."""
        self._known(version, CHAMPION_FILE, "version")
        with self._locked():
            current = self.champion_pointer()
            pin, blocks = self.pinned(), self.blocked()
            refusal = None
            if current.version != expect:
                refusal = (f"stale expect: the champion is {current.version!r} (generation {current.generation}, "
                           f"set {current.set_at}), not {expect!r}")
            elif version in blocks:
                refusal = f"{version!r} is blocked: {blocks[version].reason}"
            elif pin is not None and pin.version != version:
                refusal = f"{pin.version!r} is pinned ({pin.reason or 'no reason given'}); unpin first"
            if refusal is not None:
                return ChampionChange(ok=False, message=refusal, champion=current)
            if version == current.version:
                return ChampionChange(ok=True, message=f"{version!r} already is the champion", champion=current)
            new = _ChampionFile(format_version=REGISTRY_FORMAT, version=version, previous=current.version,
                                set_at=utc_now_iso(), reason=reason, generation=current.generation + 1)
            atomic_write_text(self.root / CHAMPION_FILE, _dump(new))
            return ChampionChange(ok=True, message=f"champion {current.version!r} -> {version!r}",
                                  champion=self.champion_pointer())

    def pin(self, version: str, reason: str = "") -> Pin:
        """Pin `version` ('none' allowed): until unpin(), set_champion accepts only it. Refuses a blocked
        version, and a pin while another version is pinned."""
        self._known(version, PINNED_FILE, "version")
        with self._locked():
            current, blocks = self.pinned(), self.blocked()
            if version in blocks:
                raise RegistryError(self.root / PINNED_FILE, f"{version!r} is blocked: {blocks[version].reason}")
            if current is not None and current.version != version:
                raise RegistryError(self.root / PINNED_FILE, f"{current.version!r} is already pinned; unpin first")
            new = Pin(version=version, reason=reason, pinned_at=utc_now_iso())
            self._write_pin(new)
            return new

    def unpin(self) -> Pin | None:
        """Remove the pin; returns the pin removed (None if nothing was pinned)."""
        with self._locked():
            current = self.pinned()
            if current is not None:
                self._write_pin(None)
            return current

    def _write_pin(self, pin: Pin | None) -> None:
        entry = None if pin is None else _PinEntry(version=pin.version, reason=pin.reason, pinned_at=pin.pinned_at)
        atomic_write_text(self.root / PINNED_FILE, _dump(_PinnedFile(format_version=REGISTRY_FORMAT, pinned=entry)))

    def block(self, version: str, reason: str) -> Block:
        """Block `version` from ever becoming champion (again). Refuses 'none', an empty reason, and the
        pinned version. Blocking the current champion is allowed: the policy then rolls back."""
        if version == PLAIN:
            raise RegistryError(self.root / BLOCKED_FILE, "'none' (plain decoding) cannot be blocked")
        if not reason:
            raise RegistryError(self.root / BLOCKED_FILE, f"blocking {version!r} needs a reason")
        self._known(version, BLOCKED_FILE, "version")
        with self._locked():
            pin, blocks = self.pinned(), self.blocked()
            if pin is not None and pin.version == version:
                raise RegistryError(self.root / BLOCKED_FILE, f"{version!r} is pinned; unpin it first")
            new = Block(version=version, reason=reason, blocked_at=utc_now_iso())
            self._write_blocks({**blocks, version: new})
            return new

    def unblock(self, version: str) -> Block | None:
        """Lift a block; returns the block lifted (None if `version` was not blocked)."""
        with self._locked():
            blocks = self.blocked()
            if version not in blocks:
                return None
            self._write_blocks({k: b for k, b in blocks.items() if k != version})
            return blocks[version]

    def _write_blocks(self, blocks: dict[str, Block]) -> None:
        entries = {k: _BlockEntry(reason=b.reason, blocked_at=b.blocked_at) for k, b in blocks.items()}
        text = _dump(_BlockedFile(format_version=REGISTRY_FORMAT, blocked=entries))
        atomic_write_text(self.root / BLOCKED_FILE, text)

    # ---- the lock ----------------------------------------------------------------------------
    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold <root>/.lock (O_CREAT | O_EXCL) for the body; wait up to lock_timeout_s for another holder."""
        path, token = self.root / LOCK_FILE, uuid.uuid4().hex
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                break
            except FileExistsError:
                if time.monotonic() >= deadline:
                    raise RegistryLockedError(path, f"held for more than {self.lock_timeout_s:g} s by "
                                                    f"{self._holder(path)}; if that writer is dead, "
                                                    "HeadRegistry.break_lock() removes the lock") from None
                time.sleep(0.005 + 0.01 * (uuid.uuid4().int % 100) / 100)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"token": token, "pid": os.getpid(), "host": socket.gethostname(), "since": utc_now_iso()},
                          f)
        except BaseException:
            path.unlink(missing_ok=True)  # ours: created above, not yet announced
            raise
        try:
            yield
        finally:
            try:  # remove only our own lock (someone may have broken it and taken a new one)
                if json.loads(path.read_text()).get("token") == token:
                    path.unlink()
            except (OSError, ValueError):
                pass

    @staticmethod
    def _holder(path: Path) -> str:
        try:
            h = json.loads(path.read_text())
            return f"pid {h.get('pid')} on {h.get('host')} since {h.get('since')}"
        except (OSError, ValueError):
            return "a writer that has not written its name yet (or an unreadable lock file)"

    def break_lock(self) -> str | None:
        """Remove a lock whose holder is dead (operators only); returns who held it, None if unlocked."""
        path = self.root / LOCK_FILE
        if not path.exists():
            return None
        holder = self._holder(path)
        path.unlink(missing_ok=True)
        return holder


__all__ = [
    "BLOCKED_FILE", "CHAMPION_FILE", "LOCK_FILE", "PINNED_FILE", "PLAIN", "Block", "Champion", "ChampionChange",
    "HeadRegistry", "HeadVersion", "Pin", "RegistryError", "RegistryLockedError", "check_version_name",
]
