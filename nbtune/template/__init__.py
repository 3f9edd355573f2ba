"""Chat templates are code from strangers: compiled and rendered within a budget.

jinja2's sandbox stops a template reaching Python's internals, but not running for hours or
building gigabytes: ``{{ 'a' * 10**10 }}`` (folded while compiling), ``9**(9**9)``,
``'%999999999s' % 'a'``, ``'a'.center(10**9)``, nested ``range`` loops, a string doubled forty
times, a macro that calls itself twice. Here every way a template does work passes a check,
and going past a limit is ``TemplateBudgetError`` naming the template's source and the limit
(the limits and their reasons are ``nbtune.files.LIMITS["template_*"]``).

- ``budget``: what work costs: the budget of one compile or render (steps, CPU time, memory,
  depth, sizes) and the sizes operations will build, known before they run.
- ``sandbox``: where it is charged: transformers' chat-template environment with its code
  generator, operators, calls, filters, tests, loops and output budgeted; ``ChatTemplate``.
"""
from .budget import TemplateBudgetError
from .sandbox import ChatTemplate, compile_chat_template

__all__ = ["ChatTemplate", "TemplateBudgetError", "compile_chat_template"]
