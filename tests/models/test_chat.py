"""Chat templates per family, checked against transformers' ``apply_chat_template``.

Each family gets a tiny tokenizer trained here (byte-level BPE for Llama 3 and Qwen 2.5,
SentencePiece-style Metaspace BPE for Mistral) carrying that family's special tokens and
real-style chat template, written as a Hugging Face folder and read by both libraries.
"""

import json
import string

import pytest
import torch
from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

import nbtune as nt
from nbtune.data import (IGNORE, DataError, Example, load_examples, prompt_and_reference, prompt_ids,
                         prompt_text, tokenize, tokenize_all)
from nbtune.models import Tokenizer
from nbtune.models.decoder import CausalLM
from nbtune.models.tiny import byte_tokenizer, demo_config

# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3 = (r"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          r"'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
          r"+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          r"{{ content }}{% endfor %}{% if add_generation_prompt %}"
          r"{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# Llama 3.2's template without its tool-calling branches: a dated system block via strftime_now.
LLAMA32 = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Qwen2.5-Instruct's template (ChatML, default system prompt, tool branches kept).
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Mistral-7B-Instruct-v0.2's template, verbatim: no system role, strict alternation.
MISTRAL = (r"{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
           r"(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
           r"user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
           r"{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
           r"{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
           r"roles are supported!') }}{% endif %}{% endfor %}")

# Mistral v0.3 style: the system message goes into the *last* user turn, so an earlier turn
# renders differently once the conversation goes on.
MISTRAL_V3 = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- endif %}
{%- endfor %}
"""

# Gemma 3's template (the -it checkpoints' tokenizer_config.json): no system role; a system
# message is put before the first user turn's text, and the assistant is "model".
GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

FAMILIES = {
    # name: (special tokens, tokenizer_config entries, template, Metaspace?, how a turn ends)
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, LLAMA3, False,
               "{}<|eot_id|>"),
    "llama3.2": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>"],
                 {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, LLAMA32, False,
                 "{}<|eot_id|>"),
    "qwen2.5": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, QWEN25,
                False, "{}<|im_end|>\n"),
    "mistral": (["<unk>", "<s>", "</s>"],
                {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, MISTRAL, True, "{}</s>"),
    "gemma3": (["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
               {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
               GEMMA3, True, "{}<end_of_turn>\n"),
}

CORPUS = ["You are a helpful assistant.", "What is 2+2?", "It is 4.", "And 3+3? It is 6.",
          "Reverse the word: hello", "olleh", "system user assistant", "[INST] [/INST]",
          "Cutting Knowledge Date: December 2023", "Today Date:", "You are Qwen, created by Alibaba Cloud."]

SYSTEM = {"role": "system", "content": "Be brief."}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}],
    [SYSTEM, {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."},
     {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is 6.\n"}],
    [SYSTEM, {"role": "user", "content": "Reverse the word: hello"}, {"role": "assistant", "content": "olleh"},
     {"role": "user", "content": "And été?"}, {"role": "assistant", "content": "été"}],
]


def family_backend(specials: list[str], metaspace: bool) -> HFBackend:
    """A BPE trained on a few sentences: real merges, so token seams can go wrong."""
    backend = HFBackend(models.BPE(unk_token="<unk>" if metaspace else None))
    if metaspace:  # SentencePiece style: spaces become ▁, one is put before the text
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet = list(string.printable) + ["▁", "é"]
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    backend.train_from_iterator(CORPUS * 3, trainer)
    return backend


def write_family(folder, name: str, template: str | None = "same", **config_changes):
    specials, config, default_template, metaspace, _ = FAMILIES[name]
    folder.mkdir(parents=True, exist_ok=True)
    family_backend(specials, metaspace).save(str(folder / "tokenizer.json"))
    config = {**config, "tokenizer_class": "PreTrainedTokenizerFast", **config_changes}
    if template is not None:
        config["chat_template"] = default_template if template == "same" else template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, nbtune Tokenizer, transformers tokenizer) read from the same folder."""
    folder = write_family(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(str(folder))


def conversations_for(name: str) -> list[list[dict]]:
    if name == "mistral":  # its template has no system role
        return [c for c in CONVERSATIONS if c[0]["role"] != "system"]
    return CONVERSATIONS


def example_of(messages: list[dict]) -> Example:
    return Example(tuple((m["role"], m["content"]) for m in messages))


def hf_ids(hf, messages, **kw) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def test_rendering_matches_transformers(family):
    name, tok, hf = family
    assert tok.chat_template == hf.chat_template
    for messages in conversations_for(name):
        for upto in range(1, len(messages) + 1):
            for gen in (False, True):
                ours = tok.render_chat(messages[:upto], add_generation_prompt=gen)
                assert ours == hf.apply_chat_template(messages[:upto], tokenize=False,
                                                      add_generation_prompt=gen), (upto, gen)


def test_token_ids_match_transformers(family):
    name, tok, hf = family
    for messages in conversations_for(name):
        expected = hf_ids(hf, messages)
        sample = tokenize(example_of(messages), tok, seq_len=1024)
        assert sample.input_ids.tolist() == expected[:-1]
        trained = sample.labels != IGNORE
        assert sample.labels[trained].tolist() == torch.tensor(expected[1:])[trained].tolist()
        assert sample.labels[-1].item() == expected[-1]  # the last turn's end is trained


def test_only_assistant_turns_are_trained(family):
    """Trained tokens are exactly each assistant turn as the template writes it, end included."""
    name, tok, _ = family
    turn_end = FAMILIES[name][4]
    for messages in conversations_for(name):
        sample = tokenize(example_of(messages), tok, seq_len=1024)
        trained = (sample.labels != IGNORE).tolist()
        runs, current = [], []
        for keep, label in zip(trained, sample.labels.tolist()):
            if keep:
                current.append(label)
            elif current:
                runs, current = runs + [current], []
        runs += [current] if current else []
        contents = [m["content"] for m in messages if m["role"] == "assistant"]
        if name.startswith("llama") or name == "gemma3":
            contents = [c.strip() for c in contents]  # its template trims message content
        assert [tok.backend.decode(run, skip_special_tokens=False) for run in runs] == \
            [turn_end.format(c) for c in contents]


def test_gemma3s_system_message_opens_the_first_user_turn_untrained(tmp_path):
    """Gemma 3's template has no system role: the system text goes before the first user
    turn's, in that turn, as the template writes it, and is not trained; two user turns in
    a row are the template's own error, naming the row."""
    tok = Tokenizer.from_folder(write_family(tmp_path / "g", "gemma3"))
    messages = CONVERSATIONS[3]
    text = tok.render_chat(messages)
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nReverse the word: hello<end_of_turn>\n"
                           "<start_of_turn>model\nolleh<end_of_turn>\n")
    assert "system" not in text
    sample = tokenize(example_of(messages), tok, seq_len=1024)
    trained = tok.backend.decode(sample.labels[sample.labels != IGNORE].tolist(), skip_special_tokens=False)
    assert "Be brief" not in trained and "olleh" in trained
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"messages": [SYSTEM, {"role": "user", "content": "a"},
                                             {"role": "user", "content": "b"},
                                             {"role": "assistant", "content": "c"}]}) + "\n")
    with pytest.raises(DataError, match=r"line 1: .*template rejects .*Conversation roles must alternate"):
        tokenize_all(load_examples(path), tok, 256)


