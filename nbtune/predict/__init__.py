"""Prediction: what a step will hold, before anything is loaded, and what follows from it.

One home for every question answered with the estimator (fake tensors, no weights):

* ``estimator.py``: the estimator itself, a training step run on fake tensors;
* ``predictor.py``: one ``Predictor`` per model shape and device, whose locked cache every
  caller below shares;
* ``tables.py`` (cards, host memory, speed costs: data with sources), ``budgets.py`` (sizes
  and what of a card a step may hold), ``costs.py`` (the speed cost model);
* ``space.py``: the toggle combinations ``fit`` may try and the single moves the
  out-of-memory advice offers (``advice.py``), from the same options;
* ``search.py`` (``fit``), ``badge.py`` (``fit_badge``), ``longest.py`` (``longest_context``).

``nbtune.memory`` only measures; nothing here trains.
"""

from .badge import FitBadge, fit_badge
from .budgets import host_usable, parse_budget, parse_machine, required, usable
from .costs import cost_terms, relative_cost
from .estimator import estimate, resolve_config
from .longest import LongestContext, attention_kernel, longest_context
from .predictor import Predictor, clear_cache
from .search import APPLY_IN_CODE, FitResult, FitRow, fit
from .space import PLACEMENT_FIELDS, keeps_maths, search_space, single_moves
from .tables import CARDS, HOST_RAM

__all__ = ["APPLY_IN_CODE", "CARDS", "FitBadge", "FitResult", "FitRow", "HOST_RAM", "LongestContext",
           "PLACEMENT_FIELDS", "Predictor", "attention_kernel", "clear_cache", "cost_terms",
           "estimate", "fit", "fit_badge", "host_usable", "keeps_maths", "longest_context",
           "parse_budget", "parse_machine", "relative_cost", "required",
           "resolve_config", "search_space", "single_moves", "usable"]
