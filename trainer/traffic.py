"""Training rows from captured traffic: a `TraceRecord` becomes TTT training rows.

Owns: which positions of a record are trained on (`Positions`), where a record's target features
come from (captured by the server, or regenerated here with one target forward), and packing
records into a `TTTBatch`. Must not touch: the store (the near-line trainer reads it), optimizers,
the registry.

Features. The TTT loss needs, per position t, the target's aux features a_t (the head's input) and
the target's distribution over the next token (softmax of the LM head over the final-norm hidden
state s_t). A record captured by the reference engine carries both (`aux_hidden`, `final_hidden`,
trace schema >= 1.2), so training on it needs no target forward at all. A record without them (a
backend that cannot export hidden states, e.g. SGLang; a capture budget that kept tokens only; an
older schema; another aux layout) is regenerated with one batched target prefill over its tokens.
`bench/adapt.py` measures trained tokens per second both ways.

Positions. "generated" trains where the target produced the token (the record's loss mask);
"all" also trains on the prompt: the target's distribution is known there too (from the same
prefill), and prompts carry much of a drifting domain (pasted code, documents, tool schemas).
"new" is "all" with each prefix trained once: an agent re-sends its whole session every turn, so
under "all" a ten-turn session trains its first turn ten times over (its early positions outweigh
the late ones tenfold, at ten times the compute). Under "new" a record trains only the blocks of
tokens it was the first to carry (`PrefixOwners`, keyed as a prefix cache keys its blocks); what an
earlier turn carried is context, not a target. Position 0 is never a target (nothing predicts it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from adaptive_eagle.draft_head import Eagle3DraftHead
from adaptive_eagle.targets import Target
from adaptive_eagle.trace import TraceRecord
from trainer.ttt import TTTBatch

Positions = Literal["generated", "all", "new"]
POSITIONS: tuple[str, ...] = ("generated", "all", "new")


@dataclass(frozen=True)
class TrafficRow:
    """One record, truncated and masked for training; features attached when captured."""

    request_id: str
    domain: str | None
    input_ids: tuple[int, ...]  # [N]
    loss_mask: tuple[int, ...]  # [N] 1 where the token is a training target
    aux: torch.Tensor | None  # [T, n_aux * H] float32, T in (N - 1, N); None: regenerate
    final: torch.Tensor | None  # [T, H] float32 final-norm hidden states; None: regenerate

    @property
    def tokens(self) -> int:
        return len(self.input_ids)

    @property
    def trained_positions(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def captured(self) -> bool:
        return self.aux is not None and self.final is not None


class PrefixOwners:
    """Which record first carried each prefix of tokens. A record's tokens are cut into blocks of `block`;
    block i is keyed by a hash chained over blocks 0..i (so a key names the whole prefix up to it, as a
    prefix cache keys its blocks), and owned by the first record (request id) that carried it. The same
    record asking again (a replay, a later pass) owns the same blocks, so every prefix trains once a pass.
    Bounded: the `capacity` most recently carried blocks are kept; an evicted block goes to the next
    record that carries it. In memory only: after a restart the first record to carry a block owns it."""

    def __init__(self, block: int = 32, capacity: int = 1 << 18) -> None:
        if block < 1 or capacity < 1:
            raise ValueError(f"block {block}, capacity {capacity}: both must be >= 1")
        self.block, self.capacity = block, capacity
        self._owner: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def owned(self, request_id: str, input_ids: Sequence[int]) -> list[bool]:
        """Per block of `input_ids` (the last one may be partial): whether `request_id` owns it. Blocks no
        record holds yet become its own."""
        out, key = [], b""
        for i in range(0, len(input_ids), self.block):
            key = hashlib.blake2b(key + array("q", input_ids[i: i + self.block]).tobytes(), digest_size=16).digest()
            owner = self._owner.get(key)
            if owner is None:
                self._owner[key] = owner = request_id
                if len(self._owner) > self.capacity:
                    self._owner.popitem(last=False)
            else:
                self._owner.move_to_end(key)
            out.append(owner == request_id)
        return out


def training_mask(record: TraceRecord, positions: Positions, prefixes: PrefixOwners | None = None,
                  max_len: int | None = None) -> tuple[int, ...]:
    """1 where the record's token (within its first max_len) is a training target under `positions`;
    "new" needs the trainer's `prefixes`."""
    ids = record.input_ids[:max_len]
    if positions == "generated":
        return tuple(record.loss_mask[:max_len])
    if positions == "all":
        return (0,) + (1,) * (len(ids) - 1)
    if positions == "new":
        if prefixes is None:
            raise ValueError('positions "new" needs the PrefixOwners that tracks which record first carried each prefix')
        owned = prefixes.owned(record.request_id, ids)
        return (0,) + tuple(int(owned[t // prefixes.block]) for t in range(1, len(ids)))
    raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")


def row_from_record(record: TraceRecord, aux_layer_ids: Sequence[int], positions: Positions = "all",
                    max_len: int = 1024, prefixes: PrefixOwners | None = None) -> TrafficRow:
    """The record's first `max_len` tokens. Its captured features are used only when they were taken
    at the head's aux layers and include the final hidden state; otherwise the row is regenerated.
    `prefixes`: the trainer's PrefixOwners (positions "new")."""
    n = min(len(record.input_ids), max_len)
    mask = training_mask(record, positions, prefixes, n)
    aux = final = None
    usable = (record.aux_hidden is not None and record.final_hidden is not None
              and tuple(record.aux_layer_ids) == tuple(aux_layer_ids))
    if usable:
        aux = torch.from_numpy(record.aux_hidden[:n]).float()
        final = torch.from_numpy(record.final_hidden[:n]).float()
    return TrafficRow(record.request_id, record.domain, tuple(record.input_ids[:n]), mask, aux, final)


def _pad_rows(rows: Sequence[torch.Tensor], t: int) -> torch.Tensor:
    """[B, t, C] zero-padded from per-row [T_i, C] (T_i <= t)."""
    out = rows[0].new_zeros(len(rows), t, rows[0].shape[1])
    for b, x in enumerate(rows):
        out[b, : x.shape[0]] = x[:t]
    return out


def collate_rows(rows: Sequence[TrafficRow], pad_id: int = 0):
    """(input_ids [B, T], loss_mask [B, T], lengths [B]) right-padded."""
    t = max(r.tokens for r in rows)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    lengths = torch.tensor([r.tokens for r in rows], dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : r.tokens] = torch.tensor(r.input_ids)
        mask[b, : r.tokens] = torch.tensor(r.loss_mask)
    return ids, mask, lengths


def regenerate(target: Target, rows: Sequence[TrafficRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """One target prefill over the rows: (aux [B, T, n_aux * H], final [B, T, H]) in float32."""
    ids, _, lengths = collate_rows(rows)
    attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    feats = target.features(ids.to(target.device), attn.to(target.device))
    return feats.aux.float(), feats.last.float()


def features(target: Target, rows: Sequence[TrafficRow]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(aux [B, T, ...], final [B, T, H], regenerated row count): captured features where the rows have
    them, one target prefill over the rest."""
    t = max(r.tokens for r in rows)
    missing = [i for i, r in enumerate(rows) if not r.captured]
    aux_rows: list[torch.Tensor | None] = [r.aux for r in rows]
    final_rows: list[torch.Tensor | None] = [r.final for r in rows]
    if missing:
        aux_m, final_m = regenerate(target, [rows[i] for i in missing])
        for k, i in enumerate(missing):
            aux_rows[i], final_rows[i] = aux_m[k, : rows[i].tokens].cpu(), final_m[k, : rows[i].tokens].cpu()
    return _pad_rows(aux_rows, t), _pad_rows(final_rows, t), len(missing)


@dataclass(frozen=True)
class TrafficBatch:
    batch: TTTBatch
    rows: int
    tokens: int  # real tokens
    trained_positions: int  # loss-masked positions
    regenerated: int  # rows whose features came from a target forward here
    domains: tuple[str | None, ...] = ()  # [B] each row's record domain tag (None: untagged)


def make_traffic_batch(target: Target, head: Eagle3DraftHead, rows: Sequence[TrafficRow],
                       device: torch.device | str | None = None) -> TrafficBatch:
    """Pack rows into a TTTBatch on `device` (default: the head's). The target's distribution at every
    needed position comes from the final hidden state through the target's LM head, restricted to the
    draft vocabulary."""
    if not rows:
        raise ValueError("make_traffic_batch needs at least one row")
    device = torch.device(device) if device is not None else next(head.parameters()).device
    ids, mask, lengths = collate_rows(rows)
    aux, final, regenerated = features(target, rows)
    with torch.no_grad():
        w_draft = target.output_embeddings()[head.draft_to_target.to(target.device)].float().to(device)  # [Vd, H]
        final = final.to(device)
        batch = TTTBatch.build(ids.to(device), mask.to(device), lengths.to(device), aux.to(device),
                               lambda need: final[need] @ w_draft.T)
    return TrafficBatch(batch, len(rows), int(lengths.sum()), int(mask.sum()), regenerated,
                        tuple(r.domain for r in rows))


__all__ = ["POSITIONS", "Positions", "PrefixOwners", "TrafficBatch", "TrafficRow", "collate_rows", "features",
           "make_traffic_batch", "regenerate", "row_from_record", "training_mask"]
