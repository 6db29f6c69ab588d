"""The pre-tokenised conversation file: what trainer.data renders, as compressed numpy arrays.

Owns: writing and reading ``tokens.npz``, a zip (LZMA, fixed timestamps: the same conversations
give the same bytes) of plain numpy arrays, read with ``allow_pickle=False``:

    tokens   [N]      uint16 (uint32 when the vocabulary is larger)  every conversation's input_ids, concatenated
    mask     [N/8]    uint8   the loss masks, bit-packed (little bit order)
    offsets  [C + 1]  int64   conversation c is tokens[offsets[c]:offsets[c + 1]]
    domain   [C]      int8    index into trainer.data.DOMAINS
    heldout  [C]      int8    1 when trainer.data.split_of puts the conversation in the held-out split
    ids      [C]      unicode conversation ids
    meta     [bytes]  uint8   JSON: source, max_len, tokenizer, counts

Conversations are kept in source order and unfiltered (rendered up to the pack's max_len), so that
``examples(split, domains, max_len, limit)`` equals trainer.train_head.load_examples for any
max_len up to the pack's: truncation and the min-assistant-token filter happen on read, as
tokenize_all does them. Must not touch: models, tokenizers at read time (the device has none).
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data import DOMAINS, TokenizedExample

_DATE = (1980, 1, 1, 0, 0, 0)
FIELDS = ("tokens", "mask", "offsets", "domain", "heldout", "ids", "meta")


def write_tokens(path: Path, examples: Sequence[TokenizedExample], heldout: Sequence[bool], meta: dict,
                 vocab_size: int) -> None:
    """Write `examples` (source order; `heldout` per example) into `path`, deterministically."""
    lengths = np.array([len(e.input_ids) for e in examples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tok_dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    tokens = np.fromiter((t for e in examples for t in e.input_ids), dtype=np.int64, count=int(offsets[-1]))
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size})")
    mask = np.fromiter((m for e in examples for m in e.loss_mask), dtype=np.uint8, count=int(offsets[-1]))
    arrays = {
        "tokens": tokens.astype(tok_dtype),
        "mask": np.packbits(mask, bitorder="little"),
        "offsets": offsets,
        "domain": np.array([DOMAINS.index(e.domain) for e in examples], dtype=np.int8),
        "heldout": np.array([1 if h else 0 for h in heldout], dtype=np.int8),
        "ids": np.array([e.id for e in examples], dtype=str) if examples else np.zeros(0, dtype="<U1"),
        "meta": np.frombuffer(json.dumps({**meta, "vocab_size": vocab_size}, sort_keys=True).encode(), dtype=np.uint8),
    }
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w") as zf:
        for name in FIELDS:
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=_DATE)
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue(), compress_type=zipfile.ZIP_LZMA)
    tmp.replace(path)


@dataclass(frozen=True)
class TokenData:
    """The arrays of one tokens.npz (see the module docstring for their shapes)."""

    tokens: np.ndarray
    mask: np.ndarray  # unpacked: [N] uint8
    offsets: np.ndarray
    domain: np.ndarray
    heldout: np.ndarray
    ids: np.ndarray
    meta: dict

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def select(self, split: str | None, domains: Iterable[str] | None) -> np.ndarray:
        """Indices (source order) of the conversations of `split` ('train' | 'heldout' | None) and `domains`."""
        keep = np.ones(len(self), dtype=bool)
        if split is not None:
            if split not in ("train", "heldout"):
                raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
            keep &= self.heldout == (1 if split == "heldout" else 0)
        if domains is not None:
            codes = [DOMAINS.index(d) for d in domains]
            keep &= np.isin(self.domain, codes)
        return np.flatnonzero(keep)

    def example(self, i: int, max_len: int | None = None) -> TokenizedExample:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        if max_len is not None:
            b = min(b, a + max_len)
        return TokenizedExample(id=str(self.ids[i]), domain=DOMAINS[int(self.domain[i])],
                                input_ids=self.tokens[a:b].astype(np.int64).tolist(),
                                loss_mask=self.mask[a:b].astype(np.int64).tolist())

    def examples(self, split: str | None, domains: Iterable[str] | None, max_len: int, limit: int | None = None,
                 min_assistant_tokens: int = 16) -> list[TokenizedExample]:
        """What trainer.train_head.load_examples gives for the same split, domains, max_len and limit."""
        packed = int(self.meta.get("max_len") or 0)
        if packed and max_len > packed:
            raise ValueError(f"max_len {max_len} exceeds the packed max_len {packed}: re-pack with --max-len {max_len}")
        idx = self.select(split, domains)
        if limit is not None:
            idx = idx[:limit]
        out = []
        for i in idx:
            ex = self.example(int(i), max_len)
            if sum(ex.loss_mask) >= min_assistant_tokens:
                out.append(ex)
        return out

    def masked_counts(self, idx: np.ndarray, max_len: int, vocab_size: int,
                      min_assistant_tokens: int = 16) -> np.ndarray:
        """[vocab] counts of loss-masked tokens over conversations `idx` truncated to max_len and kept by
        the same filter as `examples` (what trainer.warm_start.token_counts counts, vectorised)."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for i in idx:
            a = int(self.offsets[i])
            b = min(int(self.offsets[i + 1]), a + max_len)
            m = self.mask[a:b].astype(bool)
            if int(m.sum()) >= min_assistant_tokens:
                counts += np.bincount(self.tokens[a:b][m].astype(np.int64), minlength=vocab_size)
        return counts


def read_tokens(path: Path) -> TokenData:
    with np.load(path, allow_pickle=False) as z:
        missing = [f for f in FIELDS if f not in z.files]
        if missing:
            raise ValueError(f"{path}: missing arrays {missing}")
        arrays = {f: z[f] for f in FIELDS}
    n = int(arrays["offsets"][-1])
    mask = np.unpackbits(arrays["mask"], count=n, bitorder="little")
    meta = json.loads(arrays["meta"].tobytes().decode())
    return TokenData(tokens=arrays["tokens"], mask=mask, offsets=arrays["offsets"], domain=arrays["domain"],
                     heldout=arrays["heldout"], ids=arrays["ids"], meta=meta)
