"""Every field of ``Techniques`` takes effect: one table row per field.

Each row changes one field to a value that runs on CPU and says how to see it on the
built object (the model, the optimizer, the batch stream, the step's calls). Every row
is tried twice:

(a) set at build time, ``small_session(field=value)``;
(b) changed on a live session with ``session.set(field=value)`` after one step.

Fields that change the maths must change the next steps' losses against an unchanged
twin (same companions in ``base``); memory techniques must leave them equal within 1e-5.
Fields that only CUDA runs (``cuda_only``) must be refused on CPU by the rules table,
naming the field and leaving the session as it was.

A new ``Techniques`` field without a row fails ``test_table_has_one_row_per_field``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
from torch import nn

import nbtune.activations
import nbtune.loss
import nbtune.step
from nbtune.optim import OptimizerInBackward
from nbtune.peft import LoRALinear, is_nf4
from nbtune.techniques import LORA_TARGETS, RULES, Techniques

from helpers import small_session

EQUAL_ATOL = 1e-5  # memory techniques: same maths up to float reordering
DIFFERENT = 1e-4  # maths fields: the change must move a loss far above float noise (~1e-6);
# the smallest change in the table (bf16 at build time) moves it by ~1e-3
STEPS = 2  # steps compared after the change: the first shows data/forward changes, the
# second the update the first step made


@dataclass
class Context:
    """What a row's check may use besides the session."""

    value: Any
    base: dict
    changed_at: int  # steps taken before the change: 0 at build time, 1 when set live
    monkeypatch: pytest.MonkeyPatch


@dataclass
class Row:
    value: Any
    check: Callable[[Any, Context], None] | None = None  # on the built session, after the steps
    base: dict = field(default_factory=dict)  # companions for both twins
    maths: bool = True  # False: a memory technique, the losses must stay equal
    cuda_only: bool = False  # refused on CPU by a device rule


# ---- helpers the checks use ------------------------------------------------------------

def peek(session) -> dict[str, torch.Tensor]:
    """The next batch the session would train on, without moving its stream."""
    return copy.deepcopy(session.trainer.stream).next()


def lora_modules(model) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def count_forwards(session, ctx: Context) -> list[int]:
    """A list that gets one entry per forward pass (``hidden_states`` call) of the model."""
    calls = []
    original = session.model.hidden_states

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    ctx.monkeypatch.setattr(session.model, "hidden_states", counting)
    return calls


# ---- the checks, one per row -----------------------------------------------------------

# the demo model's projections: every target but Phi's fused ones
LLAMA_PROJECTIONS = set(LORA_TARGETS) - {"qkv_proj", "gate_up_proj", "experts"}


