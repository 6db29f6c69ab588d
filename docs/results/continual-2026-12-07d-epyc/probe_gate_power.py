"""What limits the sequential offline gate's decision on a real run's evidence: the record at which the shipped
tail test (policies.sequential) promotes on the paired records a promotion log keeps, against the same test
with its price for not knowing the champion's tail threshold scaled down (0: an oracle that knows it, not a
valid test, only an upper bound on what a tighter band could buy), and against heads that gain x on every
record of the same champion values (the test's best case at that gain).

    python probe_gate_power.py run4/promotions.jsonl [tail_quantile confidence_level]

Defaults are the demo's gate (tail_quantile 0.25, confidence_level 0.9)."""

import json
import sys

import numpy as np

from policies import sequential as S


def paired_records(log_path: str) -> tuple[np.ndarray, np.ndarray]:
    for line in open(log_path):
        ev = json.loads(line).get("evidence") or {}
        if "paired_records" in ev:
            return np.array(ev["paired_records"]["champion"]), np.array(ev["paired_records"]["candidate"])
    raise SystemExit(f"{log_path}: no promotion with paired records")


def lowest(x: np.ndarray, q: float) -> float:
    return float(np.sort(x)[:max(1, int(len(x) * q))].mean())


def decided_at(a: np.ndarray, b: np.ndarray, q: float, alpha: float) -> str:
    path = S.tail_mean_log_evalue_path(a, b, q, alpha)
    hit = np.flatnonzero(path >= S.tail_log_bar(alpha))
    return f"record {hit[0] + 1}" if len(hit) else f"not within {len(a)} (log e {path[-1]:.2f})"


def main() -> None:
    a, b = paired_records(sys.argv[1])
    q = float(sys.argv[2]) if len(sys.argv) > 2 else 0.25
    alpha = 1.0 - (float(sys.argv[3]) if len(sys.argv) > 3 else 0.9)
    print(f"{len(a)} paired records; mean {a.mean():.3f} -> {b.mean():.3f}; "
          f"lowest {q:.0%} mean {lowest(a, q):.3f} -> {lowest(b, q):.3f}; "
          f"log bar {S.tail_log_bar(alpha):.2f}")
    shipped = S._gap_bounds_at
    try:
        for scale in (1.0, 0.5, 0.25, 0.0):
            def scaled(t, q_, lows, ups, k, s=scale):
                gap = shipped(t, q_, lows, ups, k)
                return np.where(np.isfinite(gap), gap * s, np.inf)
            S._gap_bounds_at = scaled
            print(f"threshold price x{scale:<4}: {decided_at(a, b, q, alpha)}")
    finally:
        S._gap_bounds_at = shipped
    for gain in (1.05, 1.1, 1.2, 1.5):
        print(f"a head {gain}x the champion on every record: {decided_at(a, a * gain, q, alpha)}")


if __name__ == "__main__":
    main()
