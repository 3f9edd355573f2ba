"""What a chat template's work costs, and the budget that pays for it.

``Budget`` is what one compile or render may still do: steps, CPU time, the process's memory
growth, nesting depth, integer sizes, and the size of any one value or of the output.
``Budget.step`` counts work and, after every ~256 steps or one large operation, runs
``Budget.check`` on the steps, CPU time and memory; ``watched`` runs a Python-level filter
given a large input under a profile hook that checks them every 2,048 calls. Going past a
limit is ``TemplateBudgetError`` naming the template's source and the limit (the limits and
their reasons are ``nbtune.files.LIMITS["template_*"]``).

The second half sizes what an operation will build *before* it runs, for those whose result
can outgrow their inputs (repetition, padding, powers, ``replace``, ``join``, ``expandtabs``,
``indent``, format widths, ``tojson(indent=...)``); ``after`` sizes the rest once they have
run. ``nbtune.template.sandbox`` charges these costs from jinja's hooks.
"""
from __future__ import annotations

import os
import re
import sys
import time
import types

from jinja2.utils import Namespace

from ..files import LIMITS, FileRefused, limit

__all__ = ["FILTERS", "FIX", "METHODS", "PLAIN_FILTERS", "PYTHON_FILTERS", "SCALARS",
           "SCANNING_TESTS", "SEQUENCES", "SIZED", "STEP", "WATCH_SIZE", "Budget",
           "TemplateBudgetError", "after", "callee_name", "lipsum_units", "printf_units",
           "size_of", "spec_width", "subject", "text_units", "watched"]


class TemplateBudgetError(FileRefused):
    """A chat template went past one of its limits; the message names its source and the limit."""


FIX = ("No real chat template does this: the template is broken or hostile. Use the model's "
       "original template, or set tokenizer.chat_template to one you trust.")
STEP = 256             # work units one step weighs: a check every CHECK_EVERY / 256 steps
_CHECK_EVERY = 1 << 16  # work units between CPU-time and memory checks
WATCH_SIZE = 1 << 14   # a Python-level filter given an input this large runs under the watchdog
_ITEM = 8              # units one item of a list, tuple or dict counts (a pointer's bytes)
SCALARS = frozenset({int, float, bool, type(None)})
SEQUENCES = (str, bytes, list, tuple)
SIZED = frozenset({str, list, tuple, dict})  # len() is the size of the work, in O(1)


class _Memory:
    """Resident memory of this process in bytes: the current RSS from /proc/self/statm where
    there is one (a few microseconds to read; reopened in a forked child, since /proc/self is
    bound when it is opened), else the peak RSS from getrusage, else 0."""

    def __init__(self):
        self.fd = self.pid = None

    def __call__(self) -> int:
        if self.pid != os.getpid():  # first use, or a forked child: its copy reads the parent
            if self.fd is not None:
                os.close(self.fd)
            self.pid, self.fd = os.getpid(), None
            try:
                self.fd = os.open("/proc/self/statm", os.O_RDONLY)
                self.page = os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, AttributeError):
                pass
        if self.fd is not None:
            return int(os.pread(self.fd, 64, 0).split()[1]) * self.page
        try:
            import resource
        except ImportError:
            return 0
        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


_rss = _Memory()


def _units(value, cap: int) -> int:
    """The size of ``value`` as its text would be: characters, plus _ITEM per item of a
    container, shared parts counted each time they appear (as ``str()`` and ``json`` write
    them). Stops counting once past ``cap``, so it costs at most O(cap)."""
    t = type(value)
    if t is str:
        return len(value)
    if t is int:
        return value.bit_length() // 3 + 1  # its decimal digits, or a few more
    if t in SCALARS:
        return 1
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is str or t is bytes:
            total += len(v) + _ITEM
        elif t is int:
            total += v.bit_length() // 3 + _ITEM
        elif t in SCALARS:
            total += _ITEM
        elif t is dict:
            total += _ITEM * (1 + len(v))
            stack.extend(v.keys())
            stack.extend(v.values())
        elif t is list or t is tuple:
            total += _ITEM * (1 + len(v))
            stack.extend(v)
        elif isinstance(v, (str, bytes, bytearray)):
            total += len(v) + _ITEM
        elif isinstance(v, dict):
            total += _ITEM * (1 + len(v))
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += _ITEM * (1 + len(v))
            stack.extend(v)
        elif isinstance(v, Namespace):
            total += _ITEM
            stack.append(object.__getattribute__(v, "_Namespace__attrs"))
        else:
            total += _ITEM
        if total > cap:
            break
    return total


