"""Chat templates are code from strangers: compiled and rendered within a budget.

jinja2's sandbox stops a template reaching Python's internals, but not running for hours or
building gigabytes: ``{{ 'a' * 10**10 }}`` (folded while compiling), ``9**(9**9)``,
``'%999999999s' % 'a'``, ``'a'.center(10**9)``, nested ``range`` loops, a string doubled forty
times, a macro that calls itself twice. Here every way a template does work passes a check,
and going past a limit is ``TemplateBudgetError`` naming the template's source and the limit
(the limits and their reasons are ``nbtune.files.LIMITS["template_*"]``):

- compile: the source's size, the CPU time of parsing and code generation (checked every
  1,024 tokens and syntax nodes) and the size of the Python handed to ``compile()``, a
  single call nothing can interrupt. ``* ** % +`` are intercepted, so jinja never folds them
  at compile time, and every filter takes the context, so none runs at compile time.
- render: ``+ * ** %``, calls, filters, tests, ``~``, ``in``, slices, list/tuple/dict
  literals, loop iterations and output count steps and the size of what they build.
  Operations whose result can outgrow their inputs (repetition, padding, powers,
  ``replace``, ``join``, ``expandtabs``, ``indent``, format widths, ``tojson(indent=...)``)
  are sized *before* they run; the rest are sized after, which lets at most one short-lived
  value a few times the limit exist. After every ~256 steps and every large operation the
  render's CPU time and the process's memory growth are checked; a Python-level filter
  given a large input runs under a profile hook that checks them every 2,048 calls. So no
  single step runs long or builds much, and the checks between steps bound the total.

Rendered text is exactly what the unbudgeted environment renders (transformers' settings).
Rendering costs ~1.25x the unbudgeted time for SmolLM2's template, 1.3-1.5x for Llama 3,
Qwen and Mistral-style ones; compiling ~2x (milliseconds, once per tokenizer).
"""
from __future__ import annotations

import contextvars
import json
import os
import re
import sys
import time
import types
from datetime import datetime
from functools import update_wrapper

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, operators, optimizeconst
from jinja2.sandbox import (ImmutableSandboxedEnvironment, SandboxedEscapeFormatter,
                            SandboxedFormatter)
from jinja2.utils import Namespace, pass_context
from markupsafe import Markup

from ..files import LIMITS, FileRefused, limit

__all__ = ["ChatTemplate", "TemplateBudgetError", "compile_chat_template"]


class TemplateBudgetError(FileRefused):
    """A chat template went past one of its limits; the message names its source and the limit."""


_FIX = ("No real chat template does this: the template is broken or hostile. Use the model's "
        "original template, or set tokenizer.chat_template to one you trust.")
_STEP = 256            # work units one step weighs: a check every CHECK_EVERY / 256 steps
_CHECK_EVERY = 1 << 16  # work units between CPU-time and memory checks
_WATCH_SIZE = 1 << 14  # a Python-level filter given an input this large runs under the watchdog
_ITEM = 8              # units one item of a list, tuple or dict counts (a pointer's bytes)
_SCALARS = frozenset({int, float, bool, type(None)})
_SEQUENCES = (str, bytes, list, tuple)
_SIZED = frozenset({str, list, tuple, dict})  # len() is the size of the work, in O(1)


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
    if t in _SCALARS:
        return 1
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is str or t is bytes:
            total += len(v) + _ITEM
        elif t is int:
            total += v.bit_length() // 3 + _ITEM
        elif t in _SCALARS:
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


class _Budget:
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
        return TemplateBudgetError(f"{_subject(self.origin)} {what}, past the limit {name} = "
                                   f"{shown or f'{value:,}'} ({why}). {_FIX}")

    def step(self, size: int = 0) -> None:
        self.steps += 1
        self.work += size + _STEP
        if self.work >= self.next:
            self.check()

    def units(self, value) -> int:
        """``_units(value)``, exact up to the cap; small values (the usual) are walked once
        without working the cap out."""
        n = _units(value, _WATCH_SIZE)
        return n if n <= _WATCH_SIZE else _units(value, self.cap)

    def sized(self, size: int, what: str = "builds a value") -> int:
        if size > _WATCH_SIZE and size > self.cap:
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
                self.integer(value, _name(where))
        if kwargs:
            for value in kwargs.values():
                if type(value) is int and not -bound <= value <= bound:
                    self.integer(value, _name(where))

    def bits(self, bits: int, op: str) -> None:
        if bits > limit("template_int_bits"):
            raise self.refuse(f"computes an integer of about {bits:,} bits with {op}",
                              "template_int_bits")


