"""What a pull costs this worker, as measured: a fixed part (the two calls, the holder's engine
finishing its current step before it pins, the adoption) and a part per block (the copy). The
router estimates a pull of n blocks as `overhead_s + n / blocks_per_s` (router/placement/reuse.py):
one rate alone, measured on small pulls, would charge every block their fixed cost and make
large pulls look slower than computing.

An exponentially forgetting least-squares line through (blocks, seconds) of the recent pulls.
While no slope can be fitted (every pull the same size, or larger ones no slower) the fixed
part is the mean pull time and the rate is unmeasured (0: the router's default rate prices the
blocks) — measured here, a pull's time is mostly its fixed part (docs/benchmarks/kvtransfer.md,
"Peer pull": 8.1 ms for 31 blocks, 10.8 ms for 127).
"""

from __future__ import annotations

from dataclasses import dataclass

_KEEP = 0.8  # weight of the past at each new pull (~ the last 5 pulls count)


@dataclass(slots=True)
class PullCost:
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    overhead_s: float = 0.0
    """Seconds a pull takes whatever its size (0 until a pull completed)."""
    blocks_per_s: float = 0.0
    """Blocks per second beyond the fixed part (0 until pulls of different sizes give a
    slope)."""

    def observe(self, blocks: int, seconds: float) -> None:
        k = _KEEP
        self._w = k * self._w + 1
        self._x = k * self._x + blocks
        self._y = k * self._y + seconds
        self._xx = k * self._xx + blocks * blocks
        self._xy = k * self._xy + blocks * seconds
        spread = self._w * self._xx - self._x * self._x
        slope = (
            (self._w * self._xy - self._x * self._y) / spread if spread > 1e-9 * self._xx else 0.0
        )
        if slope > 0:
            intercept = (self._y - slope * self._x) / self._w
            if intercept < 0:  # the line through the origin instead: all of it per block
                intercept, slope = 0.0, self._y / self._x
            self.overhead_s, self.blocks_per_s = intercept, 1.0 / slope
        else:
            self.overhead_s, self.blocks_per_s = self._y / self._w, 0.0