def check_method(session, ctx):
    wrapped = lora_modules(session.model)
    assert wrapped, "no LoRALinear in the model"
    assert {name.rpartition(".")[2] for name in wrapped} == LLAMA_PROJECTIONS
    trainable = {n for n, p in session.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    quantized = [is_nf4(m.base_layer.weight) for m in wrapped.values()]
    assert all(quantized) if ctx.value == "qlora" else not any(quantized)


def check_dtype(session, ctx):
    assert {p.dtype for p in session.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for g in session.optimizer.param_groups for p in g["params"]} == {torch.bfloat16}


def check_activation_checkpointing(session, ctx):
    flags = [bool(layer.checkpointed) for layer in session.model.model.layers]
    assert flags == [i % ctx.value == 0 for i in range(len(flags))]
    assert any(flags) and not all(flags)  # every Nth layer, not all or none


def check_batch_size(session, ctx):
    assert session.trainer.stream.batch_size == ctx.value
    assert peek(session)["input_ids"].shape[0] == ctx.value
    assert session.history[-1].shape[0] == ctx.value


def check_seq_len(session, ctx):
    lengths = [len(s.input_ids) for s in session.trainer.stream.samples]
    assert max(lengths) == ctx.value  # longer rows were cut to exactly seq_len
    assert peek(session)["input_ids"].shape[1] <= ctx.value
    assert session.history[-1].shape[1] <= ctx.value


def check_packing(session, ctx):
    batch = peek(session)
    assert "document_ids" in batch and "positions" in batch
    # Several examples share a row: some row holds more than one document.
    assert int(batch["document_ids"].max()) >= 1


def check_grad_accum(session, ctx):
    forwards = count_forwards(session, ctx)
    session.step()
    assert len(forwards) == ctx.value


def check_lr(session, ctx):
    assert {g["lr"] for g in session.optimizer.param_groups} == {ctx.value}
    assert [r.lr for r in session.history[ctx.changed_at:]] == [ctx.value] * STEPS


def check_warmup_steps(session, ctx):
    lr, warmup = session.techniques.lr, ctx.value
    if ctx.changed_at == 0:
        assert session.history[0].lr == pytest.approx(lr / warmup, rel=1e-12)
    for report in session.history[ctx.changed_at:]:
        expected = lr * report.step / warmup if report.step < warmup else lr
        assert report.lr == pytest.approx(expected, rel=1e-12), report.step
        assert report.lr < lr  # still warming up: the field did something
    assert {g["lr"] for g in session.optimizer.param_groups} == {session.history[-1].lr}


def check_optimizer(session, ctx):
    if ctx.value == "sgd":
        assert isinstance(session.optimizer, torch.optim.SGD)
        assert not any("exp_avg" in s for s in session.optimizer.state.values())
    else:  # adamw8bit: bitsandbytes' 8-bit AdamW, quantized state
        import bitsandbytes.optim

        assert isinstance(session.optimizer, bitsandbytes.optim.AdamW8bit)
        dtypes = {t.dtype for s in session.optimizer.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor)}
        assert torch.uint8 in dtypes


def check_optimizer_in_backward(session, ctx):
    assert isinstance(session.optimizer, OptimizerInBackward)
    # Every trainable weight has its own optimizer, stepped from its gradient hook.
    trainable = {id(p) for p in session.model.parameters() if p.requires_grad}
    stepped = {id(p) for g in session.optimizer.param_groups for p in g["params"]}
    assert stepped == trainable


def check_activation_offloading(session, ctx):
    made, packed = [], []
    original = nbtune.activations.OffloadActivations.__init__

    def counting_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(1)
        pack = self.pack_hook

        def spy(t):
            out = pack(t)
            packed.append(out is not t)
            return out

        self.pack_hook = spy

    ctx.monkeypatch.setattr(nbtune.activations.OffloadActivations, "__init__", counting_init)
    session.step()
    assert len(made) == session.techniques.grad_accum  # one context per micro-batch
    assert sum(packed) > 10  # saved activations went through the hooks and were copied


def check_chunked_loss(session, ctx):
    widths = []
    original = nbtune.loss._piece_loss

    def counting(logits, labels):  # each piece's loss, kept or recomputed
        widths.append(logits.shape[1])
        return original(logits, labels)

    ctx.monkeypatch.setattr(nbtune.loss, "_piece_loss", counting)
    report = session.step()
    T = report.shape[1]
    assert len(widths) >= ctx.value
    assert max(widths) == math.ceil(T / ctx.value)  # no call ever saw the whole sequence
    # The forward pieces (the first ones; where recomputed, backward's follow) tile the sequence.
    assert sum(widths[: ctx.value]) == T


def check_tile_tokens(session, ctx):
    widths = {"mlp": [], "head": []}
    hooks = [session.model.model.layers[-1].mlp.register_forward_pre_hook(
                 lambda m, args: widths["mlp"].append(args[0].shape[1])),
             session.model.lm_head.register_forward_pre_hook(
                 lambda m, args: widths["head"].append(args[0].shape[1]))]
    report = session.step()
    for hook in hooks:
        hook.remove()
    T = report.shape[1]
    assert T > ctx.value
    # no call saw the whole sequence; forward covers it once, backward's recompute again
    for seen in widths.values():
        assert seen and max(seen) <= ctx.value and sum(seen) == 2 * T
    assert max(widths["mlp"]) == ctx.value  # the MLP in tiles of exactly that, the last short


