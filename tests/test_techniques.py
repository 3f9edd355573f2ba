"""Memory techniques that must not change the maths, and what each one buys (CPU, fp32)."""

import pytest
import torch

from nbtune.activations import set_compiled
from nbtune.loss import cross_entropy_sum
from nbtune.techniques import RULES

from helpers import small_session


def trace(session, steps=5):
    return [session.step().loss for _ in range(steps)]


def assert_equal_runs(a, b, atol=1e-5):
    torch.testing.assert_close(trace(a), trace(b), atol=atol, rtol=0)
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("changes", [
    dict(activation_offloading=True),
    dict(activation_offloading=True, activation_checkpointing=True),
    dict(chunked_loss=4),
    dict(chunked_loss=3, activation_checkpointing=2),
])
def test_technique_does_not_change_the_maths(changes):
    assert_equal_runs(small_session(**changes), small_session())


def test_offloading_really_moves_saved_tensors(monkeypatch):
    from nbtune import activations

    packed = []
    original = activations.OffloadActivations.__init__

    def counting_init(self, model, min_bytes=1024, to=None):
        original(self, model, min_bytes, to)
        pack = self.pack_hook

        def spy(t):
            out = pack(t)
            packed.append(out is not t)
            return out

        self.pack_hook = spy

    monkeypatch.setattr(activations.OffloadActivations, "__init__", counting_init)
    small_session(activation_offloading=True).step()
    assert sum(packed) > 10 and not all(packed)  # activations copied, parameters left alone


def test_chunked_loss_lowers_the_peak_at_the_loss():
    # A wide vocabulary relative to the model makes the logits the largest activation.
    plain = small_session(batch_size=16).step().memory
    chunked = small_session(batch_size=16, chunked_loss=8).step().memory
    logits_fp32 = 16 * 80 * 259 * 4  # batch x ~tokens x vocab x fp32, order of magnitude
    assert chunked.activations < plain.activations - logits_fp32 / 2
    # the logits live at the end of forward: that phase's peak drops; the step's peak may sit in
    # a layer's backward instead (at this 259-token vocabulary), which chunking does not touch
    assert chunked.phases["forward"]["peak"] < plain.phases["forward"]["peak"] - logits_fp32 / 2
    assert chunked.peak <= plain.peak


def test_chunked_loss_equals_plain_loss_and_gradient():
    session = small_session()
    batch = session.trainer.stream.next()
    hidden = session.model.hidden_states(batch["input_ids"])
    grads = []
    for chunks in (0, 5):
        h = hidden.detach().requires_grad_()
        loss = cross_entropy_sum(session.model.lm_head, h, batch["labels"], chunks)
        loss.backward()
        grads.append((loss.detach(), h.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(grads[1][1], grads[0][1], atol=1e-6, rtol=0)


def test_compiled_layers_and_loss_match_eager():
    session = small_session()
    batch = session.trainer.stream.next()
    model = session.model
    with torch.no_grad():
        eager = cross_entropy_sum(model.lm_head, model.hidden_states(batch["input_ids"]), batch["labels"])
        set_compiled(model, True)
        compiled = cross_entropy_sum(model.lm_head, model.hidden_states(batch["input_ids"]),
                                     batch["labels"], compiled=True)
        set_compiled(model, False)
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    torch.testing.assert_close(compiled, eager, atol=1e-3, rtol=1e-5)


@pytest.mark.slow
def test_a_compiled_layer_compiles_once_more_for_a_new_length_then_never_again():
    """On an H200 compiled steps of 80 and 81 tokens recompiled again and again (8.1, 5.9,
    8.7 s each): ``is_causal=T > 1`` was a symbolic bool once the length went dynamic, SDPA
    refused it, and the graph broke there. Now: one graph, one dynamic recompile, no break."""
    from torch._dynamo.utils import counters

    from nbtune.models.decoder import DecoderLayer, rope_tables

    torch._dynamo.reset()
    counters.clear()
    config = small_session().model.config
    layer = DecoderLayer(config, 0)
    layer.train()
    layer.compile()
    graphs = []
    for tokens in (8, 9, 8, 9, 10):
        x = torch.randn(2, tokens, config.hidden_size, requires_grad=True)
        cos, sin = rope_tables(config, torch.arange(tokens), torch.float32)
        layer(x, cos, sin).sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert graphs == [1, 2, 2, 2, 2]
    torch._dynamo.reset()


def test_clipping_bounds_the_update():
    clipped, free = small_session(lr=1.0, optimizer="sgd", max_grad_norm=1e-3), small_session(lr=1.0, optimizer="sgd")
    start = {n: p.detach().clone() for n, p in free.model.named_parameters()}
    clipped.step(), free.step()
    moved = lambda s: torch.cat([(p - start[n]).flatten() for n, p in s.model.named_parameters()]).norm()
    assert moved(clipped) <= 1e-3 * 1.01 < moved(free)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.fields[0])
def test_every_rule_says_why_and_changes_nothing(rule):
    session = small_session()
    values = {"optimizer_in_backward": True, "grad_accum": 2, "max_grad_norm": 1.0,
              "cpu_offload_optimizer": True, "optimizer": "paged_adamw8bit", "compile": True}
    # A device rule breaks on this CPU session with its first field alone.
    change = {f: values[f] for f in (rule.fields[:1] if rule.device else rule.fields)}
    before = session.techniques
    with pytest.raises(ValueError) as err:
        session.set(**change)
    assert rule.reason in str(err.value)
    assert session.techniques is before
    session.step()


def test_device_rules_refuse_at_construction_too():
    with pytest.raises(ValueError, match="Paged optimizers"):
        small_session(optimizer="paged_adamw")


def test_eight_bit_optimizer_through_the_session_shows_in_the_breakdown():
    session = small_session()
    exact = [session.step().memory.optimizer_state for _ in range(2)][-1]
    session.set(optimizer="adamw8bit")
    small = [session.step().memory.optimizer_state for _ in range(2)][-1]
    assert 0 < small <= 0.3 * exact