def test_generation_prompt_and_reference_match_transformers(family):
    name, tok, hf = family
    messages = conversations_for(name)[-1]
    prompt, reference = prompt_and_reference(example_of(messages), tok)
    assert prompt == hf.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert reference == messages[-1]["content"]
    user = [{"role": "user", "content": "Reverse the word: hello\n\nolleh"}]
    assert prompt_text(tok, "Reverse the word: hello", "olleh") == hf.apply_chat_template(
        user, tokenize=False, add_generation_prompt=True)


def test_instruction_rows_go_through_the_template(family, tmp_path):
    name, tok, hf = family
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"instruction": "Reverse the word: hello", "input": "x", "output": "olleh"}))
    (example,) = load_examples(path)
    messages = [{"role": "user", "content": "Reverse the word: hello\n\nx"},
                {"role": "assistant", "content": "olleh"}]
    sample = tokenize(example, tok, seq_len=1024)
    assert sample.input_ids.tolist() == hf_ids(hf, messages)[:-1]
    assert "### Instruction" not in tok.decode(sample.input_ids.tolist())


def test_llama3_gets_exactly_one_bos(tmp_path):
    tok = Tokenizer.from_folder(write_family(tmp_path / "l", "llama3"))
    bos = tok.backend.token_to_id("<|begin_of_text|>")
    assert tok.bos_id == bos
    example = example_of(CONVERSATIONS[2])
    ids = tokenize(example, tok, seq_len=1024).input_ids.tolist()
    assert ids[0] == bos and ids.count(bos) == 1
    prompt = prompt_text(tok, "What is 2+2?")
    assert prompt.startswith("<|begin_of_text|>") and prompt.count("<|begin_of_text|>") == 1
    generation = prompt_ids(tok, prompt)
    assert generation[0] == bos and generation.count(bos) == 1
    assert prompt_ids(byte_tokenizer(), "hi")[0] == byte_tokenizer().bos_id  # no template: BOS added


