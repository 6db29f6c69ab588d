"""Parts: one payload (a deterministic tar) cut into files that each fit one device call.

Owns: the payload tar (fixed order, mtime 0, no owners: the same inputs give the same bytes), the
parts and their manifest (sha256 of every part and of the whole payload, which part travels in
which call), resumable writing (a part whose bytes already match is not rewritten), collecting
parts on the far side (a part whose sha256 does not match is refused by name) and reassembly.
Standard library only: this module runs on the device's bare Python as well as here.

Vocabulary: the *payload* is the tar; a *part* is a slice of it (``part-000.bin``...); a *call* is
one ``run`` of the device tool, which carries the manifest and the parts of that call.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
MiB = 1 << 20
_CHUNK = 1 << 22


class PartError(ValueError):
    """A part is missing, the wrong size, or its sha256 does not match the manifest."""


@dataclass(frozen=True)
class Part:
    name: str  # file name, "part-000.bin"
    offset: int  # byte offset in the payload
    size: int  # bytes
    sha256: str  # hex


@dataclass(frozen=True)
class Manifest:
    payload_sha256: str  # hex sha256 of the whole tar
    payload_size: int  # bytes
    parts: tuple[Part, ...]
    calls: tuple[tuple[str, ...], ...]  # part names carried by each device call, in order
    meta: dict = field(default_factory=dict)  # what pack.py recorded (contents, sizes, plan)
    format: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        if raw.get("format") != 1:
            raise PartError(f"{MANIFEST}: unknown format {raw.get('format')!r}")
        return cls(payload_sha256=raw["payload_sha256"], payload_size=int(raw["payload_size"]),
                   parts=tuple(Part(**p) for p in raw["parts"]), calls=tuple(tuple(c) for c in raw["calls"]),
                   meta=raw.get("meta", {}), format=1)

    def part(self, name: str) -> Part:
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(name)


def sha256_file(path: str | os.PathLike, offset: int = 0, size: int | None = None) -> str:
    """Hex sha256 of `size` bytes of `path` from `offset` (all of it by default)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = size
        while left is None or left > 0:
            chunk = f.read(_CHUNK if left is None else min(_CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return h.hexdigest()


# ---- the payload tar -------------------------------------------------------------------------------
def write_payload(entries: Sequence[tuple[str, Path]], out: Path) -> str:
    """Write `entries` ((name in the tar, file here), in the order given) as a deterministic tar;
    returns its sha256. Put what changes least first: a change then moves only the later parts."""
    names = [n for n, _ in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate payload names: {sorted(n for n in names if names.count(n) > 1)}")
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, path in entries:
            info = tarfile.TarInfo(name)
            info.size = Path(path).stat().st_size
            info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
            with open(path, "rb") as f:
                tar.addfile(info, f)
    os.replace(tmp, out)
    return sha256_file(out)


def extract_payload(payload: Path, dest: Path) -> list[str]:
    """Unpack the payload tar into `dest` (plain files only, no path escapes); returns the names."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(payload, "r") as tar:
        members = tar.getmembers()
        for m in members:
            if not m.isfile() or m.name.startswith("/") or ".." in Path(m.name).parts:
                raise PartError(f"payload member {m.name!r} is not a plain relative file")
        tar.extractall(dest, filter="data")
    return [m.name for m in members]


# ---- cutting and planning ----------------------------------------------------------------------------
def plan_calls(part_names: Sequence[str], part_sizes: Sequence[int], call_budget: int) -> tuple[tuple[str, ...], ...]:
    """Greedy, in order: as many whole parts per call as fit `call_budget` bytes (at least one)."""
    calls: list[list[str]] = []
    used = call_budget + 1
    for name, size in zip(part_names, part_sizes):
        if used + size > call_budget:
            calls.append([])
            used = 0
        calls[-1].append(name)
        used += size
    return tuple(tuple(c) for c in calls)


def cut_parts(payload: Path, out_dir: Path, part_size: int) -> tuple[list[Part], list[str]]:
    """Slice `payload` into `out_dir/part-NNN.bin` of at most `part_size` bytes. A part file whose size
    and sha256 already match its slice is kept as is (resume). Returns (parts, names rewritten)."""
    if part_size < 1:
        raise ValueError(f"part size {part_size} must be >= 1 byte")
    out_dir.mkdir(parents=True, exist_ok=True)
    total = payload.stat().st_size
    parts, written = [], []
    with open(payload, "rb") as src:
        for i, offset in enumerate(range(0, max(total, 1), part_size)):
            size = min(part_size, total - offset)
            src.seek(offset)
            data = src.read(size)
            digest = hashlib.sha256(data).hexdigest()
            part = Part(name=f"part-{i:03d}.bin", offset=offset, size=size, sha256=digest)
            dst = out_dir / part.name
            if not (dst.is_file() and dst.stat().st_size == size and sha256_file(dst) == digest):
                tmp = dst.with_name(dst.name + ".tmp")
                tmp.write_bytes(data)
                os.replace(tmp, dst)
                written.append(part.name)
            parts.append(part)
    keep = {p.name for p in parts}
    for stale in out_dir.glob("part-*.bin"):  # parts of a longer, older payload
        if stale.name not in keep:
            stale.unlink()
    return parts, written


# ---- the far side ------------------------------------------------------------------------------------
def verify_part(path: Path, part: Part) -> None:
    """Raise PartError naming the part unless `path` holds exactly its bytes."""
    if not path.is_file():
        raise PartError(f"{part.name}: missing")
    if path.stat().st_size != part.size:
        raise PartError(f"{part.name}: {path.stat().st_size} bytes, manifest says {part.size}")
    digest = sha256_file(path)
    if digest != part.sha256:
        raise PartError(f"{part.name}: sha256 {digest[:16]}… does not match the manifest's {part.sha256[:16]}…")


def collect(manifest: Manifest, sources: Iterable[Path], store: Path) -> tuple[list[str], list[str]]:
    """Move every verified part found in `sources` into `store` (out of the synced tree); a part that
    arrives corrupt raises PartError with its name. Returns (parts held in store, parts still missing)."""
    store.mkdir(parents=True, exist_ok=True)
    for src in sources:
        for part in manifest.parts:
            p = Path(src) / part.name
            if p.is_file() and p.resolve() != (store / part.name).resolve():
                verify_part(p, part)
                shutil.copyfile(p, store / (part.name + ".tmp"))
                os.replace(store / (part.name + ".tmp"), store / part.name)
    held, missing = [], []
    for part in manifest.parts:
        p = store / part.name
        ok = p.is_file() and p.stat().st_size == part.size
        (held if ok else missing).append(part.name)
    return held, missing


def assemble(manifest: Manifest, parts_dir: Path, out: Path) -> Path:
    """Concatenate the parts (each verified) into `out` and check the whole payload's sha256."""
    h = hashlib.sha256()
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as dst:
        for part in sorted(manifest.parts, key=lambda p: p.offset):
            verify_part(parts_dir / part.name, part)
            with open(parts_dir / part.name, "rb") as src:
                for chunk in iter(lambda: src.read(_CHUNK), b""):
                    h.update(chunk)
                    dst.write(chunk)
    if h.hexdigest() != manifest.payload_sha256:
        tmp.unlink()
        raise PartError(f"payload sha256 {h.hexdigest()[:16]}… does not match the manifest's "
                        f"{manifest.payload_sha256[:16]}… (parts from two different packs?)")
    os.replace(tmp, out)
    return out


def read_manifest(path: Path) -> Manifest:
    try:
        return Manifest.from_json(Path(path).read_text())
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PartError(f"{path}: unreadable manifest ({e})") from None


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def split_file(path: Path, out_dir: Path, part_size: int, stem: str) -> list[dict]:
    """Cut one file into `out_dir/<stem>.NN` of at most part_size bytes (for $OUT's per-file limit);
    returns [{name, size, sha256}] in order. Reassemble with `join_file`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pieces = []
    with open(path, "rb") as f:
        for i, chunk in enumerate(iter(lambda: f.read(part_size), b"")):
            name = f"{stem}.{i:02d}"
            write_bytes_atomic(out_dir / name, chunk)
            pieces.append({"name": name, "size": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    return pieces


def join_file(pieces: Sequence[dict], src_dir: Path, out: Path) -> Path:
    """Concatenate pieces written by `split_file` after checking each one's sha256 (refused by name)."""
    buf = io.BytesIO()
    for piece in pieces:
        verify_part(Path(src_dir) / piece["name"],
                    Part(name=piece["name"], offset=0, size=int(piece["size"]), sha256=piece["sha256"]))
        buf.write((Path(src_dir) / piece["name"]).read_bytes())
    write_bytes_atomic(out, buf.getvalue())
    return out


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
