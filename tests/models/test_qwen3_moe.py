"""What is Qwen3-MoE's own: the load-balancing loss against transformers' (alone and inside a
training step), transformers 5's fused expert layout read as the Hub's, the experts as a LoRA
target and NF4 under QLoRA, the estimate over routing it cannot see, and an adapter PEFT would
misread refused. ``test_families.py`` proves its logits (fp32 and bf16) and gradients (full,
and LoRA against PEFT) against transformers; ``test_family_toggles.py`` its toggles."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

import nbtune as nt
from nbtune.models.decoder import SparseMoE
from nbtune.models.tiny import byte_tokenizer
from nbtune.peft import NF4Linear, is_nf4

from test_families import build, their_grad

ROWS = [{"instruction": f"Spell {w}.", "output": " ".join(w)} for w in
        ("expert", "router", "balance", "sparse", "topk", "gate", "token", "mixture")]
IGNORE = -100


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    build(path, "qwen3_moe", tie=False)
    return path


def session(folder, **changes) -> nt.Session:
    t = nt.Techniques(**{"batch_size": 4, "seq_len": 128, "lr": 1e-3, "optimizer": "sgd", **changes})
    s = nt.Session(nt.load_model(folder), byte_tokenizer(), ROWS, techniques=t, device="cpu")
    s.echo = False
    return s


def test_the_balancing_loss_is_transformers(folder):
    """Summed over the sparse layers as transformers sums it (the dense second layer has none)."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = nt.load_model(folder).eval()
    ids = torch.randint(3, 250, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(ids, output_router_logits=True).aux_loss
        ours(ids)
    assert len(ours.sparse_blocks) == 1 and expected > 1.0  # tiny random routers are unbalanced
    torch.testing.assert_close(ours.router_loss(), expected, atol=1e-6, rtol=0)


def test_a_step_adds_the_balancing_loss_as_transformers_does(folder, tmp_path):
    """Two micro-batches, SGD: the report's loss is the cross-entropy, its router_loss the
    mean balancing loss, and the weights after the step those of transformers' model trained
    by hand on cross-entropy + coef x balancing loss (coef raised to 1 so a missing term shows)."""
    heavy = tmp_path / "heavy"
    shutil.copytree(folder, heavy)
    config = json.loads((heavy / "config.json").read_text())
    (heavy / "config.json").write_text(json.dumps({**config, "router_aux_loss_coef": 1.0}))
    s, twin = session(heavy, grad_accum=2, batch_size=2, lr=0.5), session(heavy, grad_accum=2, batch_size=2)
    batches = [twin.trainer.stream.next() for _ in range(2)]
    ref = transformers.AutoModelForCausalLM.from_pretrained(heavy).train()
    trained = sum(int((b["labels"] != IGNORE).sum()) for b in batches)
    losses, balances = [], []
    for b in batches:
        out = ref(b["input_ids"], output_router_logits=True)
        ce = F.cross_entropy(out.logits.flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE,
                             reduction="sum") / trained
        (ce + out.aux_loss / len(batches)).backward()
        losses.append(float(ce))
        balances.append(float(out.aux_loss))
    report = s.step()
    assert report.loss == pytest.approx(sum(losses), abs=1e-6)
    assert report.router_loss == pytest.approx(sum(balances) / 2, abs=1e-6)
    theirs = dict(ref.named_parameters())
    before = dict(nt.load_model(heavy).named_parameters())
    for name, p in s.model.named_parameters():
        expected = before[name].detach() - report.lr * their_grad(theirs, name)
        torch.testing.assert_close(p.detach(), expected, atol=1e-6, rtol=0, msg=name)
    assert "balance" in repr(report)


def test_transformers_5s_fused_experts_read_as_the_hubs(folder, tmp_path):
    """A file with each layer's experts as [experts, 2 x width, hidden] gate_up_proj and
    [experts, hidden, width] down_proj (transformers 5's modules) gives the same model as the
    Hub's one-weight-per-expert file; a merged save writes the Hub's layout."""
    weights = load_file(str(folder / "model.safetensors"))
    fused, experts = {}, 4
    for key, value in weights.items():
        if ".experts." not in key:
            fused[key] = value
        elif key.endswith(".experts.0.gate_proj.weight"):
            layer = key.partition(".experts.")[0]
            fused[f"{layer}.experts.gate_up_proj"] = torch.stack([
                torch.cat([weights[f"{layer}.experts.{e}.gate_proj.weight"],
                           weights[f"{layer}.experts.{e}.up_proj.weight"]]) for e in range(experts)])
            fused[f"{layer}.experts.down_proj"] = torch.stack([
                weights[f"{layer}.experts.{e}.down_proj.weight"] for e in range(experts)])
    (tmp_path / "fused").mkdir()
    shutil.copy(folder / "config.json", tmp_path / "fused" / "config.json")
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"))
    hub, ours = nt.load_model(folder), nt.load_model(tmp_path / "fused")
    for (name, a), (_, b) in zip(hub.state_dict().items(), ours.state_dict().items()):
        assert torch.equal(a, b), name
    nt.save_model(ours, tmp_path / "saved")
    assert load_file(str(tmp_path / "saved" / "model.safetensors")).keys() == weights.keys()


def test_experts_are_a_lora_target_off_by_default_and_nf4_under_qlora(folder):
    """LoRA adapts attention and the dense layer's MLP by default, the experts only when
    named; QLoRA stores every expert as NF4 either way (they are most of the weights)."""
    def adapted(s):
        return {n.split(".lora_A")[0] for n, _ in s.model.named_parameters() if "lora_A" in n}

    plain = adapted(session(folder, method="lora"))
    assert plain and not any(".experts." in n for n in plain)
    assert any(".mlp.gate_proj" in n for n in plain)  # the dense layer's
    both = adapted(session(folder, method="lora", lora_targets=("q_proj", "experts")))
    assert sum(".experts." in n for n in both) == 4 * 3 and not any(".mlp.gate_proj" in n for n in both)
    q = session(folder, method="qlora", optimizer="adamw", lr=1e-2)
    experts = [m.weight for n, m in q.model.named_modules()
               if isinstance(m, torch.nn.Linear) and ".experts." in n]
    assert len(experts) == 12 and all(is_nf4(w) for w in experts)
    assert all(type(m) is NF4Linear for n, m in q.model.named_modules() if ".experts." in n
               and isinstance(m, torch.nn.Linear))  # nbtune's NF4 product, not torchao's slower one
    assert not is_nf4(q.model.model.layers[0].mlp.gate.weight)  # the router stays dense
    losses = [q.step().loss for _ in range(3)]
    assert losses[-1] < losses[0]


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def with_tokenizer(folder, tmp_path):
    """A copy of the base with the byte tokenizer beside it (what an adapter is loaded on)."""
    base = tmp_path / "base"
    shutil.copytree(folder, base)
    byte_tokenizer().save(base)
    return base


@pytest.mark.parametrize("targets", [ATTENTION, ATTENTION + ("experts",)])
def test_an_adapter_on_attention_and_experts_loads_in_peft_and_back(folder, tmp_path, targets):
    """Attention only and the experts too: PEFT on transformers 5 loads the adapter, the
    experts' onto its fused experts (``target_parameters``), with nbtune's logits, and nbtune
    reads it back to the same adapters. The dense layer's MLP (the default targets) is refused
    by name: transformers 5 reads those names as the fused experts'."""
    import peft

    if targets == ATTENTION:
        with pytest.raises(ValueError, match="dense down_proj, gate_proj, up_proj.*fused experts.*merge=True"):
            session(folder, method="lora").save(tmp_path / "refused")
        assert not (tmp_path / "refused").exists()
    s = session(folder, method="lora", lora_targets=targets)
    with torch.no_grad():
        for n, p in s.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    ids = torch.randint(3, 250, (1, 30), generator=torch.Generator().manual_seed(4))
    s.model.eval()
    with torch.no_grad():
        ours = s.model(ids)
    s.save(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert ("target_parameters" in config) == ("experts" in targets)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours, atol=1e-5, rtol=0)
    back = nt.Session.from_pretrained(tmp_path / "adapter", ROWS, base=with_tokenizer(folder, tmp_path),
                                      device="cpu")
    mine = dict(s.model.named_parameters())
    for n, p in back.model.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, mine[n]), n


