"""How a generated reply is scored against the reference answer in ``Session.evaluate``."""

from __future__ import annotations

import json
from typing import Callable

Match = Callable[[str, str], bool]


def exact(reply: str, reference: str) -> bool:
    """The reply is the reference, up to surrounding whitespace."""
    return reply.strip() == reference.strip()


def same_json_keys(reply: str, reference: str) -> bool:
    """The reply is one JSON object with exactly the reference object's keys (values may differ):
    the answer follows the schema, whatever the model knows."""
    try:
        got, want = json.loads(reply), json.loads(reference)
    except json.JSONDecodeError:
        return False
    return isinstance(got, dict) and isinstance(want, dict) and set(got) == set(want)


MATCHES: dict[str, Match] = {"exact": exact, "json_keys": same_json_keys}


def resolve_match(match: str | Match) -> Match:
    if callable(match):
        return match
    if match not in MATCHES:
        raise ValueError(f"match={match!r} is not one of {', '.join(map(repr, MATCHES))}; or pass "
                         "a function (reply, reference) -> bool.")
    return MATCHES[match]