def check_max_grad_norm(session, ctx):
    calls = []
    utils = nbtune.step.torch.nn.utils  # as the training step looks it up
    original = utils.clip_grad_norm_

    def spy(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        calls.append((max_norm, len(parameters)))
        return original(parameters, max_norm, *args, **kwargs)

    ctx.monkeypatch.setattr(utils, "clip_grad_norm_", spy)
    session.step()
    trainable = len({id(p) for p in session.model.parameters() if p.requires_grad})
    assert calls == [(ctx.value, trainable)]


def check_weight_decay(session, ctx):
    assert {g["weight_decay"] for g in session.optimizer.param_groups} == {ctx.value}


def check_lora_rank(session, ctx):
    modules = lora_modules(session.model).values()
    assert modules
    for m in modules:
        assert m.lora_A.weight.shape == (ctx.value, m.base_layer.in_features)
        assert m.lora_B.weight.shape == (m.base_layer.out_features, ctx.value)
        assert m.rank == ctx.value


def check_lora_alpha(session, ctx):
    modules = lora_modules(session.model).values()
    assert modules
    for m in modules:
        assert m.alpha == ctx.value
        assert m.scaling == pytest.approx(ctx.value / session.techniques.lora_rank)


def check_lora_dropout(session, ctx):
    modules = lora_modules(session.model).values()
    assert modules
    for m in modules:
        assert isinstance(m.lora_dropout, nn.Dropout) and m.lora_dropout.p == ctx.value


def check_lora_targets(session, ctx):
    wrapped = {name.rpartition(".")[2] for name in lora_modules(session.model)}
    assert wrapped == set(ctx.value)
    plain = {name.rpartition(".")[2] for name, m in session.model.named_modules()
             if type(m) is nn.Linear and ".lora_" not in name and not name.endswith("base_layer")}
    assert plain == LLAMA_PROJECTIONS - set(ctx.value) | {"lm_head"}


def check_eval_every(session, ctx):
    """Every step after the change carries a held-out loss equal to one computed here."""
    import torch.nn.functional as F

    from nbtune.data import IGNORE

    reports = session.history[ctx.changed_at:]
    assert all(r.eval_loss is not None for r in reports)
    assert all(r.eval_loss is None for r in session.history[:ctx.changed_at])
    assert reports[-1].memory.eval_peak > 0
    total, count = 0.0, 0
    session.model.eval()
    with torch.no_grad():
        for batch in session.data.eval_batches(session.techniques):
            logits = session.model(batch["input_ids"]).float()  # labels come shifted
            labels = batch["labels"]
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                     ignore_index=IGNORE, reduction="sum").item()
            count += int((labels != IGNORE).sum())
    session.model.train()
    assert count > 0 and reports[-1].eval_loss == pytest.approx(total / count, rel=1e-5)


def check_seed(session, ctx):
    # A twin on the default seed, moved to the same epoch and position: its next batch
    # is what this session would read if the seed had not reached the data order.
    twin = small_session(**ctx.base).trainer.stream
    stream = session.trainer.stream
    for _ in range(1000):
        if (twin.epoch, twin.position) == (stream.epoch, stream.position):
            break
        twin.next()
    assert (twin.epoch, twin.position) == (stream.epoch, stream.position)
    assert not torch.equal(copy.deepcopy(twin).next()["input_ids"], peek(session)["input_ids"])