def test_a_fused_expert_adapter_trained_in_peft_is_refused_by_name(folder, tmp_path):
    """PEFT adapts gate_up_proj as one fused weight; nbtune adapts gate and up each on its
    own, so an update coupling them cannot be held: refused naming it, nothing loaded."""
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    model.save_pretrained(tmp_path / "theirs")
    base = with_tokenizer(folder, tmp_path)
    with pytest.raises(ValueError, match="not the two rank-4 halves.*Load it with PEFT"):
        nt.Session.from_pretrained(tmp_path / "theirs", ROWS, base=base, device="cpu")
    settings = json.loads((tmp_path / "theirs" / "adapter_config.json").read_text())
    settings.update(r=2, lora_alpha=4.0, rank_pattern={"mlp.experts.gate_up_proj": 4},
                    alpha_pattern={"mlp.experts.gate_up_proj": 8.0})  # as nbtune writes its own
    (tmp_path / "theirs" / "adapter_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="not separate gate and up halves"):
        nt.Session.from_pretrained(tmp_path / "theirs", ROWS, base=base, device="cpu")


def test_the_estimate_assumes_balanced_routing_and_offers_the_worst(folder):
    """The measured step (the real routing) equals the balanced estimate within 2 %; every
    token to the same experts makes a larger expert temporary, never a smaller peak."""
    s = session(folder, method="lora", activation_checkpointing=True)
    s.memory_tracking = "every_step"
    reports = [s.step() for _ in range(3)]
    shape = reports[-1].shape
    balanced = s.estimate(batch_size=shape[0], seq_len=shape[1])
    assert abs(balanced.peak - reports[-1].memory.peak) <= 0.02 * reports[-1].memory.peak
    t = s.techniques.replace(batch_size=shape[0], seq_len=shape[1])
    worst = nt.estimate(s.model.config, t, routing="worst")
    assert worst.peak >= balanced.peak
    with pytest.raises(ValueError, match="routing='best'"):
        nt.estimate(s.model.config, t, routing="best")


def test_routing_sets_how_many_tokens_each_expert_runs():
    block = SparseMoE(nt.ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1,
                                     num_heads=2, num_kv_heads=2, head_dim=4, model_type="qwen3_moe",
                                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4))
    assigned = torch.tensor([0, 0, 0, 1, 1, 2])
    assert block._counts(assigned, 3) == [3, 2, 1, 0]  # counted
    block.routing = "balanced"
    assert block._counts(assigned, 3) == [2, 2, 1, 1]
    block.routing = "worst"
    assert block._counts(assigned, 3) == [3, 3, 0, 0]
    copy.deepcopy(block)  # plain module state