def test_bos_follows_the_tokenizer_without_a_template(tmp_path):
    row = Example((("user", "hi"), ("assistant", "yo")), instruction=("hi", ""))
    with_bos = Tokenizer.from_folder(write_family(tmp_path / "a", "mistral", template=None))
    without = Tokenizer.from_folder(write_family(tmp_path / "b", "mistral", template=None,
                                                 add_bos_token=False))
    assert without.bos_id is None
    a, b = (tokenize(row, t, 256).input_ids.tolist() for t in (with_bos, without))
    assert a[0] == with_bos.bos_id and a[1:] == b and with_bos.bos_id not in b
    # the Alpaca prompt, and the response followed by EOS, both trained
    sample = tokenize(row, with_bos, 256)
    assert sample.labels[sample.labels != IGNORE].tolist()[-1] == with_bos.eos_id
    assert with_bos.decode(a).startswith("### Instruction:")


def test_chat_row_without_a_template_names_the_problem_and_the_fix(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    examples = load_examples(path)  # reading needs no tokenizer
    for call in (lambda: tokenize_all(examples, byte_tokenizer(), 256),
                 lambda: prompt_and_reference(examples[0], byte_tokenizer())):
        with pytest.raises(DataError) as err:
            call()
        message = str(err.value)
        assert f"{path}: line 1" in message and "no chat template" in message
        assert "instruction rows" in message and "chat_template" in message


def test_template_errors_name_the_row(tmp_path):
    tok = Tokenizer.from_folder(write_family(tmp_path / "m", "mistral"))
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")  # a system message
    with pytest.raises(DataError, match=r"line 1: .*template rejects .*Conversation roles must alternate"):
        tokenize_all(load_examples(path), tok, 256)


def test_a_template_that_is_not_prefix_stable_is_refused(tmp_path):
    tok = Tokenizer.from_folder(write_family(tmp_path / "m", "mistral", template=MISTRAL_V3))
    assert tokenize(example_of(CONVERSATIONS[2]), tok, 256) is not None  # no system: stable
    with pytest.raises(DataError, match="not prefix-stable"):
        tokenize(example_of(CONVERSATIONS[1]), tok, 256)


def test_stop_ids_come_from_config_and_generation_config(tmp_path):
    folder = write_family(tmp_path / "l", "llama3")
    tok = Tokenizer.from_folder(folder)
    end, eot, header = (tok.backend.token_to_id(t)
                        for t in ("<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>"))
    assert tok.eos_id == end and tok.stop_ids == {end}
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [end, header]}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eot}))
    assert Tokenizer.from_folder(folder).stop_ids == frozenset({end, header, eot})


def test_template_survives_save_and_reload(tmp_path):
    source = write_family(tmp_path / "src", "qwen2.5")
    tok = Tokenizer.from_folder(source)
    tok.save(tmp_path / "out")
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == QWEN25
    assert "chat_template" not in json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    back = Tokenizer.from_folder(tmp_path / "out")
    assert back.chat_template == QWEN25
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).chat_template == QWEN25
    messages = CONVERSATIONS[1]
    assert back.render_chat(messages) == tok.render_chat(messages)


def test_template_sources_list_form_and_jinja_file(tmp_path):
    listed = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": MISTRAL}]
    folder = write_family(tmp_path / "m", "mistral", template=listed)
    assert Tokenizer.from_folder(folder).chat_template == MISTRAL
    (folder / "chat_template.jinja").write_text(MISTRAL_V3)  # transformers 5 reads this first
    assert Tokenizer.from_folder(folder).chat_template == MISTRAL_V3
    assert Tokenizer.from_folder(write_family(tmp_path / "n", "mistral", template=None)).chat_template is None


def test_jinja_environment_matches_transformers(tmp_path):
    """tojson without HTML escaping, loop controls, trimmed blocks, raise_exception."""
    template = ("{% for m in messages %}\n  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
                "{{ m | tojson }}\n{% if loop.index > 2 %}{% break %}{% endif %}\n{% endfor %}"
                "{{ eos_token }}{% if messages | length > 9 %}{{ raise_exception('too long') }}{% endif %}")
    folder = write_family(tmp_path / "q", "qwen2.5", template=template)
    tok, hf = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(str(folder))
    messages = CONVERSATIONS[3] + [{"role": "user", "content": "<b>&'\"</b> ünï"}]
    assert tok.render_chat(messages) == hf.apply_chat_template(messages, tokenize=False)
    assert '"<b>&' in tok.render_chat([{"role": "user", "content": "<b>&"}])
    with pytest.raises(Exception, match="too long"):
        tok.render_chat(messages * 3)


