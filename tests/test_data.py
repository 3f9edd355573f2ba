"""Rows -> token ids: prompt masking, chat rows, padding, truncation, clear errors."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nbtune as nt
from nbtune.data import (IGNORE, BatchStream, DataError, collate, load_examples, prompt_and_reference,
                         tokenize, tokenize_all)
from nbtune.data.batches import _starts_within
from nbtune.models.tiny import byte_tokenizer

TOK = byte_tokenizer()


def write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_instruction_row_trains_only_on_the_output(tmp_path):
    path = write(tmp_path, [json.dumps({"instruction": "Say hi.", "input": "x", "output": "hi"})])
    (example,) = load_examples(path)
    sample = tokenize(example, TOK, seq_len=256)
    trained = sample.labels[sample.labels != IGNORE].tolist()
    assert trained == TOK.encode("hi") + [TOK.eos_id]
    # labels are the inputs shifted by one wherever they are trained
    positions = (sample.labels != IGNORE).nonzero().flatten()
    assert sample.input_ids[positions[0]].item() == TOK.encode("\n")[0]  # last prompt token
    assert sample.input_ids[0].item() == TOK.bos_id
    assert (sample.input_ids == TOK.bos_id).sum() == 1
    prompt, reference = prompt_and_reference(example, TOK)
    assert prompt == "### Instruction:\nSay hi.\n\n### Input:\nx\n\n### Response:\n"
    assert reference == "hi"


# ChatML-like, on the demo tokenizer's own special tokens: each turn ends with <|end|>\n.
TEMPLATE = ("{% for m in messages %}<|begin|>{{ m.role }}\n{{ m.content }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|begin|>assistant\n{% endif %}")


def test_chat_row_trains_on_every_assistant_message(tmp_path):
    tok = byte_tokenizer()
    tok.chat_template = TEMPLATE
    row = {"messages": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "4"},
                        {"role": "user", "content": "3+3?"},
                        {"role": "assistant", "content": "6"}]}
    (example,) = load_examples(write(tmp_path, [json.dumps(row)]))
    sample = tokenize(example, tok, seq_len=512)
    trained = sample.labels[sample.labels != IGNORE].tolist()
    assert trained == tok.encode("4<|end|>\n") + tok.encode("6<|end|>\n")  # the template's turn ends
    assert sample.input_ids[0].item() == tok.bos_id  # the template writes none, so nbtune puts one
    prompt, reference = prompt_and_reference(example, tok)
    assert reference == "6" and prompt.endswith("3+3?<|end|>\n<|begin|>assistant\n")
    assert prompt.startswith("<|begin|>system\nBe brief.<|end|>")


@pytest.mark.parametrize("line, message", [
    ('{"instruction": "a"}', "line 2: missing 'output'"),
    ('{"instruction": "a", "output": 3}', "line 2: 'output' must be a string"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "line 2: message 0 must be"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "line 2: the conversation has no assistant"),
    ('{"instruction": "a", "output": "b"', "line 2: not valid JSON"),
    ('[1, 2]', "line 2: expected a JSON object"),
])
def test_malformed_row_names_file_line_and_problem(tmp_path, line, message):
    path = write(tmp_path, ['{"instruction": "ok", "output": "fine"}', line])
    with pytest.raises(DataError) as err:
        load_examples(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_empty_and_missing_files_are_named(tmp_path):
    with pytest.raises(DataError, match="holds no rows"):
        load_examples(write(tmp_path, [""]))
    with pytest.raises(DataError, match="no such data file"):
        load_examples(tmp_path / "nope.jsonl")


@pytest.mark.parametrize("name", ["rows.json", "rows.JSON", "rows.Json"])
def test_json_list_file(tmp_path, name):
    """A .json file is one list of rows, whatever the case of its suffix (an upper-case
    one was read as JSON Lines: a multi-line list failed on its first line)."""
    path = tmp_path / name
    path.write_text(json.dumps([{"instruction": "a", "output": "b"}] * 3, indent=1))
    assert len(load_examples(path)) == 3


def test_truncation_keeps_rows_with_some_response_and_drops_the_rest(tmp_path):
    rows = [{"instruction": "short", "output": "a long answer"},
            {"instruction": "x" * 200, "output": "never seen"}]
    examples = load_examples(write(tmp_path, [json.dumps(r) for r in rows]))
    samples, dropped = tokenize_all(examples, TOK, seq_len=40)
    assert dropped == 1 and len(samples) == 1
    assert len(samples[0].input_ids) == 40
    with pytest.raises(DataError, match="Raise seq_len"):
        tokenize_all(examples[1:], TOK, seq_len=40)


def test_collate_pads_inputs_and_ignores_padding_in_labels(tmp_path):
    examples = load_examples(write(tmp_path, [json.dumps({"instruction": "a", "output": "b"}),
                                              json.dumps({"instruction": "abcdef", "output": "b"})]))
    samples = [tokenize(e, TOK, 256) for e in examples]
    batch = collate(samples, TOK.pad_id)
    short = len(samples[0].input_ids)
    assert batch["input_ids"].shape == batch["labels"].shape == (2, len(samples[1].input_ids))
    assert (batch["input_ids"][0, short:] == TOK.pad_id).all()
    assert (batch["labels"][0, short:] == IGNORE).all()


def test_batch_stream_is_seeded_and_covers_an_epoch(tmp_path):
    examples = load_examples(write(tmp_path, [json.dumps({"instruction": str(i), "output": "b"})
                                              for i in range(10)]))
    samples, _ = tokenize_all(examples, TOK, 64)
    a, b = BatchStream(samples, 5, TOK.pad_id, seed=3), BatchStream(samples, 5, TOK.pad_id, seed=3)
    first = [a.next()["input_ids"] for _ in range(2)]
    assert all(torch.equal(x, b.next()["input_ids"]) for x in first)
    seen = {tuple(row.tolist()) for batch in first for row in batch}
    assert len(seen) == 10  # one epoch visits every row once


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=30),
       st.lists(st.tuples(st.integers(0, 70), st.integers(0, 20)), max_size=4))
def test_a_token_is_trained_when_it_starts_inside_an_assistant_span(starts, spans):
    """The bisection against the plain rule, token by token, over any spans (overlapping,
    empty, out of order) and starts in either order."""
    spans = [(lo, lo + width) for lo, width in spans]
    want = [any(lo <= start < hi for lo, hi in spans) for start in starts]
    assert _starts_within(sorted(starts), spans) == [any(lo <= s < hi for lo, hi in spans)
                                                     for s in sorted(starts)]
    assert _starts_within(starts, spans) == want


def test_a_new_stream_tokenizes_again_only_when_its_tokens_change(tmp_path, monkeypatch):
    """Batch size and seed reuse the rows' tokens; seq_len, packing, the chat template and
    new rows tokenize again, and each stream's batches are a fresh TrainingData's."""
    import nbtune.data as data_module
    from nbtune.data import TrainingData

    rows = load_examples(write(tmp_path, [json.dumps({"instruction": "q" * i, "output": "a" * (i % 5 + 1)})
                                          for i in range(12)]))
    calls = []
    real = data_module.tokenize_all
    monkeypatch.setattr(data_module, "tokenize_all", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    tok = byte_tokenizer()
    data = TrainingData(rows, tok)

    def batches(t, fresh=True):
        stream, _ = (TrainingData(rows, tok) if fresh else data).stream(t)
        return [stream.next() for _ in range(3)]

    def same(t):
        got, want = batches(t, fresh=False), batches(t)
        assert all(torch.equal(g[k], w[k]) for g, w in zip(got, want) for k in w)

    t = nt.Techniques(batch_size=2, seq_len=64)
    data.stream(t)
    for changes, tokenized in [({"batch_size": 3}, False), ({"seed": 7}, False),
                               ({"seq_len": 48}, True), ({"packing": True}, True),
                               ({"batch_size": 4}, False)]:
        t, before = t.replace(**changes), len(calls)
        same(t)  # (the fresh twin tokenizes once)
        assert len(calls) - before == 1 + tokenized, changes
    tok.chat_template = TEMPLATE  # the rows now read through the template
    before = len(calls)
    same(t)
    assert len(calls) - before == 2
    data.train = rows[:6]  # (as a test helper does)
    got, _ = data.stream(t)
    want, _ = TrainingData(rows[:6], tok).stream(t)
    assert len(calls) - before == 4
    assert [s.input_ids.tolist() for s in got.samples] == [s.input_ids.tolist() for s in want.samples]