def test_a_checkpointed_layers_recompute_keeps_no_routing_graph(folder):
    """Backward recomputes a checkpointed layer's router: what it records there would hold
    that layer's recomputed graph until the next step (115 MiB a layer at Qwen3-30B-A3B's
    size, 5 GiB over 48 layers). Only the forward's own routing is kept."""
    s = session(folder, activation_checkpointing=True, tile_tokens=16)
    s.step()
    for block in s.model.sparse_blocks:
        tokens = sum(rows for _, _, rows in block.stats)
        assert tokens == s.history[-1].shape[0] * s.history[-1].shape[1], len(block.stats)
        assert not block.recording


def test_a_config_or_file_the_experts_cannot_come_from_is_refused_by_name(folder, tmp_path):
    """No expert count, more experts over all layers than any real model (each a module to
    build), and a fused experts tensor of another shape (a zero-byte one claiming 10**12
    experts would otherwise be expanded one entry per expert) are refused with nbtune's own
    error naming what is wrong, before anything is built."""
    from nbtune.models.config import ConfigError, ModelConfig

    hf = json.loads((folder / "config.json").read_text())
    for key in ("num_experts", "num_local_experts"):
        hf.pop(key, None)
    with pytest.raises(ConfigError, match="num_experts"):
        ModelConfig.from_hf(hf, source="config.json")
    with pytest.raises(ConfigError, match="more than any real model has"):
        ModelConfig.from_hf({**hf, "num_experts": 1024, "num_hidden_layers": 64, "mlp_only_layers": []},
                            source="config.json")
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    shutil.copy(folder / "config.json", crafted / "config.json")
    header = json.dumps({"model.layers.0.mlp.experts.down_proj": {
        "dtype": "F32", "shape": [10**12, 0, 0], "data_offsets": [0, 0]}}).encode()
    (crafted / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ValueError, match="experts.down_proj"):
        nt.load_model(crafted)


def test_the_experts_target_is_the_experts_projections_not_the_adapters_inside_them():
    from nbtune.peft import target_of

    assert target_of("model.layers.3.mlp.experts.17.down_proj") == "experts"
    assert target_of("model.layers.3.mlp.experts.17.down_proj.lora_A") == "lora_A"
    assert target_of("model.layers.3.mlp.experts.17.gate_proj.base_layer") == "base_layer"
    assert target_of("model.layers.3.mlp.gate_proj") == "gate_proj"


def test_on_ranks_the_balancing_term_is_each_ranks_own_averaged(folder):
    """Backward scales a rank's loss by the ranks (its cross-entropy is divided by the global
    token count; FSDP averages the gradients): the balancing term, a rank's own mean, is
    divided by them first, so its gradient is the ranks' average, not N times it. A stand-in
    for two ranks (sums are the rank's own) against one process on the same rows: the
    cross-entropy's gradient doubles, the balancing term's does not."""
    from nbtune.step import StepContext, StepOptions, _Untracked, update

    class TwoRanks:
        world = 2

        def sum_(self, tensor):
            return tensor

    class Keep:  # an optimizer that keeps the gradients it is given
        param_groups = [{"lr": 0.0}]

        def __init__(self, model):
            self.model, self.grads = model, None

        def step(self):
            self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}

        def zero_grad(self, set_to_none=True):
            self.model.zero_grad(set_to_none=set_to_none)

    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(8))
    batch = {"input_ids": ids, "labels": ids.clone()}

    def grads(coef, parallel):
        model = nt.load_model(folder)
        model.config = model.config.replace(router_aux_loss_coef=coef)
        keep = Keep(model)
        update(model, keep, [batch], int(ids.numel()), _Untracked(), StepOptions(),
               StepContext(parallel=parallel))
        return keep.grads["model.layers.0.mlp.gate.weight"]

    ce, balance = grads(0.0, None), grads(1.0, None) - grads(0.0, None)
    assert balance.abs().max() > 1e-4  # the term reaches the router
    torch.testing.assert_close(grads(1.0, TwoRanks()), 2 * ce + balance, atol=1e-6, rtol=1e-4)
