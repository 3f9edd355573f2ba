"""The longest context that fits: ``seq_len`` searched with the estimator, not guessed.

A step's memory is affine in the sequence length once attention is the linear kind (flash
or memory-efficient kernels, no ``[T, T]`` mask): every activation is ``[tokens, ...]``. So
two short estimates give the line, the line gives the answer, and one estimate at the
answer confirms it (the line through it and the one before says one grain more does not
fit). Where memory bends upwards (a mask: packing, a sliding window; temporaries that grow
a little faster) the confirming estimate does not fit, and the search closes the gap
between what fits and what does not to one grain, each guess on the line through the last
two estimates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..memory.breakdown import MemoryBreakdown
from ..models.config import ModelConfig
from ..techniques import Techniques, as_techniques
from ..units import format_bytes
from .budgets import host_usable, parse_budget, parse_cards, parse_machine, required, usable
from .carry import BASE, carried_tiles
from .predictor import Predictor

GRAIN = 256  # answers are whole multiples of this many tokens
FIRST = 2048  # the two lengths the line is drawn through: FIRST and 2 * FIRST
MAX_ESTIMATES = 10


def attention_kernel(config: ModelConfig, t: Techniques, device: str = "cuda",
                     seq_len: int | None = None) -> tuple[str, str | None]:
    """(kernel, why it is not linear or None) that ``scaled_dot_product_attention`` picks for
    training steps of ``t``, by torch's documented rules: plain causal attention has no mask
    (``is_causal``), which CUDA runs with FlashAttention and a CPU with its flash kernel,
    both linear in memory. Packing (a document mask) or a sliding window shorter than the
    sequence passes a boolean ``[B, 1, T, T]`` mask: on CUDA flash refuses masks and the
    memory-efficient kernel runs, and on both devices the mask itself is quadratic."""
    tokens = seq_len or t.seq_len
    window = config.sliding_window
    masked = t.packing or (window is not None and tokens > window)
    if not masked:
        return ("flash", None)
    why = ("packing passes a document mask" if t.packing else
           f"the sliding window ({window} tokens) is shorter than the sequence")
    kernel = "efficient" if str(device).startswith("cuda") else "flash"
    return (kernel, f"{why}: a [batch, 1, {tokens}, {tokens}] mask is built for every step, "
                    "so memory grows with the square of the sequence")


@dataclass(frozen=True)
class LongestContext:
    """What ``longest_context`` found: ``tokens`` (0 where not even ``GRAIN`` fits), the
    limit that stopped it and the estimate at the answer.

    Attributes:
        tokens: The longest length predicted to fit.
        limit: What stopped it: "model" (its max_position_embeddings), "card", "host" or
            "nothing fits".
        memory: The estimate at ``tokens``.
        model_limit: The model's context length.
        device_usable: The card's bytes a step may use.
        host_usable: The host's bytes the run may use, where known.
        kernel: The attention kernel the estimate assumed.
        kernel_note: What that kernel means for the answer, if anything.
        estimates: Estimator runs made.
        tried: Every length tried: (tokens, device bytes, host bytes, fits).
    """

    tokens: int
    limit: str  # "model" (its max_position_embeddings), "card", "host", or "nothing fits"
    memory: MemoryBreakdown | None  # the estimate at ``tokens``
    model_limit: int
    device_usable: int
    host_usable: int | None
    kernel: str
    kernel_note: str | None
    estimates: int
    tried: list = field(default_factory=list)  # (tokens, device bytes, host bytes, fits)

    @property
    def text(self) -> str:
        """The answer in one line, with what limits it."""
        if not self.tokens:
            return (f"longest context that fits: none (not even {GRAIN} tokens; the "
                    f"{self._short_of()} is short)")
        line = f"longest context that fits: {_tokens(self.tokens)} tokens"
        if self.limit == "model":
            line += " (the model's whole context)"
        else:
            line += f" (the {self.limit} is the limit)"
        if self.kernel_note:
            line += f"; {self.kernel_note}"
        return line

    def _short_of(self) -> str:
        return self.limit if self.limit in ("card", "host") else "card"

    def __str__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        import html

        return f"<b>{html.escape(self.text)}</b>"


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def longest_context(model, card="RTX 3090", techniques: Techniques | dict | None = None, *,
                    host=None, device: str = "cuda", batch_size: int | None = None,
                    progress=None) -> LongestContext:
    """The longest ``seq_len`` whose training step the estimator predicts to fit a card.

    A multiple of ``GRAIN``, at most the model's context, fitting the card and, on CUDA, the
    host. Each estimate of an 8B model takes seconds (longer at long sequences with small tiles):
    two short ones draw the line and one at the answer confirms it; where that one does not
    fit, what fits and what does not is closed to one grain (``MAX_ESTIMATES`` at most; then the
    longest seen to fit).

    Args:
        model: What ``estimate`` takes.
        card: Anything ``fit`` takes ("RTX 3090", "24GiB", "RTX 3090 + 64 GB RAM", "2x RTX
            3090": FSDP2 over both, each one's step predicted).
        techniques: A ``Techniques`` or a dict of its fields, kept as they are but ``seq_len``.
        host: The host's memory where the card's usual one is not yours.
        device: "cuda" or "cpu".
        batch_size: Overrides the techniques'.
        progress: Called with the tokens before each estimate.

    Returns:
        A ``LongestContext``: ``.tokens`` and what stops it there.
    """
    cards, machine = parse_cards(card)
    forecaster = Predictor.of(model, device, cards)
    config = forecaster.config
    t = as_techniques(techniques)
    if batch_size:
        t = t.replace(batch_size=batch_size)
    limit, card_host = parse_machine(machine)
    host_limit = parse_budget(host) if host is not None else card_host
    cuda = str(device).startswith("cuda")
    room = usable(limit, device)
    host_room = host_usable(host_limit) if host_limit is not None and cuda else None
    ceiling = config.max_position_embeddings // GRAIN * GRAIN or GRAIN
    tried: list = []

    def measure(tokens: int):
        if progress is not None:
            progress(tokens)
        memory = forecaster.estimate(t.replace(seq_len=tokens))
        on_host = memory.host.without_undo if memory.host is not None and cuda else 0
        fits = required(memory) <= room and (host_room is None or on_host <= host_room)
        tried.append((tokens, required(memory), on_host, fits))
        return memory, fits

    def answer(tokens, memory, why):
        kernel, note = attention_kernel(config, t, device, tokens or GRAIN)
        return LongestContext(tokens, why, memory, config.max_position_embeddings, room,
                              host_room, kernel, note, len(tried), tried)

    lo, lo_memory, hi = 0, None, None  # the longest seen to fit, the shortest seen not to
    binds = "card"  # which room the line reaches first
    guess = _first_length(config, t, ceiling)
    while True:
        memory, fits = measure(guess)
        if fits:
            lo, lo_memory = guess, memory
        else:
            hi = guess
        if lo == ceiling:
            return answer(lo, lo_memory, "model")
        if (hi is not None and hi - lo <= GRAIN) or len(tried) >= MAX_ESTIMATES:
            break
        if len(tried) == 1:  # a second point for the line: twice as long, or the shortest
            guess = min(2 * guess, ceiling) if fits else GRAIN
            if guess == hi:
                break
            continue
        # Where the line through the last two estimates crosses the card's or the host's
        # room, kept strictly between what fits and what does not, so each estimate narrows
        # the gap (within a gap the line may say ``lo``: then one grain more is tried).
        crossing, binds = _on_the_line(tried[-2], tried[-1], room, host_room)
        crossing = crossing // GRAIN * GRAIN
        if hi is None and tried[-2][3] and crossing <= lo:
            # Both fit, and the line through them says one grain more does not: lo is the
            # answer (a line drawn through two fitting points errs long where memory bends
            # upwards, so it does not stop early there; a bracket is closed to the grain).
            break
        guess = min(max(crossing, lo + GRAIN), ceiling)
        if hi is not None:
            guess = min(guess, hi - GRAIN)
    if not lo:
        return answer(0, memory, _binding(tried[-1], room, host_room))
    over = next((p for p in tried if p[0] == hi), None)
    return answer(lo, lo_memory, _binding(over, room, host_room) if over else binds)


def _first_length(config: ModelConfig, t: Techniques, ceiling: int) -> int:
    """The first length estimated (the second is twice as long). Tiled: ``BASE`` tiles, so
    the line is drawn through ``BASE`` and ``2 * BASE`` tiles (below ``BASE`` tiles memory
    follows another line: one tile holds all of the MLP's temporaries), and every whole
    number of tiles from ``BASE`` on is carried from two short runs (``carry``)."""
    tile = t.tile_tokens
    if tile and 2 * BASE * tile <= ceiling and carried_tiles(config, t, 2 * BASE * tile):
        return BASE * tile
    return min(FIRST, ceiling)


def _on_the_line(a, b, room: int, host_room: int | None) -> tuple[int, str]:
    """(length, "card" or "host"): where the line through estimates ``a`` and ``b``
    (tokens, device bytes, host bytes) first reaches the device room or the host room."""
    span = b[0] - a[0]
    best, which = 1 << 40, "card"
    for i, name, limit in ((1, "card", room), (2, "host", host_room)):
        if limit is None:
            continue
        slope = (b[i] - a[i]) / span if span else 0
        if slope <= 0:
            continue
        at = b[0] + (limit - b[i]) / slope
        if at < best:
            best, which = at, name
    return int(best), which


def _binding(point, room: int, host_room: int | None) -> str:
    """"card" or "host": which limit the estimate ``point`` broke (the card where both)."""
    if point is None:
        return "card"
    _, need, on_host, _ = point
    if need > room:
        return "card"
    return "host" if host_room is not None and on_host > host_room else "card"


def describe_tried(result: LongestContext) -> str:
    """One line per estimate: tokens, device and host bytes, fits or not."""
    return "\n".join(f"{tokens:>8,} tokens: {format_bytes(need)} on the card, "
                     f"{format_bytes(on_host)} on the host: {'fits' if fits else 'does not fit'}"
                     for tokens, need, on_host, fits in result.tried)