def _subject(origin: str | None) -> str:
    return f"{origin}: the chat template" if origin else "The chat template"


def _name(obj) -> str:
    if isinstance(obj, str):
        return obj
    name = getattr(obj, "__name__", None) or type(obj).__name__
    owner = getattr(obj, "__self__", None)
    if owner is None or isinstance(owner, types.ModuleType):
        return name
    return f"{owner.__name__ if isinstance(owner, type) else type(owner).__name__}.{name}"


_ACTIVE: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("nbtune_template_budget",
                                                                        default=None)


def _watched(budget: _Budget, fn, *args, **kwargs):
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


def _printf_units(budget: _Budget, fmt, args) -> int:
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


def _spec_width(budget: _Budget, spec: str) -> int:
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


def _text_units(items, budget: _Budget) -> int:
    """The characters ``items`` make when written one after another."""
    total = 0
    for item in items:
        total += len(item) if type(item) is str else budget.units(item)
        if total > _WATCH_SIZE and total > budget.cap:
            break
    return total


def _method_join(budget, owner, args, kwargs):
    if len(args) == 1 and not kwargs:
        items = args[0] if type(args[0]) in (list, tuple) else list(args[0])
        return len(owner) * max(0, len(items) - 1) + _text_units(items, budget), (items,)
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
_METHODS = {"join": _method_join, "replace": _method_replace, "expandtabs": _method_expandtabs,
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
    return sep_units * max(0, len(items) - 1) + _text_units(items, budget), items, args


def _filter_format(budget, value, args, kwargs):
    return _printf_units(budget, str(value), kwargs or args), value, args


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
    if type(start) in _SCALARS:
        return 0, value, args
    items = value if type(value) in (list, tuple) else list(value)
    total = budget.units(start) + _text_units(items, budget)
    # sum() of lists copies the growing result once per item, in C, where no check can run
    budget.sized(total * max(1, len(items)) // 64, "copies, summing sequences,")
    return total, items, args


def _lipsum_units(budget, args, kwargs):
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
_FILTERS = {"indent": _filter_indent, "wordwrap": _filter_wordwrap, "replace": _filter_replace,
            "join": _filter_join, "format": _filter_format, "tojson": _filter_tojson,
            "pprint": _filter_pprint, "sum": _filter_sum, "urlize": _filter_urlize}
# filters that loop in Python over their input: watched when the input is large
_PYTHON_FILTERS = frozenset({"striptags", "wordwrap", "urlize", "indent", "truncate", "title",
                             "pprint", "xmlattr", "dictsort", "groupby", "sort", "unique", "min",
                             "max", "map", "select", "reject", "selectattr", "rejectattr",
                             "batch", "slice", "wordcount", "urlencode", "tojson", "join",
                             "sum", "list", "items"})


# filters that run in C in time linear in their input (a few ms for the largest value) and
# return at most a few times it, without compounding when chained (lower(lower(s)) is
# lower(s)): left as they are, so the commonest cost nothing. Run on constants at compile
# time, they touch only the template's own text. (title and wordcount loop in Python.)
_PLAIN_FILTERS = frozenset({"trim", "lower", "upper", "capitalize", "default", "d", "length",
                            "count", "first", "last", "abs", "int", "float", "round", "safe"})
# tests that scan or stringify their arguments; the others take O(1) and are left as they are
_SCANNING_TESTS = frozenset({"lower", "upper", "in", "==", "eq", "equalto", "!=", "ne", ">", "gt",
                             "greaterthan", ">=", "ge", "<", "lt", "lessthan", "<=", "le"})


def _size_of(value) -> int:
    return len(value) if type(value) in _SIZED else 0


def _after(budget: _Budget, rv, what: str, callee=None):
    """Size a result that could not be bounded before; at most one value a few times the
    limit lived briefly. ``what`` may name ``{}``, the callee."""
    t = type(rv)
    if t is str:
        n = len(rv)
    elif t in _SCALARS:
        return rv
    else:
        n = budget.units(rv) if isinstance(rv, (str, bytes, list, tuple, dict, set, frozenset,
                                                Namespace)) else 0
    if n > _WATCH_SIZE:
        budget.sized(n, what.format(_name(callee)) if callee is not None else what)
    budget.step(n)
    return rv


def _pass_arg(func) -> str | None:
    arg = getattr(func, "jinja_pass_arg", None)
    return getattr(arg, "name", None)


def _budgeted_filter(name: str, func):
    how = _pass_arg(func)
    first = {"context": lambda context: context, "eval_context": lambda context: context.eval_ctx,
             "environment": lambda context: context.environment}.get(how)
    estimate = _FILTERS.get(name)
    python = name in _PYTHON_FILTERS
    what, where = f"builds, with the filter {name!r}, a value", f"the filter {name!r}"

    @pass_context  # also keeps jinja from running the filter at compile time
    def budgeted(context, value, *args, **kwargs):
        budget = _ACTIVE.get() or context.environment.idle
        if args or kwargs:
            budget.integers(args, kwargs, where)
        if estimate is not None:
            size, value, args = estimate(budget, value, args, kwargs)
            budget.sized(size, what)
        n = len(value) if type(value) in _SIZED else 0
        budget.steps += 1
        budget.work += n + _STEP
        if budget.work >= budget.next:
            budget.check()
        if first is not None:
            args = (first(context), value, *args)
        else:
            args = (value, *args)
        if python and n >= _WATCH_SIZE:
            rv = _watched(budget, func, *args, **kwargs)
        else:
            rv = func(*args, **kwargs)
        if type(rv) is str and len(rv) < _WATCH_SIZE:  # the usual case: nothing to size
            return rv
        return _after(budget, rv, what)

    return budgeted


def _budgeted_test(name: str, func):
    how = _pass_arg(func)
    skip = 0 if how is None else 1

    def budgeted(*args, **kwargs):
        # weighed by what it may scan (``is in``, ``is lower`` makes a str()); most take O(1)
        for value in args[skip:]:
            if type(value) in _SIZED and len(value) > _STEP:
                budget = _ACTIVE.get()
                if budget is not None:
                    budget.step(len(value))
        return func(*args, **kwargs)

    if how is not None:
        budgeted.jinja_pass_arg = func.jinja_pass_arg
    return update_wrapper(budgeted, func)


class _BudgetedFormatter(SandboxedFormatter):
    """``str.format`` with each field's width checked and the text written so far sized."""

    def __init__(self, env, **kwargs):
        super().__init__(env, **kwargs)
        self.written = 0

    def format_field(self, value, format_spec):
        budget = _ACTIVE.get() or self._env.idle
        width = _spec_width(budget, format_spec) if format_spec else 0
        size = len(value) if type(value) is str else budget.units(value)
        budget.sized(self.written + width + size, "formats a string")
        text = super().format_field(value, format_spec)
        self.written += len(text)
        budget.step(len(text))
        return text


class _BudgetedEscapeFormatter(_BudgetedFormatter, SandboxedEscapeFormatter):
    pass


class _CompileClock(jinja2.ext.Extension):
    """Runs the compile budget's checks every 1,024 tokens the parser takes (the code
    generator does the same per node): a profile hook would double the compile time."""

    def filter_stream(self, stream):
        budget = _ACTIVE_COMPILE.get(None)
        return stream if budget is None else _clocked(budget, stream)


def _clocked(budget: _Budget, items):
    for count, item in enumerate(items):
        if not count & 1023:
            budget.check()
        yield item


class _Generator(CodeGenerator):
    """jinja's code generator, with every loop counted and ``~``, slices and list, tuple and
    dict literals sized (none of them passes through the sandbox's hooks), and the compile
    budget checked every 1,024 nodes."""

    visits = 0

    def visit(self, node, *args, **kwargs):
        self.visits += 1
        if not self.visits & 1023:
            budget = _ACTIVE_COMPILE.get(None)
            if budget is not None:
                budget.check()
        return super().visit(node, *args, **kwargs)

    def visit_Template(self, node, frame=None):
        for loop in node.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, _LOOP, [], [], None, None, lineno=loop.iter.lineno)
        return super().visit_Template(node, frame)

    @optimizeconst
    def visit_Concat(self, node, frame):
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            join = "markup_join"
        else:
            join = "str_join"
        self.write(f"environment.budget_join({join}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    @optimizeconst
    def visit_Add(self, node, frame):
        # a + b + c, the commonest operation in chat templates: one call for the whole chain
        operands = []
        while isinstance(node, nodes.Add):
            operands.append(node.right)
            node = node.left
        operands.append(node)
        self.write("environment.budget_add(")
        for index, operand in enumerate(reversed(operands)):
            self.write(", " if index else "")
            self.visit(operand, frame)
        self.write(")")

    def visit_Operand(self, node, frame):
        # ``x in s`` scans s: weighed like a call on s
        if node.op not in ("in", "notin"):
            return super().visit_Operand(node, frame)
        self.write(f" {operators[node.op]} environment.budget_weigh(")
        self.visit(node.expr, frame)
        self.write(")")

    def visit_Getitem(self, node, frame):
        if not isinstance(node.arg, nodes.Slice):
            return super().visit_Getitem(node, frame)
        self.write("environment.budget_weigh(")  # a slice is no larger than what it slices
        super().visit_Getitem(node, frame)
        self.write(")")

    def _sized_literal(visit):  # noqa: N805 -- a decorator used in the class body
        def sized(self, node, frame):
            if getattr(node, "ctx", "load") != "load":
                return visit(self, node, frame)
            self.write("environment.budget_sized(")
            visit(self, node, frame)
            self.write(")")
        return sized

    visit_List = _sized_literal(CodeGenerator.visit_List)
    visit_Tuple = _sized_literal(CodeGenerator.visit_Tuple)
    visit_Dict = _sized_literal(CodeGenerator.visit_Dict)
    del _sized_literal


_LOOP = "nbtune loop"  # not a name a template can write


@pass_context
def _counted_loop(context, iterable):
    """A for loop's iterable: a short list (the usual case) is counted at once and left as it
    is; anything else is counted item by item."""
    budget = _ACTIVE.get() or context.environment.idle
    if type(iterable) in (list, tuple, dict, str, range) and len(iterable) <= 256:
        budget.steps += len(iterable)
        budget.work += _STEP * len(iterable)
        if budget.work >= budget.next:
            budget.check()
        return iterable
    return _counted(budget, iterable)


def _counted(budget: _Budget, iterable):
    for item in iterable:
        budget.steps += 1
        budget.work += _STEP
        if budget.work >= budget.next:
            budget.check()
        yield item


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment, budgeted."""

    # intercepted: never folded at compile time, and sized at run time
    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _Generator

    def __init__(self, origin: str | None):
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[jinja2.ext.loopcontrols, _CompileClock],
                         finalize=self.budget_finalize)
        self.origin = origin
        # constant folding at compile time and direct use of the jinja template: sizes only
        self.idle = _Budget(origin, limit("template_output"), float("inf"), float("inf"),
                            float("inf"), depth_limit=limit("template_depth"), timed=False)

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        def strftime_now(format):
            budget = _ACTIVE.get() or self.idle
            budget.sized(16 * len(str(format)), "formats a date")
            return datetime.now().strftime(format)

        lipsum = self.globals["lipsum"]

        def budgeted_lipsum(*args, **kwargs):
            _lipsum_units(_ACTIVE.get() or self.idle, args, kwargs)
            return lipsum(*args, **kwargs)

        # tojson replaced because jinja's escapes HTML characters, which transformers' does not
        self.filters["tojson"] = tojson
        self.globals["raise_exception"] = raise_exception
        self.globals["strftime_now"] = strftime_now
        self.globals["lipsum"] = update_wrapper(budgeted_lipsum, lipsum)
        self.filters = {name: func if name in _PLAIN_FILTERS else _budgeted_filter(name, func)
                        for name, func in self.filters.items()}
        self.filters[_LOOP] = _counted_loop
        self.tests = {name: _budgeted_test(name, func) if name in _SCANNING_TESTS else func
                      for name, func in self.tests.items()}

    # -- compile: the Python source jinja generated, before compile() (one C call) gets it
    def _compile(self, source: str, filename: str):
        budget = _ACTIVE_COMPILE.get(None)
        if budget is not None and len(source) > limit("template_code_bytes"):
            raise budget.refuse(f"compiles to {len(source):,} characters of Python",
                                "template_code_bytes")
        return super()._compile(source, filename)

    # -- render hooks
    def budget_add(self, *operands):
        """``a + b + c ...``, added left to right; plain strings that stay short (the usual
        case) are joined at once and need no budget."""
        for operand in operands:
            if type(operand) is not str:
                break
        else:
            if sum(map(len, operands)) < _WATCH_SIZE:
                return "".join(operands)
        total = operands[0]
        for operand in operands[1:]:
            total = self.call_binop(None, "+", total, operand)
        return total

    def call_binop(self, context, operator, left, right):
        budget = _ACTIVE.get() or self.idle
        if operator == "+":
            if type(left) is str and type(right) is str:  # the common case, inlined
                n = len(left) + len(right)
                if n > budget.cap:
                    budget.sized(n, "concatenates a value")
                budget.steps += 1
                budget.work += n + _STEP
                if budget.work >= budget.next:
                    budget.check()
                return left + right
            if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
                n = budget.sized(budget.units(left) + budget.units(right), "concatenates a value")
            else:
                n = 0
            budget.step(n)
            return left + right
        lt, rt = type(left), type(right)
        if operator == "*":
            if lt is int and rt is int:
                budget.bits(left.bit_length() + right.bit_length(), "*")
            elif rt is int or rt is bool or lt is int or lt is bool:
                seq, times = (left, right) if rt is int or rt is bool else (right, left)
                if isinstance(seq, _SEQUENCES):
                    n = budget.sized(budget.units(seq) * max(times, 0), "repeats a value")
                    budget.step(n)
            return left * right
        if operator == "**":
            if lt is int and rt is int and right > 0 and left not in (0, 1, -1):
                budget.bits(left.bit_length() * right, "**")  # |left| < 2**bit_length
            budget.step()
            return left ** right
        if operator == "%":
            if isinstance(left, (str, bytes)):
                fmt = left.decode("latin-1") if isinstance(left, bytes) else left
                n = budget.sized(_printf_units(budget, fmt, right), "formats a string")
                budget.step(n)
                return _after(budget, left % right, "formats a string")
            return left % right
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 -- jinja's signature
        if not __self.is_safe_callable(__obj):
            raise jinja2.sandbox.SecurityError(f"{__obj!r} is not safely callable")
        budget = _ACTIVE.get() or __self.idle
        if args or kwargs:
            budget.integers(args, kwargs, __obj)
        weight = 0
        if type(__obj) is types.BuiltinMethodType:  # a C method: weighed by what it scans
            owner = __obj.__self__
            weight = len(owner) if type(owner) in _SIZED else 0
            if isinstance(owner, (str, bytes)):
                estimate = _METHODS.get(__obj.__name__)
                if estimate is not None:
                    size, args = estimate(budget, owner, args, kwargs)
                    budget.sized(size, f"builds, with {_name(__obj)}, a value")
        budget.steps += 1
        budget.work += weight + _STEP
        if budget.work >= budget.next:
            budget.check()
        budget.depth += 1
        try:
            if budget.depth > budget.depth_limit:
                raise budget.refuse(f"nests calls (macros, recursive loops) more than "
                                    f"{budget.depth_limit} deep", "template_depth")
            rv = __context.call(__obj, *args, **kwargs)
        finally:
            budget.depth -= 1
        if type(rv) is str and len(rv) < _WATCH_SIZE:  # the usual case: nothing to size
            return rv
        return _after(budget, rv, "builds, with {}, a value", __obj)

    def wrap_str_format(self, value):
        # jinja's own, with a formatter that checks widths and sizes (see _BudgetedFormatter)
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or \
                value.__name__ not in ("format", "format_map"):
            return None
        f_self = value.__self__
        if not isinstance(f_self, str):
            return None
        str_type, is_format_map = type(f_self), value.__name__ == "format_map"

        def wrapper(*args, **kwargs):
            formatter = (_BudgetedEscapeFormatter(self, escape=f_self.escape)
                         if isinstance(f_self, Markup) else _BudgetedFormatter(self))
            if is_format_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                kwargs, args = args[0], ()
            return str_type(formatter.vformat(f_self, args, kwargs))

        return update_wrapper(wrapper, value)

    def budget_join(self, join, parts):
        """``a ~ b ~ c``: sized before the strings are made and joined."""
        budget = _ACTIVE.get() or self.idle
        n = budget.sized(_text_units(parts, budget), "joins with ~ a value")
        budget.step(n)
        return _after(budget, join(parts), "joins with ~ a value")

    def budget_sized(self, value):
        """A list, tuple or dict literal: ``[a, a]`` nested doubles what printing or comparing
        it costs without costing memory, so it is sized as its text would be."""
        budget = _ACTIVE.get() or self.idle
        n = budget.sized(budget.units(value), "builds a list, tuple or dict")
        budget.step(n)
        return value

    def budget_weigh(self, value):
        """The container ``in`` scans, or a slice: its length counts as work."""
        n = _size_of(value)
        if n > _STEP:
            (_ACTIVE.get() or self.idle).step(n)
        return value

    def budget_finalize(self, value):
        """Every ``{{ ... }}``, before ``str()``: a container's text is sized first."""
        if type(value) is str or type(value) in _SCALARS:
            return value
        budget = _ACTIVE.get() or self.idle
        n = budget.sized(budget.units(value), "prints a value")
        budget.step(n)
        return value

    def concat(self, parts) -> str:
        """Joins the output captured by set blocks, filter blocks, macros and call blocks."""
        parts = parts if type(parts) is list else list(parts)
        budget = _ACTIVE.get() or self.idle
        n = budget.sized(sum(map(len, parts)), "captures output")
        budget.step(n)
        return "".join(parts)


_ACTIVE_COMPILE: contextvars.ContextVar[_Budget] = contextvars.ContextVar("nbtune_template_compile")


class ChatTemplate:
    """A compiled chat template and its source, rendered within the budget."""

    def __init__(self, source: str, origin: str | None = None):
        self.source, self.origin = source, origin
        self._env = env = _Sandbox(origin)
        budget = _Budget(self.origin, limit("template_output"), float("inf"),
                         limit("template_compile_ms") / 1000, limit("template_memory"),
                         clock="template_compile_ms")
        size = len(source.encode("utf-8", "surrogatepass"))
        if size > limit("template_bytes"):
            raise budget.refuse(f"is {size:,} bytes long", "template_bytes")
        token = _ACTIVE_COMPILE.set(budget)
        try:
            budget.check()  # starts its clock
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"{_subject(origin)} is not valid Jinja (line {err.lineno}: "
                             f"{err.message}); fix chat_template in tokenizer_config.json or "
                             "chat_template.jinja.") from err
        except RecursionError:
            raise budget.refuse("nests expressions or blocks deeper than Python can compile",
                                "template_depth") from None
        except (SyntaxError, OverflowError, ValueError) as err:
            if isinstance(err, FileRefused):
                raise
            raise ValueError(f"{_subject(origin)} cannot be compiled ({err}). {_FIX}") from err
        finally:
            _ACTIVE_COMPILE.reset(token)

    def budget_for(self, variables: dict) -> _Budget:
        messages = variables.get("messages")
        count = len(messages) if type(messages) is list else 0
        return _Budget(self.origin, None, LIMITS["template_steps"][0] + 1000 * count,
                       (LIMITS["template_render_ms"][0] + count) / 1000,
                       LIMITS["template_memory"][0], depth_limit=LIMITS["template_depth"][0],
                       variables=variables)

    def render(self, **variables) -> str:
        """The template's output for ``variables``, or ``TemplateBudgetError``."""
        budget = self.budget_for(variables)
        token = _ACTIVE.set(budget)
        template = self._template
        try:
            # every part is a string already sized and the loops that yield them are counted,
            # so the list holds at most a step's worth of references per part: sized before
            # it is joined
            parts = list(template.root_render_func(template.new_context(variables)))
            size = sum(map(len, parts))
            if size > _WATCH_SIZE:
                budget.sized(size, "writes output")
            return "".join(parts)
        except RecursionError:
            raise budget.refuse("recurses deeper than Python allows", "template_depth") from None
        except OverflowError as err:
            if "Range too big" not in str(err):  # jinja's sandbox refuses long range() so
                self._env.handle_exception()
            raise budget.refuse("asks for a range longer than jinja's sandbox allows",
                                "template_steps", "100,000 items in one range") from None
        except TemplateBudgetError:
            raise
        except Exception:
            self._env.handle_exception()
        finally:
            _ACTIVE.reset(token)


def compile_chat_template(source: str, origin: str | None = None) -> ChatTemplate:
    """Compile like transformers' ``_compile_jinja_template`` so templates render identically,
    within the limits above; ``origin`` names the file the template came from in errors."""
    return ChatTemplate(source, origin)
