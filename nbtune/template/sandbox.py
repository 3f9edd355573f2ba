"""transformers' chat-template environment, with every way a template does work budgeted.

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

What each operation costs and the checks are ``nbtune.template.budget``'s.

Rendered text is exactly what the unbudgeted environment renders (transformers' settings).
Rendering costs ~1.25x the unbudgeted time for SmolLM2's template, 1.3-1.5x for Llama 3,
Qwen and Mistral-style ones; compiling ~2x (milliseconds, once per tokenizer).
"""
from __future__ import annotations

import contextvars
import json
import types
from datetime import datetime
from functools import update_wrapper

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, operators, optimizeconst
from jinja2.sandbox import (ImmutableSandboxedEnvironment, SandboxedEscapeFormatter,
                            SandboxedFormatter)
from jinja2.utils import pass_context
from markupsafe import Markup

from ..files import LIMITS, FileRefused, limit
from .budget import (FILTERS, FIX, METHODS, PLAIN_FILTERS, PYTHON_FILTERS, SCALARS,
                     SCANNING_TESTS, SEQUENCES, SIZED, STEP, WATCH_SIZE, Budget,
                     TemplateBudgetError, after, callee_name, lipsum_units, printf_units,
                     size_of, spec_width, subject, text_units, watched)

__all__ = ["ChatTemplate", "compile_chat_template"]

# the budget of the render, and of the compile, running in this context
_ACTIVE: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("nbtune_template_budget",
                                                                       default=None)
_ACTIVE_COMPILE: contextvars.ContextVar[Budget] = contextvars.ContextVar("nbtune_template_compile")


def _pass_arg(func) -> str | None:
    arg = getattr(func, "jinja_pass_arg", None)
    return getattr(arg, "name", None)


def _budgeted_filter(name: str, func):
    how = _pass_arg(func)
    first = {"context": lambda context: context, "eval_context": lambda context: context.eval_ctx,
             "environment": lambda context: context.environment}.get(how)
    estimate = FILTERS.get(name)
    python = name in PYTHON_FILTERS
    what, where = f"builds, with the filter {name!r}, a value", f"the filter {name!r}"

    @pass_context  # also keeps jinja from running the filter at compile time
    def budgeted(context, value, *args, **kwargs):
        budget = _ACTIVE.get() or context.environment.idle
        if args or kwargs:
            budget.integers(args, kwargs, where)
        if estimate is not None:
            size, value, args = estimate(budget, value, args, kwargs)
            budget.sized(size, what)
        n = len(value) if type(value) in SIZED else 0
        budget.steps += 1
        budget.work += n + STEP
        if budget.work >= budget.next:
            budget.check()
        if first is not None:
            args = (first(context), value, *args)
        else:
            args = (value, *args)
        if python and n >= WATCH_SIZE:
            rv = watched(budget, func, *args, **kwargs)
        else:
            rv = func(*args, **kwargs)
        if type(rv) is str and len(rv) < WATCH_SIZE:  # the usual case: nothing to size
            return rv
        return after(budget, rv, what)

    return budgeted


def _budgeted_test(name: str, func):
    how = _pass_arg(func)
    skip = 0 if how is None else 1

    def budgeted(*args, **kwargs):
        # weighed by what it may scan (``is in``, ``is lower`` makes a str()); most take O(1)
        for value in args[skip:]:
            if type(value) in SIZED and len(value) > STEP:
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
        width = spec_width(budget, format_spec) if format_spec else 0
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


def _clocked(budget: Budget, items):
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
        budget.work += STEP * len(iterable)
        if budget.work >= budget.next:
            budget.check()
        return iterable
    return _counted(budget, iterable)


def _counted(budget: Budget, iterable):
    for item in iterable:
        budget.steps += 1
        budget.work += STEP
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
        self.idle = Budget(origin, limit("template_output"), float("inf"), float("inf"),
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
            lipsum_units(_ACTIVE.get() or self.idle, args, kwargs)
            return lipsum(*args, **kwargs)

        # tojson replaced because jinja's escapes HTML characters, which transformers' does not
        self.filters["tojson"] = tojson
        self.globals["raise_exception"] = raise_exception
        self.globals["strftime_now"] = strftime_now
        self.globals["lipsum"] = update_wrapper(budgeted_lipsum, lipsum)
        self.filters = {name: func if name in PLAIN_FILTERS else _budgeted_filter(name, func)
                        for name, func in self.filters.items()}
        self.filters[_LOOP] = _counted_loop
        self.tests = {name: _budgeted_test(name, func) if name in SCANNING_TESTS else func
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
            if sum(map(len, operands)) < WATCH_SIZE:
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
                budget.work += n + STEP
                if budget.work >= budget.next:
                    budget.check()
                return left + right
            if isinstance(left, SEQUENCES) and isinstance(right, SEQUENCES):
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
                if isinstance(seq, SEQUENCES):
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
                n = budget.sized(printf_units(budget, fmt, right), "formats a string")
                budget.step(n)
                return after(budget, left % right, "formats a string")
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
            weight = len(owner) if type(owner) in SIZED else 0
            if isinstance(owner, (str, bytes)):
                estimate = METHODS.get(__obj.__name__)
                if estimate is not None:
                    size, args = estimate(budget, owner, args, kwargs)
                    budget.sized(size, f"builds, with {callee_name(__obj)}, a value")
        budget.steps += 1
        budget.work += weight + STEP
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
        if type(rv) is str and len(rv) < WATCH_SIZE:  # the usual case: nothing to size
            return rv
        return after(budget, rv, "builds, with {}, a value", __obj)

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
        n = budget.sized(text_units(parts, budget), "joins with ~ a value")
        budget.step(n)
        return after(budget, join(parts), "joins with ~ a value")

    def budget_sized(self, value):
        """A list, tuple or dict literal: ``[a, a]`` nested doubles what printing or comparing
        it costs without costing memory, so it is sized as its text would be."""
        budget = _ACTIVE.get() or self.idle
        n = budget.sized(budget.units(value), "builds a list, tuple or dict")
        budget.step(n)
        return value

    def budget_weigh(self, value):
        """The container ``in`` scans, or a slice: its length counts as work."""
        n = size_of(value)
        if n > STEP:
            (_ACTIVE.get() or self.idle).step(n)
        return value

    def budget_finalize(self, value):
        """Every ``{{ ... }}``, before ``str()``: a container's text is sized first."""
        if type(value) is str or type(value) in SCALARS:
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


class ChatTemplate:
    """A compiled chat template and its source, rendered within the budget."""

    def __init__(self, source: str, origin: str | None = None):
        self.source, self.origin = source, origin
        self._env = env = _Sandbox(origin)
        budget = Budget(self.origin, limit("template_output"), float("inf"),
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
            raise ValueError(f"{subject(origin)} is not valid Jinja (line {err.lineno}: "
                             f"{err.message}); fix chat_template in tokenizer_config.json or "
                             "chat_template.jinja.") from err
        except RecursionError:
            raise budget.refuse("nests expressions or blocks deeper than Python can compile",
                                "template_depth") from None
        except (SyntaxError, OverflowError, ValueError) as err:
            if isinstance(err, FileRefused):
                raise
            raise ValueError(f"{subject(origin)} cannot be compiled ({err}). {FIX}") from err
        finally:
            _ACTIVE_COMPILE.reset(token)

    def budget_for(self, variables: dict) -> Budget:
        messages = variables.get("messages")
        count = len(messages) if type(messages) is list else 0
        return Budget(self.origin, None, LIMITS["template_steps"][0] + 1000 * count,
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
            if size > WATCH_SIZE:
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