def check_objective(session, ctx):
    """The batches are pairs (chosen rows, then rejected) and the reports carry their rewards;
    the reported loss is SimPO's of each pair's average log-probs, computed here."""
    import torch.nn.functional as F

    from nbtune.objectives.preference import completion_logps

    t = session.techniques
    batch = peek(session)
    assert batch["input_ids"].shape[0] == 2 * t.batch_size
    assert all(r.preference is not None for r in session.history[ctx.changed_at:])
    with torch.no_grad():  # the next step's loss, before its update
        scores = completion_logps(session.model(batch["input_ids"]), batch["labels"])
        chosen, rejected = scores.mean.chunk(2)
        expected = -F.logsigmoid(t.beta * (chosen - rejected) - t.gamma).mean()
    assert session.step().loss == pytest.approx(float(expected), abs=1e-5)


def recorded_pair_terms(session, ctx) -> list[tuple]:
    """(beta, gamma) the step hands the preference loss, one entry a micro-batch."""
    import nbtune.objectives.preference as preference

    calls, original = [], preference.pair_terms

    def recording(objective, chosen, rejected, reference, beta, gamma):
        calls.append((beta, gamma))
        return original(objective, chosen, rejected, reference, beta, gamma)

    ctx.monkeypatch.setattr(preference, "pair_terms", recording)
    session.step()
    return calls


def check_reference(session, ctx):
    """Precomputed: the batches carry each row's reference log-prob, equal to the base's
    (adapters off) computed here, and the step runs no reference forward (one a step)."""
    from nbtune.objectives.preference import completion_logps
    from nbtune.peft import adapters_off

    batch = peek(session)
    with torch.no_grad(), adapters_off(session.model):
        expected = completion_logps(session.model(batch["input_ids"]), batch["labels"]).logps
    torch.testing.assert_close(batch["reference_logps"], expected, atol=1e-5, rtol=0)
    forwards = count_forwards(session, ctx)
    session.step()
    assert len(forwards) == 1


def check_split_pairs(session, ctx):
    """Two passes a batch of pairs: each half's rows without gradients (the loss and the rows'
    weights), the reference's halves, then each half again with gradients: every forward of
    the model reads batch_size rows, never the 2 × batch_size of a whole pair batch."""
    rows = []
    original = session.model.hidden_states
    ctx.monkeypatch.setattr(session.model, "hidden_states",
                            lambda ids, **kw: rows.append(ids.shape[0]) or original(ids, **kw))
    session.step()
    assert rows == [session.techniques.batch_size] * 6


def check_reference_copy(session, ctx):
    """A frozen copy runs the reference's forward (the model runs only the policy's), and it
    holds the weights the objective started with, apart from the model's."""
    copy = session.trainer.reference_copy
    forwards, copied = count_forwards(session, ctx), []
    original = copy.model.hidden_states
    ctx.monkeypatch.setattr(copy.model, "hidden_states", lambda *a, **k: copied.append(1) or original(*a, **k))
    session.step()
    assert len(forwards) == 1 and len(copied) == 1
    mine = dict(session.model.named_parameters())
    assert all(p.data_ptr() != mine[n].data_ptr() for n, p in copy.model.named_parameters())


def check_beta(session, ctx):
    assert recorded_pair_terms(session, ctx) == [(ctx.value, session.techniques.gamma)]


def check_gamma(session, ctx):
    assert recorded_pair_terms(session, ctx) == [(session.techniques.beta, ctx.value)]


def recorded_grpo(session, ctx, name: str) -> list[tuple]:
    """The calls the next step makes to ``nbtune.objectives.grpo``'s function ``name``:
    (args, kwargs) each."""
    import nbtune.objectives.grpo as grpo

    calls, original = [], getattr(grpo, name)

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    ctx.monkeypatch.setattr(grpo, name, recording)
    return calls


def check_generations(session, ctx):
    report = session.step()
    assert report.shape[0] == session.techniques.batch_size * ctx.value
    assert all(r.rollouts is not None for r in session.history[ctx.changed_at:])


