"""A tiled step carried to any number of tiles from two short recorded ones.

With sequence tiling every tile of a layer runs the same ops on tensors of the same shape,
and everything else in the step is ``[tokens, ...]`` (attention without a mask), so at each
moment of a step the bytes held are affine in the number of tiles ``n``. The estimator
records every moment of a step at ``BASE`` and ``BASE + 1`` tiles, apart per tile (the
tracker's ``Recorder``, told where each tile begins), draws each moment's line through the
two and reads the lines at ``n``: the step traced at ``n`` tiles, to the byte, for the cost
of the two short ones (an 8B model's longest context in seconds rather than a minute: one
trace per tile was what made it slow).

A segment's stretches (before its first tile, then from each tile's start to the next)
come in runs of like ones: a pass over the tiles is one such run, one stretch longer in
the longer run. Within it tile ``i``'s moments lie on a line in ``i`` too (checked on the
longer run), so its first and last stretch are kept and the ones between, which never hold
the most, are left out, as with the layers of a deep model (``estimator._slots``). Each
condition is checked on the recordings (the same stretches in both, the tiles between on
their line, both runs given back exactly); where one fails the step is traced at ``n``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..activations import MIN_BYTES
from ..loss import loss_pieces
from ..memory.tracker import TOTAL_KEY, Segment
from ..models.config import ModelConfig
from ..techniques import Techniques

BASE = 3  # the recorded runs have BASE and BASE + 1 tiles (first, second and last apart)


def carried_tiles(config: ModelConfig, t: Techniques, tokens: int) -> tuple[int, bool] | None:
    """(tiles, whether the loss runs one piece per tile) where a step of ``tokens`` is carried
    from ``BASE`` and ``BASE + 1`` tiles (or is one of them), else None: whole tiles, at
    least ``BASE`` of them, no mask (no packing, no window shorter than the sequence), no
    held-out evaluation, loss pieces that are one per tile in all three runs or the same
    whole pieces, and with offloading every ``[batch, tokens, ...]`` tensor above the size
    offloaded (``activations.MIN_BYTES``) at ``BASE`` tiles, as it then is at any length."""
    tile = t.tile_tokens
    if not tile or tokens % tile or t.packing or t.eval_every:
        return None
    if t.activation_offloading and t.batch_size * BASE * tile < MIN_BYTES:
        return None  # a saved [batch, tokens, ...] tensor could cross the size offloaded
    n = tokens // tile
    window = config.sliding_window
    if n < BASE or (window is not None and window < tokens):
        return None
    runs = (BASE, BASE + 1, n)
    pieces = [loss_pieces(k * tile, t.chunked_loss, tile) for k in runs]
    if pieces == list(runs):
        return n, True
    if len(set(pieces)) == 1 and tile % pieces[0] == 0:
        return n, False
    return None


class Lines:
    """Each segment's moments as lines in the tile count, from runs of ``BASE`` and
    ``BASE + 1`` tiles: ``peaks``, the (value at BASE, per tile) of the snapshots that can be
    the segment's first most-held moment, in order; ``highs``, those of each reference
    type's bytes."""

    def __init__(self, peak_keys: tuple, segments: dict) -> None:
        self.peak_keys, self.segments = peak_keys, segments

    def at(self, n: int) -> dict:
        """The segments (``tracker.Segment``) of the step at ``n`` tiles, in order."""
        d, total = n - BASE, self.peak_keys.index(TOTAL_KEY)
        out = {}
        for key, (peaks, highs) in self.segments.items():
            best, peak = 0, None
            for a, b in peaks:
                held = a[total] + b[total] * d
                if held > best:  # the first moment holding the most, as the tracker keeps
                    best, peak = held, (a, b)
            snapshot = ({} if peak is None else
                        {k: x + y * d for k, x, y in zip(self.peak_keys, *peak)})
            high = {k: max((a + b * d for a, b in pairs), default=0) for k, pairs in highs.items()}
            out[key] = Segment(peak=snapshot, highs={k: v for k, v in high.items() if v > 0})
        return out