def _layout_units(value, cap: int, per_level: int) -> int:
    """``_units`` plus ``per_level`` characters per item per level of nesting: what indenting
    JSON or pretty-printing adds."""
    total, stack = 0, [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):  # each item on a line of its own, indented one level deeper
            total += _ITEM + per_level * depth + (_ITEM + per_level * (depth + 1)) * len(v)
            stack.extend((x, depth + 1) for x in v.keys())
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += _ITEM + per_level * depth + (_ITEM + per_level * (depth + 1)) * len(v)
            stack.extend((x, depth + 1) for x in v)
        else:
            total += _units(v, cap)
        if total > cap:
            break
    return total


def _input_units(variables: dict) -> int:
    """``_units`` of a render's variables, quicker for the usual list of flat messages."""
    total = 0
    for value in variables.values():
        if type(value) is list:
            for message in value:
                if type(message) is dict:
                    total += _ITEM * (1 + len(message))
                    for part in message.values():
                        total += len(part) + _ITEM if type(part) is str else _units(part, 1 << 62)
                else:
                    total += _units(message, 1 << 62)
        elif type(value) is str:
            total += len(value)
        elif value is not None and type(value) is not bool:
            total += _units(value, 1 << 62)
    return total


class Budget:
    """What one render (or one compile) may still do, and the checks that enforce it."""

    __slots__ = ("origin", "_cap", "variables", "step_limit", "cpu_limit", "_memory_limit",
                 "depth_limit", "int_limit", "clock", "steps", "work", "next", "depth", "cpu0",
                 "rss0")

    def __init__(self, origin: str | None, cap: int | None, step_limit: float, cpu_limit: float,
                 memory_limit: float, depth_limit: int | None = None,
                 clock: str = "template_render_ms", timed: bool = True, variables=None):
        self.origin, self._cap, self.step_limit = origin, cap, step_limit
        self.variables = variables  # when cap is None: the render's input, which scales it
        self.cpu_limit, self._memory_limit = cpu_limit, memory_limit
        self.depth_limit = limit("template_depth") if depth_limit is None else depth_limit
        self.clock = clock  # the limit the CPU time is held to
        self.int_limit = limit("template_int")
        self.steps = self.work = self.depth = 0
        self.cpu0 = self.rss0 = None
        self.next = _CHECK_EVERY if timed else float("inf")

    @property
    def cap(self) -> int:
        """The most characters (or units, see ``_units``) one value or the output may hold:
        ``template_output``, or 4x the render's input if more. Computed when first needed,
        which a short render never does."""
        if self._cap is None:
            self._cap = max(limit("template_output"), 4 * _input_units(self.variables))
            self.variables = None
        return self._cap

    @property
    def memory_limit(self) -> float:
        return max(self._memory_limit, 16 * self.cap)

    def refuse(self, what: str, name: str, shown: str | None = None) -> "TemplateBudgetError":
        value, why = LIMITS[name]
        return TemplateBudgetError(f"{subject(self.origin)} {what}, past the limit {name} = "
                                   f"{shown or f'{value:,}'} ({why}). {FIX}")

    def step(self, size: int = 0) -> None:
        self.steps += 1
        self.work += size + STEP
        if self.work >= self.next:
            self.check()

    def units(self, value) -> int:
        """``_units(value)``, exact up to the cap; small values (the usual) are walked once
        without working the cap out."""
        n = _units(value, WATCH_SIZE)
        return n if n <= WATCH_SIZE else _units(value, self.cap)

    def sized(self, size: int, what: str = "builds a value") -> int:
        if size > WATCH_SIZE and size > self.cap:
            raise self.refuse(f"{what} of {size:,} characters or more", "template_output",
                              f"{self.cap:,} characters for this conversation")
        return size

    def check(self) -> None:
        """Steps, CPU time and memory so far; the clock and the memory baseline start at the
        first check, which comes after at most ~256 steps or one large operation."""
        self.next = self.work + _CHECK_EVERY
        if self.steps > self.step_limit:
            raise self.refuse(f"takes more than {self.step_limit:,} steps (loop iterations, "
                              "calls, filters and operators)", "template_steps",
                              f"{self.step_limit:,} for this conversation")
        cpu, rss = time.thread_time(), _rss()
        if self.cpu0 is None:
            self.cpu0, self.rss0 = cpu, rss
            return
        if cpu - self.cpu0 > self.cpu_limit:
            raise self.refuse(f"ran for more than {self.cpu_limit:g} s of CPU time", self.clock)
        if rss - self.rss0 > self.memory_limit:
            raise self.refuse(f"grew this process's memory by {(rss - self.rss0) >> 20:,} MiB",
                              "template_memory", f"{self.memory_limit >> 20:,} MiB")

    def integer(self, value, where: str) -> None:
        bound = self.int_limit
        if type(value) is int and not -bound <= value <= bound:
            shown = (f"the integer {value:,}" if value.bit_length() < 64
                     else f"an integer of {value.bit_length():,} bits")
            raise self.refuse(f"passes {shown} to {where}", "template_int")

    def integers(self, args, kwargs, where) -> None:
        """Every int among the arguments of a call or filter within template_int."""
        bound = self.int_limit
        for value in args:
            if type(value) is int and not -bound <= value <= bound:
                self.integer(value, callee_name(where))
        if kwargs:
            for value in kwargs.values():
                if type(value) is int and not -bound <= value <= bound:
                    self.integer(value, callee_name(where))

    def bits(self, bits: int, op: str) -> None:
        if bits > limit("template_int_bits"):
            raise self.refuse(f"computes an integer of about {bits:,} bits with {op}",
                              "template_int_bits")


