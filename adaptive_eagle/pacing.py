"""Pacing background work so that it never takes more than a share of a core while requests decode.

Owns: `Pacer`, a duty-cycle limiter for work done in small units off the decode path (a hot swap's
checksum, checks and dtype conversions). Must not touch: what the work is.

Why. A hot swap's preparation is ~100 ms of CPU for a SmolLM2 head. Done in one go while a request
decodes on the same cores, it lands inside one or two decode steps and stretches them by tens of
milliseconds. Cut into units of about a millisecond with pauses between them, the same work spreads
over several steps, each of which loses at most `share` of one core. Where nothing decodes the swap
just takes 1 / share times longer (a few hundred ms), which no caller waits on.
"""

from __future__ import annotations

import time
from typing import Callable


class Pacer:
    """Call `tick()` after each unit of work: it sleeps so that, since the previous tick, work took at most
    `share` of the wall time. share 1.0 never sleeps. `clock` and `sleep` are the wall clock and the pause
    (seconds); tests pass a simulated pair, so what they check does not depend on the machine's load."""

    def __init__(self, share: float = 1.0, max_pause_s: float = 0.05,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.share, self.max_pause_s = share, max_pause_s
        self._clock, self._sleep = clock, sleep
        self.worked_s = self.paused_s = 0.0
        self._last = clock()

    def tick(self) -> None:
        now = self._clock()
        work, self._last = now - self._last, now
        self.worked_s += work
        if self.share >= 1.0:
            return
        pause = min(self.max_pause_s, work * (1.0 - self.share) / self.share)
        if pause > 0:
            self._sleep(pause)
            self.paused_s += pause
        self._last = self._clock()


def tick(pace: Pacer | None) -> None:
    """pace.tick(), or nothing for unpaced work."""
    if pace is not None:
        pace.tick()


__all__ = ["Pacer", "tick"]