def check_max_completion(session, ctx):
    lengths = recorded_grpo(session, ctx, "generate_group")
    session.step()
    assert lengths and all(kwargs["max_new"] == ctx.value for _, kwargs in lengths)
    assert all(r.rollouts.completion_length <= ctx.value for r in session.history[ctx.changed_at:])
    assert session.history[-1].shape[1] <= session.techniques.seq_len


def check_sampling(field):
    def check(session, ctx):
        calls = recorded_grpo(session, ctx, "sample_rows")
        scored = recorded_grpo(session, ctx, "token_logps")
        session.step()
        position = {"rollout_temperature": 1, "rollout_top_p": 2}[field]
        assert calls and {args[position] for args, _ in calls} == {ctx.value}
        if field == "rollout_temperature":  # the update scores the completions at that temperature too
            assert scored and {args[4] for args, _ in scored} == {ctx.value}
    return check


def check_kl(session, ctx):
    losses = recorded_grpo(session, ctx, "token_losses")
    forwards = count_forwards(session, ctx)
    report = session.step()
    assert losses and {args[5] for args, _ in losses} == {ctx.value}
    assert all(args[3] is not None for args, _ in losses)  # the reference's log-probs
    assert report.mean_kl is not None and report.mean_kl > 0
    # generation's forwards, then the reference (adapters off) and the policy: two per micro-batch
    assert len(forwards) >= 2 * session.techniques.grad_accum


def check_grpo_loss(session, ctx):
    kinds = recorded_grpo(session, ctx, "aggregate")
    session.step()
    assert kinds and {args[2] for args, _ in kinds} == {ctx.value}


def check_scale_rewards(session, ctx):
    made = recorded_grpo(session, ctx, "advantages")
    session.step()
    assert made and {args[2] for args, _ in made} == {False}
    total = made[0][0][0].view(-1, session.techniques.generations)
    torch.testing.assert_close(nbtune_grpo().advantages(*made[0][0]),
                               (total - total.mean(1, keepdim=True)).flatten())


def nbtune_grpo():
    import nbtune.objectives.grpo as grpo

    return grpo


def check_kv_cache(session, ctx):
    """The writing's caches are 8-bit ones, and the step's completions are those a cache of
    the model's dtype writes (here no draw flips: the rounding is within 1/254 of a vector)."""
    from nbtune.models.decoder import Int8KVCache

    made = []
    original = session.model.new_cache
    ctx.monkeypatch.setattr(session.model, "new_cache", lambda **kw: made.append(original(**kw)) or made[-1])
    session.step()
    assert made and all(isinstance(c, Int8KVCache) for c in made)
    assert all(c.keys[0].dtype == torch.int8 for c in made)


def check_generation_batch(session, ctx):
    groups = recorded_grpo(session, ctx, "generate_group")
    session.step()
    assert groups and {kwargs["at_once"] for _, kwargs in groups} == {ctx.value}


LORA = {"method": "lora", "lr": 1e-2}  # a larger lr so adapters move the loss visibly
PAIRS = {"objective": "sft"}  # the rows are preference pairs: sft trains on the chosen ones
SIMPO = {"objective": "simpo"}  # reference-free: trains with full finetuning
DPO_LORA = {"objective": "dpo", "method": "lora", "lr": 1e-2}  # the base with adapters off by default
SGD = {"optimizer": "sgd", "lr": 0.1}  # no state to reset when the optimizer is rebuilt
GRPO = {"objective": "grpo"}  # small_session's prompts, rewards and shape (helpers.GRPO_BASE)
# kl > 0 from the start: the base is then the model GRPO started from (set later, it is refused)
GRPO_LORA = {"objective": "grpo", "method": "lora", "lr": 5e-2, "kl": 0.01}