def lines(low, high) -> Lines | None:
    """``Lines`` from the recordings (``CpuStepMemory.recorded``) of the same step at
    ``BASE`` and ``BASE + 1`` tiles with their segments; None where a condition fails."""
    (moments_lo, keys, tiles_lo), segments_lo = low
    (moments_hi, keys_hi, tiles_hi), segments_hi = high
    if keys != keys_hi or list(segments_lo) != list(segments_hi):
        return None
    out = {}
    for key in segments_hi:
        total = keys.index(TOTAL_KEY)
        lo = [moments_lo.get((key, i), _EMPTY) for i in range(tiles_lo.get(key, 0) + 1)]
        hi = [moments_hi.get((key, i), _EMPTY) for i in range(tiles_hi.get(key, 0) + 1)]
        pairs = _pairs(lo, hi)
        lined = None if pairs is None else _lined(pairs, total)
        if lined is None:
            return None
        out[key] = lined
    result = Lines(keys, out)
    if result.at(BASE) != segments_lo or result.at(BASE + 1) != segments_hi:
        return None  # the lines must give back both runs
    return result


def _pairs(lo: list, hi: list) -> list | None:
    """The stretches of one segment (before its first tile, then from each tile on) that
    line up in the two runs, as (low run's, high run's) moments. Stretches come in runs
    of like ones (the same ops: a pass over the tiles, or all but one of them); a run one
    longer in the high run is a pass: its first and its last line up, and the ones between
    must lie on the line from one to the next."""
    runs_lo, runs_hi = _runs(lo), _runs(hi)
    if [r[0] for r in runs_lo] != [r[0] for r in runs_hi]:
        return None
    pairs = []
    for (_, a), (_, b) in zip(runs_lo, runs_hi):
        if len(b) == len(a):
            pairs += zip(a, b)
        elif len(b) == len(a) + 1:
            if any(not _between(*b[i:i + 3]) for i in range(len(b) - 2)):
                return None
            pairs += [(a[0], b[0]), (a[-1], b[-1])]
        else:
            return None
    return pairs


def _runs(stretches: list) -> list:
    """Consecutive stretches with the same ops, as (signature, [stretches])."""
    runs: list = []
    for moments in stretches:
        sign = (len(moments[0]), tuple(sorted((str(k), len(v)) for k, v in moments[1].items())))
        if runs and runs[-1][0] == sign:
            runs[-1][1].append(moments)
        else:
            runs.append((sign, [moments]))
    return runs


_EMPTY = (), {}


def _lined(pairs: list, total: int):
    """(peaks, highs) of one segment: each recorded moment of the ``pairs`` of stretches as
    (value at BASE tiles, per tile), less those an earlier one holds at least as much as at
    every tile count (they are never the first most-held)."""
    peaks: list = []
    highs: dict = {}
    for (a_peaks, a_values), (b_peaks, b_values) in pairs:
        for a, b in zip(a_peaks, b_peaks):
            line = (a, tuple(y - x for x, y in zip(a, b)))
            if not any(p[0][total] >= a[total] and p[1][total] >= line[1][total] for p in peaks):
                peaks.append(line)
        for name, xs in a_values.items():
            kept = highs.setdefault(name, [])
            for x, y in zip(xs, b_values[name]):
                if not any(k[0] >= x and k[1] >= y - x for k in kept):
                    kept.append((x, y - x))
    return peaks, highs


def _shape(values: dict) -> dict:
    return {name: len(xs) for name, xs in values.items()}


def _between(second, middle, last) -> bool:
    """Whether each moment of the ``middle`` tile is on the line from the ``second`` tile's
    to the ``last`` tile's (in one run: tile i's moments are affine in i)."""
    if not len(second[0]) == len(middle[0]) == len(last[0]):
        return False
    if not _shape(second[1]) == _shape(middle[1]) == _shape(last[1]):
        return False
    for s, m, e in zip(second[0], middle[0], last[0]):
        if any(2 * y != x + z for x, y, z in zip(s, m, e)):
            return False
    return all(2 * y == x + z for name in middle[1]
               for x, y, z in zip(second[1][name], middle[1][name], last[1][name]))


class TraceCache:
    """The ``Lines`` of recent tiled steps (a ``Predictor``'s), by what was recorded: a
    longest-context search asks for many lengths of one step."""

    SIZE = 8

    def __init__(self) -> None:
        self._lines: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            if key in self._lines:
                self._lines.move_to_end(key)
                return self._lines[key]
        return None

    def put(self, key, value) -> None:
        with self._lock:
            self._lines[key] = value
            while len(self._lines) > self.SIZE:
                self._lines.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._lines.clear()
