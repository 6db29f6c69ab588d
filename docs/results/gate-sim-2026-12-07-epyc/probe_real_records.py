"""The tail test's first bet alone against the two bets averaged, on real paired records: each promotion log's
`paired_records` (the records a promotion rested on), resampled with replacement to 450 records, 12 resamples
a log; prints the record at which each test first reaches its bar (None: not within 450) and the medians.

    python probe_real_records.py ../continual-2026-12-07c-epyc/run3/promotions.jsonl ...

Demo settings (tail_quantile 0.25, confidence 0.9). Seeded: two runs print the same."""

import json
import sys

import numpy as np

from policies import sequential as S

Q, ALPHA, LENGTH, RESAMPLES = 0.25, 0.1, 450, 12


def paired_records(log_path: str) -> tuple[np.ndarray, np.ndarray]:
    for line in open(log_path):
        ev = json.loads(line).get("evidence") or {}
        if "paired_records" in ev:
            return np.array(ev["paired_records"]["champion"]), np.array(ev["paired_records"]["candidate"])
    raise SystemExit(f"{log_path}: no promotion with paired records")


def first(a: np.ndarray, b: np.ndarray, mix) -> int | None:
    shipped = S.THRESHOLD_MIX
    S.THRESHOLD_MIX = mix
    try:
        hit = np.flatnonzero(S.tail_mean_log_evalue_path(a, b, Q, ALPHA) >= S.tail_log_bar(ALPHA))
    finally:
        S.THRESHOLD_MIX = shipped
    return int(hit[0]) + 1 if len(hit) else None


def main() -> None:
    rng = np.random.default_rng(1)
    for path in sys.argv[1:]:
        a0, b0 = paired_records(path)
        rows = []
        for _ in range(RESAMPLES):
            idx = rng.integers(0, len(a0), LENGTH)
            rows.append((first(a0[idx], b0[idx], ((0.0, 1.0),)), first(a0[idx], b0[idx], S.THRESHOLD_MIX)))
        med = np.median([[x or 10**9 for x in r] for r in rows], axis=0)
        show = ["never" if m >= 10**9 else int(m) for m in med]
        print(f"{path}: {len(a0)} records; median first record, first bet alone {show[0]}, both bets {show[1]}; "
              f"per resample {rows}")


if __name__ == "__main__":
    main()