def test_session_trains_and_evaluates_chat_rows(tmp_path):
    """A session on chat rows: the template feeds training, and evaluate's prompts."""
    tok = Tokenizer.from_folder(write_family(tmp_path / "q", "qwen2.5"))
    model = CausalLM(demo_config(tok))
    model.reset_parameters()
    rows = [example_of(c) for c in CONVERSATIONS]
    session = nt.Session(model, tok, rows, heldout=rows[:2], device="cpu",
                         techniques=nt.Techniques(method="full", dtype="fp32", batch_size=2, seq_len=128))
    assert session.step().tokens > 0
    assert 0.0 <= session.evaluate() <= 1.0


def test_chat_rows_without_a_template_fail_before_the_weights_load(tmp_path, monkeypatch):
    import json

    import nbtune.run.factory as runs  # the run factory loads the weights, for Session too
    from nbtune.models import demo_model_dir

    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "yo"}]}) + "\n")

    def must_not_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the data was checked")

    monkeypatch.setattr(runs, "load_model", must_not_load)
    with pytest.raises(DataError, match="no chat template"):
        nt.Session.from_pretrained(demo_model_dir(), data=rows)


def test_chat_keeps_the_conversation_and_streams_what_generate_returns(tmp_path, capsys):
    """``session.chat`` renders the whole conversation through the template each turn (the
    reference: the ids made here from ``render_chat`` of the same turns), and its stream gives
    the reply piece by piece, whole, as it is made."""
    from nbtune.generate import generate_ids

    tok = Tokenizer.from_folder(write_family(tmp_path / "q", "qwen2.5"))
    torch.manual_seed(0)
    model = CausalLM(demo_config(tok))
    model.reset_parameters()
    rows = [example_of(c) for c in CONVERSATIONS]
    session = nt.Session(model, tok, rows, device="cpu",
                         techniques=nt.Techniques(method="full", batch_size=2, seq_len=128))
    session.echo = False
    pieces = []
    first = session.chat("Hello there", max_new_tokens=12, stream=pieces.append)
    second = session.chat("And again?", max_new_tokens=12, temperature=0.8, seed=3)
    assert [t["role"] for t in session.conversation] == ["user", "assistant"] * 2
    assert session.conversation[1]["content"] == first and session.conversation[3]["content"] == second
    assert "".join(pieces) == first
    turns = session.conversation[:3]
    model.eval()
    expected = generate_ids(model, prompt_ids(tok, tok.render_chat(turns, add_generation_prompt=True)),
                            max_new_tokens=12, stop_ids=tok.stop_ids, temperature=0.8,
                            generator=torch.Generator().manual_seed(3))
    assert second == tok.decode(expected)
    session.chat("New topic", reset=True, max_new_tokens=4)
    assert len(session.conversation) == 2
    printed = session.generate("Say something", max_new_tokens=10, stream=True)
    assert capsys.readouterr().out == printed
    with pytest.raises(TypeError, match="stream=3"):
        session.generate("x", stream=3)


def test_chat_without_a_chat_template_says_to_use_generate():
    session = nt.Session.demo()
    with pytest.raises(ValueError, match="no chat template.*session.generate"):
        session.chat("hi")
    assert session.conversation == []


def test_the_stream_gives_each_token_its_text_and_holds_a_character_until_it_is_whole():
    """Pieces as tokens come: ASCII at once; a character whose UTF-8 bytes span two tokens
    (the decode shows U+FFFD until its last byte) once whole; the rest at the end."""
    from nbtune.generate import TextStream

    tokens = [b"He", b"llo ", "\u00e9".encode()[:1], "\u00e9".encode()[1:], b"!", b"\xe2\x82"]

    def decode(ids):
        return b"".join(tokens[i] for i in ids).decode("utf-8", errors="replace")

    pieces = []
    stream = TextStream(decode, pieces.append)
    for n in range(1, len(tokens) + 1):
        stream(list(range(n)))
    assert pieces == ["He", "llo ", "\u00e9", "!"]  # the cut-off euro sign waits
    stream(list(range(len(tokens))), last=True)
    assert pieces[-1] == "\ufffd" and "".join(pieces) == decode(list(range(len(tokens))))