TABLE: dict[str, Row] = {
    "method": Row("lora", check_method),
    "dtype": Row("bf16", check_dtype),
    "activation_checkpointing": Row(2, check_activation_checkpointing, maths=False),
    "batch_size": Row(2, check_batch_size),
    "seq_len": Row(78, check_seq_len),  # rows are 78-81 tokens: cuts some, drops some
    "packing": Row(True, check_packing, base={"seq_len": 192}),  # two examples per row
    "grad_accum": Row(2, check_grad_accum),
    "lr": Row(3e-3, check_lr),
    "warmup_steps": Row(5, check_warmup_steps),
    "optimizer": Row("sgd", check_optimizer),
    # Exact for SGD (AdamW's state would be reset by the live rebuild, which is not the maths).
    "optimizer_in_backward": Row(True, check_optimizer_in_backward, base=SGD, maths=False),
    "cpu_offload_optimizer": Row(True, cuda_only=True),  # CUDA only: refused on CPU
    "activation_offloading": Row(True, check_activation_offloading, maths=False),
    "chunked_loss": Row(4, check_chunked_loss, maths=False),
    "tile_tokens": Row(32, check_tile_tokens, maths=False),
    "compile": Row(True, cuda_only=True),  # CUDA only: refused on CPU
    "max_grad_norm": Row(0.05, check_max_grad_norm, base=SGD),
    "weight_decay": Row(20.0, check_weight_decay),
    "lora_rank": Row(4, check_lora_rank, base=LORA),
    "lora_alpha": Row(64.0, check_lora_alpha, base=LORA),
    "lora_dropout": Row(0.5, check_lora_dropout, base=LORA),
    "lora_targets": Row(("q_proj", "v_proj"), check_lora_targets, base=LORA),
    "seed": Row(1, check_seed),
    # Evaluation must not touch the training: losses equal, the held-out loss checked here.
    "eval_every": Row(1, check_eval_every, maths=False),
    "objective": Row("simpo", check_objective, base=PAIRS),
    "beta": Row(1.0, check_beta, base=SIMPO),
    "gamma": Row(2.0, check_gamma, base=SIMPO),
    # LoRA's base is frozen: its log-probs computed once are those it gives every step
    "reference": Row("precomputed", check_reference, base=DPO_LORA, maths=False),
    "split_pairs": Row(True, check_split_pairs, base=DPO_LORA, maths=False),
    "generations": Row(3, check_generations, base=GRPO),
    "max_completion": Row(8, check_max_completion, base=GRPO),
    "rollout_temperature": Row(0.5, check_sampling("rollout_temperature"), base=GRPO),
    "rollout_top_p": Row(0.6, check_sampling("rollout_top_p"), base=GRPO),
    "kl": Row(0.5, check_kl, base=GRPO_LORA),
    "grpo_loss": Row("grpo", check_grpo_loss, base=GRPO),
    "scale_rewards": Row(False, check_scale_rewards, base=GRPO),
    # each completion draws from its own generator: how many are written at once is memory only
    "generation_batch": Row(1, check_generation_batch, base=GRPO, maths=False),
    # rounding within 1/254 of each cached vector: on the demo no sampled token flips
    "kv_cache": Row("int8", check_kv_cache, base=GRPO, maths=False),
}

# Second values of a field, tried the same way (not part of the one-row-per-field count).
EXTRA: dict[str, tuple[str, Row]] = {
    # full finetuning: the copy moved from the host to the device, the same losses
    "reference=copy": ("reference", Row("copy", check_reference_copy, maths=False,
                                        base={"objective": "dpo", "method": "full", "reference": "copy_host"})),
    "method=qlora": ("method", Row("qlora", check_method)),
    # Against SGD: bitsandbytes' first update is AdamW's exactly (the state is quantized
    # only after it is used), so against AdamW the losses part only from the third step.
    "optimizer=adamw8bit": ("optimizer", Row("adamw8bit", check_optimizer, base=SGD)),
}

CASES = [pytest.param(name, row, id=name) for name, row in TABLE.items()]
CASES += [pytest.param(name, row, id=case) for case, (name, row) in EXTRA.items()]
CPU_CASES = [c for c in CASES if not c.values[1].cuda_only]  # maths or memory
CUDA_CASES = [c for c in CASES if c.values[1].cuda_only]

