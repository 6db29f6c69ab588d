"""bench/adapt.py --workload long: adaptation to long multi-turn agent sessions, by context position.

Long multi-turn agent sessions (bench/sessions.py: chat sessions chaining real
ShareGPT user turns, and tool sessions whose tool outputs are real ShareGPT answers), replayed turn by
turn through the reference engine with capture on, every request carrying the whole history and the
target's own earlier answers, up to the target's context. Training-split sessions are the captured
traffic; held-out-split sessions (never trained on) are scored by acceptance replay, sliced by the
context position of each verify step (trainer/positions.py buckets). Heads: (a) shipped; (b) the
near-line trainer on the captured sessions at full length (max_len = the target's context); (e) the same
trainer capped at 1,024 tokens a record; equal CPU-minutes. Ends with one JSON line holding
long_accept_length_shipped / _adapted / _capped (positions >= 1,024), long_gain_pct ((b) over (a)
there), short_loss_pct ((a) over (b) below 1,024), the verify steps each rests on, the by-position
table, the store's bytes per token (its default hidden-state codec), and 90% intervals of the three gains
with the held-out sessions resampled (what the session sample can settle). Trainer settings (--lr, --positions,
--max-loss-rows) are compared with --heldout-from K, which scores held-out sessions K.. instead: the
reported sessions 0..N-1 (N <= K) are then never read by a choice.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from adaptive_eagle.checkpoint import load_head
from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
from adaptive_eagle.targets import cache_dir
from adaptive_eagle.trace import SamplingParams, TraceRecord
from bench.adapt import nearline_run
from feature_store.config import StoreConfig
from feature_store.reader import RecordFilter, scan_records
from feature_store.writer import StoreWriter
from trainer import data as D
from trainer.replay import ReplayScore, TreeParams, replay_heads


# ---- --workload long: long agent sessions -------------------------------------------------------------------
LONG_EDGE = 1024  # "long" positions: at or past this many tokens of context


def session_records(target, head_dir: Path, split: str, n: int, max_tokens: int, min_chars: int, max_turns: int,
                    log, skip: int = 0) -> list:
    """Every turn's TraceRecord of `n` long sessions (bench/sessions.py) of a ShareGPT split, the ones after
    the split's first `skip` (sessions are built in order, so the first `skip` are those a run with
    n = skip reads, and no others), replayed through
    the reference engine with capture on (greedy, the shipped head), each turn carrying the whole history with
    the target's own answers. Each session is cached in its own local store (the store's default codec) under
    the cache dir, keyed by its text, so a larger --sessions replays only the sessions not yet cached."""
    from bench.sessions import build_sessions, replay

    loaded = load_head(head_dir, target)
    sessions = build_sessions(D.select(D.load_sharegpt(), split=split), skip + n, min_chars=min_chars,
                              max_turns=max_turns, answer_chars=4 * max_tokens)
    sessions = [s for s in sessions if s.index >= skip]
    context = target.config.max_position_embeddings - EngineConfig().num_draft_tokens - 1 - max_tokens
    engine, recs, t0 = None, [], time.time()
    for si, sess in enumerate(sessions):
        key = hashlib.sha256(json.dumps([target.fingerprint, loaded.meta.sha256, sess.system, sess.turns, max_tokens,
                                         context]).encode()).hexdigest()
        store = StoreConfig(backend="local", local_root=str(cache_dir() / "bench-adapt" / f"session-{key[:20]}"),
                            fsync=False)
        done = Path(store.local_root, "complete")
        if done.exists():
            recs.extend(stored(store))
            continue
        if engine is None:
            log(f"replaying long {split} sessions (turn by turn, the target's own answers) with capture on ...")
            engine = SpeculativeEngine(target, loaded, EngineConfig(calibration_dir=""),
                                       head_version=loaded.meta.version)
        shutil.rmtree(store.local_root, ignore_errors=True)  # a replay cut short leaves no partial session behind
        writer, mine = StoreWriter(store), []

        def generate(messages, k, sess=sess, writer=writer, mine=mine):
            r = engine.generate(messages, SamplingParams(max_tokens=max_tokens), capture=True,
                                request_id=f"{split}-{sess.id}-{k}")
            rec = TraceRecord(**{**r.trace.__dict__, "domain": f"session-{sess.kind}"})
            writer.put(rec)
            mine.append(rec)
            return r.text

        sent = replay(sess, generate, fits=lambda m: len(engine.encode(m)) <= context)
        writer.close()
        done.write_text(json.dumps({"session": sess.id, "records": len(mine)}))
        recs.extend(stored(store))  # as the store's codec keeps them: a first run scores what a rerun reads
        log(f"  session {si + 1}/{len(sessions)} ({sess.kind}): {len(sent)} turns, last context "
            f"{len(mine[-1].input_ids) if mine else 0} tokens, {time.time() - t0:.0f} s")
    return recs


def stored(store: StoreConfig) -> list:
    """A cached session's records as its store returns them, in turn order (a session's turns grow; store
    order may not)."""
    return sorted(scan_records(store, RecordFilter()).records, key=lambda r: len(r.input_ids))


def store_bytes_per_token(records: list, codec: str) -> float:
    """Encoded bytes per token of captured records (hidden states through `codec`, ids and metadata)."""
    from feature_store.schema import encode_record

    total = sum(len(encode_record(r, codec)) for r in records)
    return total / max(1, sum(len(r.input_ids) for r in records))


def replay_score(head, target, records, tree: TreeParams) -> ReplayScore:
    return replay_heads({"h": head.float().eval()}, records, target, tree).scores["h"]


def session_of(request_id: str) -> str:
    """A session turn's session: its request id (f"{split}-{session id}-{turn}") without the turn."""
    return request_id.rsplit("-", 1)[0]


