"""Will it fit? A step's memory (measured or estimated) held against a card and its host."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from ..memory.breakdown import MemoryBreakdown
from ..units import format_bytes
from .budgets import host_usable, parse_budget, parse_cards, parse_machine, required, usable

# The category holding most at the peak, in words: "other" alone says nothing.
HELD_BY = {"other": "other (the step's temporaries: attention and MLP scratch, the loss's "
                    "logits, the optimizer step's; on CUDA also cuBLAS workspaces)",
           "optimizer_state": "optimizer state"}

@dataclass(frozen=True)
class FitBadge:
    """Whether a step's memory fits a budget, on the card and (where known) on the host: for
    the panel's badge (no widgets here).

    Attributes:
        need: Bytes the step needs on the card.
        budget: The card's bytes asked about.
        usable: What of them a step may use.
        largest: The category holding most at the peak.
        at_peak: The categories at the peak moment, in bytes.
        host_need: Host bytes the run needs without the undo copy, where predicted.
        host_budget: The host's bytes, where known.
        host_usable: What of them the run may use.
        undo: Host bytes of the undo copy "auto" would keep (dropped where it does not fit).
    """

    need: int  # bytes the step needs
    budget: int
    usable: int
    largest: str | None = None  # the category holding most at the peak
    at_peak: dict = field(default_factory=dict)
    host_need: int | None = None  # host bytes the run needs without the undo copy
    host_budget: int | None = None
    host_usable: int | None = None
    undo: int = 0  # host bytes of the undo copy "auto" would keep (dropped where it does not fit)

    @property
    def fits_card(self) -> bool:
        """The step fits the card's usable bytes."""
        return self.need <= self.usable

    @property
    def fits_host(self) -> bool:
        """The run fits the host (True where the host is not checked)."""
        return self.host_need is None or self.host_usable is None or self.host_need <= self.host_usable

    @property
    def fits(self) -> bool:
        """Fits the card and the host."""
        return self.fits_card and self.fits_host

    @property
    def headroom(self) -> int:
        """Bytes to spare on the card (negative: bytes over)."""
        return self.usable - self.need

    @property
    def binds(self) -> str:
        """"card" or "host": which of the two has the smaller share left (the card alone
        where the host is not checked)."""
        if self.host_need is None or self.host_usable is None:
            return "card"
        card = self.headroom / max(self.usable, 1)
        machine = (self.host_usable - self.host_need) / max(self.host_usable, 1)
        return "host" if machine < card else "card"

    @property
    def text(self) -> str:
        """The badge's words: fits or not, by how much, what holds most."""
        room = format_bytes(self.usable)
        if self.usable != self.budget:
            room += f" usable of {format_bytes(self.budget)}"
        most = (f"; most held by {HELD_BY.get(self.largest, self.largest.replace('_', ' '))}"
                if self.largest else "")
        if self.fits_card:
            card = f"{format_bytes(self.headroom)} to spare of {room}"
        else:
            card = f"{format_bytes(-self.headroom)} over {room}"
        if self.host_need is None or self.host_usable is None:
            return f"{'fits' if self.fits_card else 'does not fit'}: {card}{most}"
        spare = self.host_usable - self.host_need
        host = (f"host {format_bytes(self.host_need)} of {format_bytes(self.host_usable)} usable"
                if spare >= 0 else
                f"host {format_bytes(-spare)} over its {format_bytes(self.host_usable)} usable")
        if spare >= 0 and self.undo and self.undo > spare:
            host += f", no undo copy ({format_bytes(self.undo)} would not fit)"
        if self.fits_card and not self.fits_host:
            return f"does not fit on the host: {host} (the card has {card}){most}"
        used = max(self.need / max(self.usable, 1), self.host_need / max(self.host_usable, 1))
        binding = f"; the {self.binds} is the limit" if self.fits and used >= 0.5 else ""
        return f"{'fits' if self.fits else 'does not fit'}: {card}; {host}{binding}{most}"

    def __str__(self) -> str:
        return self.text


def fit_badge(memory, budget, *, device: str | None = None, reserve: int | None = None,
              margin: float | None = None, host=None) -> FitBadge:
    """Fits or not, headroom and the dominating category of a step, against a budget.

    An estimate (or a bare peak) on CUDA is held against ``usable`` (context and allocator margin
    kept back). A measured CUDA step already shows both: what its allocator reserved and what is
    in use outside it (context included), so nothing is kept back for them. An estimate carries
    its host memory (``HostMemory``), held on CUDA against the host where that is known.

    Args:
        memory: A ``MemoryBreakdown`` (measured or estimated) or a peak in bytes; with several
            cards ("2x RTX 3090") one rank's (``Predictor.of(..., ranks=2)``).
        budget: Anything ``parse_machine`` takes.
        device: "cuda" or "cpu" (default: the breakdown's).
        reserve: Bytes kept back for the CUDA context (see ``usable``).
        margin: The allocator's share kept back (see ``usable``).
        host: The host's memory, a size (default: the card's usual ``HOST_RAM``).

    Returns:
        A ``FitBadge`` (``.fits``, ``.text``, ``.headroom``).
    """
    limit, card_host = parse_machine(parse_cards(budget)[1])
    host_limit = parse_budget(host) if host is not None else card_host
    if isinstance(memory, MemoryBreakdown):
        target = device or memory.device
        measured_cuda = memory.measured and str(memory.device).startswith("cuda")
        if measured_cuda:
            need = max(memory.reserved, getattr(memory, "highest", memory.peak)) + memory.outside
            reserve = 0 if reserve is None else reserve
            margin = 0.0 if margin is None else margin
        else:
            need = required(memory)
        largest = memory.largest_at_peak if (memory.at_peak or memory.peak) else None
        on_host = {}
        if memory.host is not None and host_limit is not None and str(target).startswith("cuda"):
            on_host = dict(host_need=memory.host.without_undo, host_budget=host_limit,
                           host_usable=host_usable(host_limit), undo=memory.host.undo)
        return FitBadge(need, limit, usable(limit, target, reserve, margin), largest,
                        dict(memory.at_peak), **on_host)
    if isinstance(memory, bool) or not isinstance(memory, numbers.Integral) or memory < 0:
        raise TypeError(f"fit_badge: give a MemoryBreakdown or a peak in bytes, got {memory!r}.")
    return FitBadge(int(memory), limit, usable(limit, device or "cuda", reserve, margin))