_twin_traces: dict = {}


pytestmark = pytest.mark.usefixtures("one_thread")


def twin_trace(base: dict) -> list[float]:
    """Losses of ``STEPS + 1`` steps of an unchanged session (shared by the rows' twins)."""
    key = tuple(sorted(base.items()))
    if key not in _twin_traces:
        session = small_session(**base)
        _twin_traces[key] = [session.step().loss for _ in range(STEPS + 1)]
    return _twin_traces[key]


def compare(losses: list[float], twin: list[float], row: Row, name: str) -> None:
    assert all(math.isfinite(x) for x in losses), losses
    gap = max(abs(a - b) for a, b in zip(losses, twin))
    if row.maths:
        assert gap > DIFFERENT, f"{name}={row.value!r} left the losses as they were: {losses} vs {twin}"
    else:
        assert gap <= EQUAL_ATOL, f"{name}={row.value!r} changed the maths: {losses} vs {twin}"


# ---- the tests -------------------------------------------------------------------------

def test_table_has_one_row_per_field():
    assert set(TABLE) == {f.name for f in dataclasses.fields(Techniques)}


def test_rows_change_their_field_and_cuda_rows_are_the_device_rules():
    defaults = Techniques()
    cuda_fields = {r.fields[0] for r in RULES if r.device == "cuda" and len(r.fields) == 1}
    for name, row in list(TABLE.items()) + list(EXTRA.values()):
        assert row.value != getattr(defaults, name) and row.value != row.base.get(name), name
        changed = Techniques(**{**row.base, name: row.value})
        cpu_rules = changed.conflicts("cpu")
        if row.cuda_only:
            assert name in cuda_fields and cpu_rules and not changed.conflicts("cuda"), name
            assert all(rule.device == "cuda" for rule in cpu_rules), name
        else:
            assert not cpu_rules and row.check is not None, name


@pytest.mark.slow  # (the fast tier sets every field on a live session, the harder path)
@pytest.mark.parametrize("name, row", CPU_CASES)
def test_field_set_at_build_time_takes_effect(name, row, monkeypatch):
    session = small_session(**{**row.base, name: row.value})
    assert getattr(session.techniques, name) == row.value
    losses = [session.step().loss for _ in range(STEPS)]
    compare(losses, twin_trace(row.base)[:STEPS], row, name)
    row.check(session, Context(row.value, row.base, 0, monkeypatch))


@pytest.mark.parametrize("name, row", CPU_CASES)
def test_field_set_on_a_live_session_takes_effect(name, row, monkeypatch):
    session = small_session(**row.base)
    session.step()
    session.set(**{name: row.value})
    assert getattr(session.techniques, name) == row.value
    losses = [session.step().loss for _ in range(STEPS)]
    compare(losses, twin_trace(row.base)[1:STEPS + 1], row, name)
    row.check(session, Context(row.value, row.base, 1, monkeypatch))


@pytest.mark.parametrize("name, row", CUDA_CASES)
def test_cuda_only_field_is_refused_at_build_time(name, row):
    with pytest.raises(ValueError, match=name):
        small_session(**{**row.base, name: row.value})


@pytest.mark.parametrize("name, row", CUDA_CASES)
def test_cuda_only_field_is_refused_on_a_live_session(name, row):
    session = small_session(**row.base)
    session.step()
    before = session.techniques
    optimizer = session.optimizer
    with pytest.raises(ValueError, match=name):
        session.set(**{name: row.value})
    assert session.techniques == before and getattr(session.techniques, name) != row.value
    assert session.optimizer is optimizer
    losses = [session.step().loss for _ in range(STEPS)]
    # Nothing was half-applied: the session goes on exactly as its unchanged twin.
    torch.testing.assert_close(losses, twin_trace(row.base)[1:STEPS + 1], atol=EQUAL_ATOL, rtol=0)