def session_sums(score: ReplayScore, edge: int) -> dict[str, tuple[int, int, int, int]]:
    """Per session: (tokens accepted, verify steps) at positions below `edge`, then at or past it."""
    out: dict[str, list[int]] = {}
    for r in score.records:
        sums = out.setdefault(session_of(r.request_id), [0, 0, 0, 0])
        if len(r.positions) != r.steps:  # replayed without positions: left out, as by_position does
            continue
        for p, a in zip(r.positions, r.accepted):
            k = 2 if p >= edge else 0
            sums[k] += a
            sums[k + 1] += 1
    return {k: tuple(v) for k, v in out.items()}


def bootstrap_gain(base: dict, other: dict, long: bool, n: int = 4000, level: float = 0.9,
                   seed: int = 0) -> tuple[float, float]:
    """`level` interval of the pooled accept-length gain (percent) of `other` over `base` at long (else short)
    positions, sessions resampled with replacement; both heads are scored on the same resample (paired).
    Held-out sessions differ more than heads do: this says what the session sample can settle."""
    sessions = sorted(base)
    k = 2 if long else 0
    b = np.array([base[s][k: k + 2] for s in sessions], dtype=float)
    o = np.array([other.get(s, (0, 0, 0, 0))[k: k + 2] for s in sessions], dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(sessions), (n, len(sessions)))
    bs, os_ = b[idx].sum(1), o[idx].sum(1)  # [n, 2]: accepted, steps
    ok = (bs[:, 1] > 0) & (os_[:, 1] > 0)
    gain = 100 * ((1 + os_[ok, 0] / os_[ok, 1]) / (1 + bs[ok, 0] / bs[ok, 1]) - 1)
    if not len(gain):
        return float("nan"), float("nan")
    lo, hi = np.quantile(gain, [(1 - level) / 2, (1 + level) / 2])
    return round(float(lo), 2), round(float(hi), 2)


def split_at(buckets: list[dict], edge: int) -> tuple[float, float, int, int]:
    """(accept length below `edge`, at or past it, verify steps below, at or past) from by-position buckets."""
    lo = [b for b in buckets if b["start"] < edge]
    hi = [b for b in buckets if b["start"] >= edge]

    def mean(bs):
        steps = sum(b["steps"] for b in bs)
        return 1.0 + sum(b["accepted"] for b in bs) / steps if steps else float("nan"), steps

    (a, na), (b, nb) = mean(lo), mean(hi)
    return a, b, na, nb