def subject(origin: str | None) -> str:
    return f"{origin}: the chat template" if origin else "The chat template"


def callee_name(obj) -> str:
    if isinstance(obj, str):
        return obj
    name = getattr(obj, "__name__", None) or type(obj).__name__
    owner = getattr(obj, "__self__", None)
    if owner is None or isinstance(owner, types.ModuleType):
        return name
    return f"{owner.__name__ if isinstance(owner, type) else type(owner).__name__}.{name}"


def watched(budget: Budget, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under a profile hook that runs the budget's checks every few
    thousand calls, for Python-level work a step cannot see into (a filter's own loops)."""
    if sys.getprofile() is not None:  # a profiler or an outer watch is already there
        return fn(*args, **kwargs)
    count = 0

    def hook(frame, event, arg):
        nonlocal count
        count += 1
        if count >= 2048:
            count = 0
            budget.check()

    sys.setprofile(hook)
    try:
        return fn(*args, **kwargs)
    finally:
        sys.setprofile(None)


# ---- sizes an operation will build, known before it runs ---------------------------------

_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.)", re.S)
_DIGITS = re.compile(r"\d+")


def printf_units(budget: Budget, fmt, args) -> int:
    """An upper bound on ``fmt % args``: each conversion writes at most its width and
    precision plus all of ``args``."""
    specs = widths = 0
    bound = limit("template_int")
    for match in _PRINTF.finditer(fmt):
        if match.group(3) == "%" and not match.group(1) and not match.group(2):
            continue
        specs += 1
        for field in (match.group(1), match.group(2)):
            if field == "*":
                values = args if isinstance(args, tuple) else (args,)
                widths += max((abs(v) for v in values if type(v) is int), default=0)
                for v in values:
                    budget.integer(v, "a % format's * width")
            elif field:
                if len(field) > 9 or int(field) > bound:
                    raise budget.refuse(f"formats with the width {field[:20]} in {fmt[:60]!r}",
                                        "template_int")
                widths += int(field)
    if not specs:
        return len(fmt)
    return len(fmt) + widths + specs * budget.units(args)


def spec_width(budget: Budget, spec: str) -> int:
    bound, width = limit("template_int"), 0
    for digits in _DIGITS.findall(spec):
        if len(digits) > 9 or int(digits) > bound:
            raise budget.refuse(f"formats with the width {digits[:20]} in the format spec "
                                f"{spec[:60]!r}", "template_int")
        width += int(digits)
    return width


def _replace_units(s, old, new, count=-1) -> int:
    if not isinstance(s, (str, bytes)) or not isinstance(old, (str, bytes)) \
            or not isinstance(new, (str, bytes)):
        return len(s) if isinstance(s, (str, bytes)) else 0
    hits = (len(s) + 1) if not old else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(0, len(new) - len(old))


def text_units(items, budget: Budget) -> int:
    """The characters ``items`` make when written one after another."""
    total = 0
    for item in items:
        total += len(item) if type(item) is str else budget.units(item)
        if total > WATCH_SIZE and total > budget.cap:
            break
    return total


def _method_join(budget, owner, args, kwargs):
    if len(args) == 1 and not kwargs:
        items = args[0] if type(args[0]) in (list, tuple) else list(args[0])
        return len(owner) * max(0, len(items) - 1) + text_units(items, budget), (items,)
    return 0, args


def _method_replace(budget, owner, args, kwargs):
    count = args[2] if len(args) > 2 else kwargs.get("count", -1)
    return _replace_units(owner, *args[:2], count), args


def _method_expandtabs(budget, owner, args, kwargs):
    size = (args[0] if args else kwargs.get("tabsize", 8))
    size = size if type(size) is int else 8
    tab = "\t" if isinstance(owner, str) else b"\t"
    return len(owner) + owner.count(tab) * max(size, 0), args


def _method_translate(budget, owner, args, kwargs):
    table = args[0] if args else None
    widest = 1
    if isinstance(table, dict):
        widest = max([len(v) if isinstance(v, (str, bytes)) else 1 for v in table.values()] or [1])
    return len(owner) * widest, args


# str / bytes methods whose result can outgrow the string: name -> (budget, s, args, kwargs)
# -> (size bound, args to call with). center/ljust/rjust/zfill grow only by their width,
# which the integer limit bounds.
METHODS = {"join": _method_join, "replace": _method_replace, "expandtabs": _method_expandtabs,
           "translate": _method_translate}


def _filter_indent(budget, value, args, kwargs):
    width = args[0] if args else kwargs.get("width", 4)
    per_line = len(width) if isinstance(width, str) else width if type(width) is int else 4
    text = str(value) if not isinstance(value, str) else value
    return len(text) + (text.count("\n") + 2) * max(per_line, 0), value, args


def _filter_wordwrap(budget, value, args, kwargs):
    wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring")
    extra = len(wrap) if isinstance(wrap, str) else 1
    text = value if isinstance(value, str) else str(value)
    return len(text) * (1 + extra), value, args


def _filter_replace(budget, value, args, kwargs):
    text = value if isinstance(value, str) else str(value)
    old = args[0] if args else kwargs.get("old", "")
    new = args[1] if len(args) > 1 else kwargs.get("new", "")
    count = args[2] if len(args) > 2 else kwargs.get("count")
    return _replace_units(text, str(old), str(new), -1 if count is None else count), value, args


def _filter_join(budget, value, args, kwargs):
    items = value if type(value) in (list, tuple) else list(value)
    sep = args[0] if args else kwargs.get("d", "")
    sep_units = len(sep) if isinstance(sep, str) else budget.units(sep)
    return sep_units * max(0, len(items) - 1) + text_units(items, budget), items, args


def _filter_format(budget, value, args, kwargs):
    return printf_units(budget, str(value), kwargs or args), value, args


def _filter_tojson(budget, value, args, kwargs):
    indent = kwargs.get("indent", args[1] if len(args) > 1 else None)
    per_level = len(indent) if isinstance(indent, str) else indent if type(indent) is int else 0
    seps = kwargs.get("separators", args[2] if len(args) > 2 else None)
    per_item = (sum(len(s) for s in seps if isinstance(s, str))
                if isinstance(seps, (list, tuple)) else 2)
    return _layout_units(value, budget.cap, max(per_level, 0) + per_item), value, args


def _filter_pprint(budget, value, args, kwargs):
    return _layout_units(value, budget.cap, 2), value, args


def _filter_sum(budget, value, args, kwargs):
    start = kwargs.get("start", args[1] if len(args) > 1 else 0)
    if type(start) in SCALARS:
        return 0, value, args
    items = value if type(value) in (list, tuple) else list(value)
    total = budget.units(start) + text_units(items, budget)
    # sum() of lists copies the growing result once per item, in C, where no check can run
    budget.sized(total * max(1, len(items)) // 64, "copies, summing sequences,")
    return total, items, args


def lipsum_units(budget, args, kwargs):
    n = args[0] if args else kwargs.get("n", 5)
    most = args[3] if len(args) > 3 else kwargs.get("max", 100)
    words = (n if type(n) is int else 5) * (most if type(most) is int else 100)
    return budget.sized(12 * max(words, 0), "writes lorem ipsum")


def _filter_urlize(budget, value, args, kwargs):
    text = value if isinstance(value, str) else str(value)
    extra = sum(len(v) for v in list(args[2:4]) + [kwargs.get("target"), kwargs.get("rel")]
                if isinstance(v, str))
    return 2 * len(text) + (len(text) // 3 + 1) * (64 + extra), value, args


# filters whose result can outgrow their input: name -> (budget, value, args, kwargs) ->
# (size bound, value, args) -- value and args possibly made into lists (join, sum), so a
# generator is not consumed twice
FILTERS = {"indent": _filter_indent, "wordwrap": _filter_wordwrap, "replace": _filter_replace,
           "join": _filter_join, "format": _filter_format, "tojson": _filter_tojson,
           "pprint": _filter_pprint, "sum": _filter_sum, "urlize": _filter_urlize}
# filters that loop in Python over their input: watched when the input is large
PYTHON_FILTERS = frozenset({"striptags", "wordwrap", "urlize", "indent", "truncate", "title",
                            "pprint", "xmlattr", "dictsort", "groupby", "sort", "unique", "min",
                            "max", "map", "select", "reject", "selectattr", "rejectattr",
                            "batch", "slice", "wordcount", "urlencode", "tojson", "join",
                            "sum", "list", "items"})


# filters that run in C in time linear in their input (a few ms for the largest value) and
# return at most a few times it, without compounding when chained (lower(lower(s)) is
# lower(s)): left as they are, so the commonest cost nothing. Run on constants at compile
# time, they touch only the template's own text. (title and wordcount loop in Python.)
PLAIN_FILTERS = frozenset({"trim", "lower", "upper", "capitalize", "default", "d", "length",
                           "count", "first", "last", "abs", "int", "float", "round", "safe"})
# tests that scan or stringify their arguments; the others take O(1) and are left as they are
SCANNING_TESTS = frozenset({"lower", "upper", "in", "==", "eq", "equalto", "!=", "ne", ">", "gt",
                            "greaterthan", ">=", "ge", "<", "lt", "lessthan", "<=", "le"})


def size_of(value) -> int:
    return len(value) if type(value) in SIZED else 0


def after(budget: Budget, rv, what: str, callee=None):
    """Size a result that could not be bounded before; at most one value a few times the
    limit lived briefly. ``what`` may name ``{}``, the callee."""
    t = type(rv)
    if t is str:
        n = len(rv)
    elif t in SCALARS:
        return rv
    else:
        n = budget.units(rv) if isinstance(rv, (str, bytes, list, tuple, dict, set, frozenset,
                                                Namespace)) else 0
    if n > WATCH_SIZE:
        budget.sized(n, what.format(callee_name(callee)) if callee is not None else what)
    budget.step(n)
    return rv