def long_workload(args, target, log) -> None:
    """(a) the shipped head, (b) the near-line trainer on captured long sessions at full length (max_len =
    the target's context) and (e) the same trainer capped at 1,024 tokens, equal CPU-minutes, scored by
    acceptance replay on held-out sessions never trained on, by context position."""
    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-adapt-long-"))
    train = session_records(target, args.head, "train", args.sessions, args.max_tokens, args.session_chars,
                            args.session_turns, log)
    held = session_records(target, args.head, "heldout", args.heldout_sessions, args.max_tokens, args.session_chars,
                           args.session_turns, log, skip=args.heldout_from)
    codec = StoreConfig.model_fields["codec"].default
    bpt = store_bytes_per_token(held, codec)
    tree = TreeParams()
    scores = {"(a) shipped": replay_score(load_head(args.head, target).head, target, held, tree)}
    log(f"{len(train)} training records ({sum(len(r.input_ids) for r in train)} tokens), {len(held)} held-out "
        f"records; {bpt:.0f} bytes a token in the store ({codec})")
    full_len = target.config.max_position_embeddings
    runs = {"(b) near-line, full length": full_len, f"(e) near-line, capped at {LONG_EDGE}": LONG_EDGE}
    infos = {}
    for label, max_len in runs.items():
        log(f"{label}: {args.minutes} CPU-min, max_len {max_len}")
        head, _, info = nearline_run(target, args.head, train, work / f"max{max_len}", args.minutes, args.positions,
                                     1, None, log, args.lr, args.max_passes, max_len=max_len,
                                     max_loss_rows=args.max_loss_rows)
        scores[label] = replay_score(head, target, held, tree)
        infos[label] = info
    rows = {k: v.by_position() for k, v in scores.items()}
    labels = list(rows)
    sums = [session_sums(scores[k], LONG_EDGE) for k in labels]
    ci90 = {"long_gain_pct": bootstrap_gain(sums[0], sums[1], long=True),
            "short_loss_pct": tuple(-x for x in reversed(bootstrap_gain(sums[0], sums[1], long=False))),
            "long_gain_capped_pct": bootstrap_gain(sums[0], sums[2], long=True)}
    print()
    print(f"{'head':34s} " + " ".join(f"{b['bucket']:>9s}" for b in rows[labels[0]]))
    for label in labels:
        print(f"{label:34s} " + " ".join(f"{b['accept_length']:9.3f}" for b in rows[label]))
    print(f"{'verify steps':34s} " + " ".join(f"{b['steps']:9d}" for b in rows[labels[0]]))
    print(f"90% intervals over the {len(sums[0])} held-out sessions (resampled): long gain {ci90['long_gain_pct']}, "
          f"short loss {ci90['short_loss_pct']}, capped long gain {ci90['long_gain_capped_pct']} (percent)")
    (a_short, a_long, n_short, n_long), (b_short, b_long, _, _), (e_short, e_long, _, _) = (
        split_at(rows[k], LONG_EDGE) for k in labels)
    summary = {
        "workload": "long", "machine_threads": torch.get_num_threads(), "minutes": args.minutes, "lr": args.lr,
        "positions": args.positions, "max_tokens": args.max_tokens,
        "sessions": {"train": args.sessions, "heldout": args.heldout_sessions, "heldout_from": args.heldout_from},
        "max_loss_rows": args.max_loss_rows,
        "records": {"train": len(train), "heldout": len(held)},
        "tokens": {"train": sum(len(r.input_ids) for r in train), "heldout": sum(len(r.input_ids) for r in held)},
        "longest_context": max(len(r.input_ids) for r in held + train),
        "verify_steps": {"short": n_short, "long": n_long},
        "by_position": {k: v for k, v in rows.items()},
        "long_accept_length_shipped": round(a_long, 4), "long_accept_length_adapted": round(b_long, 4),
        "long_accept_length_capped": round(e_long, 4),
        "long_gain_pct": round(100 * (b_long - a_long) / a_long, 2),
        "long_gain_capped_pct": round(100 * (e_long - a_long) / a_long, 2),
        "short_accept_length_shipped": round(a_short, 4), "short_accept_length_adapted": round(b_short, 4),
        "short_accept_length_capped": round(e_short, 4),
        "short_loss_pct": round(100 * (a_short - b_short) / a_short, 2),
        "ci90_over_sessions": ci90,
        "store_bytes_per_token": round(bpt, 1), "store_codec": codec,
        "trainer": infos,
    }
    print(json.dumps(summary))
