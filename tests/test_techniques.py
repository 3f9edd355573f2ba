"""Memory techniques that must not change the maths, and what each one buys (CPU, fp32)."""

import pytest
import torch

import nbtune.loss
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


def test_recomputed_loss_pieces_do_not_change_the_maths(monkeypatch):
    """The demo's full finetuning keeps its pieces; recomputed (as LoRA's are), with gradient
    accumulation too, the run is the plain one's."""
    from nbtune.predict import Predictor

    monkeypatch.setattr(Predictor, "keeps_loss_pieces", lambda self, t: False)
    assert_equal_runs(small_session(chunked_loss=3, grad_accum=2),
                      small_session(grad_accum=2))


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


def test_pieces_with_gradients_in_forward_equal_recomputed_pieces_and_an_independent_whole_loss():
    """A chunked loss whose pieces make their gradients in forward gives bit for bit the loss
    and gradients (the hidden states', the head's and the final norm's) of one that recomputes
    them, over the caller's token count, and both equal those of the whole logits computed here
    from the head's weight, under a later factor too (backward scales what forward made)."""
    session = small_session(method="full")
    batch = session.trainer.stream.next()
    head, norm = session.model.lm_head, session.model.model.norm
    hidden = session.model.hidden_states(batch["input_ids"], normed=False).detach()
    trained = 1000
    for factor in (1.0, 0.37):
        runs = []
        for recompute in (True, False, None):
            h = hidden.clone().requires_grad_()
            head.weight.grad = norm.weight.grad = None
            if recompute is None:  # the reference: whole logits, torch's own cross-entropy
                loss = torch.nn.functional.cross_entropy(
                    (norm(h) @ head.weight.T).flatten(0, 1), batch["labels"].flatten(),
                    reduction="sum") / trained
            else:
                loss = cross_entropy_sum(head, h, batch["labels"], 5, norm=norm,
                                         recompute=recompute, divisor=trained)
            (loss * factor).backward()
            runs.append((loss.detach(), h.grad, head.weight.grad.clone(), norm.weight.grad.clone()))
        if factor == 1.0:
            assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
        for ours in runs[:2]:
            for got, whole in zip(ours, runs[2]):
                torch.testing.assert_close(got, whole, atol=1e-6, rtol=1e-4)


def test_gradients_in_forward_hold_less_than_kept_log_probabilities_and_no_more_than_recomputing():
    """Pieces whose gradients are made in forward hold no float32 log-probabilities for
    backward: their peak is under torchtune's kept pieces (every piece's logits, then each
    piece's loss; written here) by most of those log-probabilities, and no higher than the
    pieces recomputed in backward, at the same gradients. bf16, a head as wide as 125M's
    relative to its pieces; live bytes counted by a dispatch mode here, not nbtune's tracker."""
    import weakref

    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map_only

    class Live(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes, self.now, self.peak = {}, 0, 0

        def see(self, t):
            key = t.untyped_storage()._cdata
            if key not in self.sizes:
                self.sizes[key] = t.untyped_storage().nbytes()
                self.now += self.sizes[key]
                self.peak = max(self.peak, self.now)
                weakref.finalize(t.untyped_storage(), self.drop, key)

        def drop(self, key):
            self.now -= self.sizes.pop(key, 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tree_map_only(torch.Tensor, self.see, out)
            return out

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(256, 4096, bias=False).to(torch.bfloat16)
    hidden, labels = torch.randn(2, 128, 256, generator=g).bfloat16(), torch.randint(0, 4096, (2, 128), generator=g)

    def piece_loss(logits, y):
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")

    def piece_by_piece(h):
        return sum(piece_loss(head(x), y) for x, y in zip(h.chunk(8, 1), labels.chunk(8, 1)))

    def heads_first(h):
        logits = [head(x) for x in h.chunk(8, 1)]
        return sum(piece_loss(logits.pop(0), y) for y in labels.chunk(8, 1))

    def nbtune(recompute):
        return lambda h: cross_entropy_sum(head, h, labels, 8, recompute=recompute)

    peaks, grads = [], []
    for loss in (piece_by_piece, heads_first, nbtune(True), nbtune(False)):
        h = hidden.clone().requires_grad_()
        head.weight.grad = None
        with Live() as live:
            loss(h).backward()
        peaks.append(live.peak)
        grads.append(head.weight.grad)
    log_probs = hidden.shape[0] * hidden.shape[1] * head.out_features * 4  # 4 MiB, all pieces
    assert peaks[1] < peaks[0]  # torchtune's order: the better of the two kept orders
    assert peaks[3] <= peaks[2] < peaks[1]
    assert peaks[3] < peaks[1] - log_probs / 4, peaks  # (measured: 1.3 MiB under)
    assert torch.equal(grads[3], grads[2])
    torch.testing.assert_close(grads[3], grads[0], atol=0, rtol=0.02)


def _head_calls(trainer) -> tuple[int, int]:
    """(times the head ran, measured peak) of a step after a first (the optimizer's state is
    made by the first, as the estimate assumes)."""
    trainer.step(track=False)
    calls = []
    handle = trainer.model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    try:
        peak = trainer.step(track=True).memory.peak
    finally:
        handle.remove()
    return len(calls), peak


def _wide_vocabulary(**changes):
    """A trainer whose step peaks at the loss: a 4096-token vocabulary on a 32-wide layer."""
    import nbtune as nt
    from nbtune.data import BatchStream, Sample
    from nbtune.models import CausalLM, ModelConfig
    from nbtune.run.trainer import Trainer

    config = ModelConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    model = CausalLM(config)
    model.reset_parameters()
    ids = torch.randint(0, 4096, (16, 64), generator=torch.Generator().manual_seed(1))
    samples = [Sample(input_ids=row, labels=row.roll(-1)) for row in ids]

    class Rows:
        pad_id = 0

        def stream(self, t):
            return BatchStream(samples, t.batch_size, pad_id=0, seed=0), []

        def problems(self, t):
            return []

        def eval_batches(self, t):
            return []

    t = nt.Techniques(**{**dict(batch_size=8, seq_len=64, chunked_loss=4,
                                activation_checkpointing=True), **changes})
    return Trainer(model, Rows(), t, torch.device("cpu"))


def test_the_pieces_make_their_gradients_in_forward_where_that_raises_no_peak(monkeypatch):
    """The head runs once a piece (gradients made in forward), not twice (recomputed in
    backward), where the step peaks elsewhere (the demo model: a 259-token vocabulary) and
    where it peaks at the loss (a wide vocabulary, full and LoRA): there the measured peak
    equals the recomputed pieces' (forced here) to a few scalars. Both steps' peaks are their
    estimates'."""
    from nbtune.predict import Predictor
    from nbtune.predict.predictor import LOSS_PIECES_SLACK

    demo = small_session(batch_size=16, chunked_loss=4, seq_len=160).trainer
    predictor = Predictor.of(demo.model.config, "cpu")
    assert predictor.keeps_loss_pieces(demo.techniques)
    assert _head_calls(demo)[0] == 4

    for method in ("full", "lora"):
        wide = _wide_vocabulary(method=method)
        predictor, t = Predictor.of(wide.model.config, "cpu"), wide.techniques
        assert predictor.keeps_loss_pieces(t)
        calls, in_forward = _head_calls(wide)
        assert calls == 4
        with monkeypatch.context() as forced:
            forced.setattr(Predictor, "keeps_loss_pieces", lambda self, t: False)
            calls, recomputed = _head_calls(_wide_vocabulary(method=method))
        assert calls == 8
        assert recomputed <= in_forward <= recomputed + LOSS_PIECES_SLACK, method
        for measured, recompute in ((recomputed, True), (in_forward, False)):  # both estimated
            predicted = predictor.estimate(t, recompute_loss=recompute).peak
            assert abs(measured - predicted) <= 0.02 * predicted, (method, recompute)
    # and each estimate traces its own way: the pieces' loss runs twice a piece when recomputed
    real, calls = nbtune.loss._chunk_loss, []
    monkeypatch.setattr(nbtune.loss, "_chunk_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    counted = {}
    for recompute in (True, False):
        calls.clear()
        Predictor(wide.model.config, "cpu").estimate(t, recompute_loss=recompute)
        counted[recompute] = len(calls)
    assert counted[True] == 2 * counted[False] > 0, counted


def test_with_gradients_made_in_forward_backward_runs_without_the_hidden_states(monkeypatch):
    """Pieces that made their gradients in forward need nothing of the hidden states in
    backward, so the step lets them go before it: one [B, T, D] tensor less where a full
    finetune peaks, at the embedding's gradient (the 125M peers' chunked rung: 1.5 MB).
    (Recomputed pieces hold their slices only until their own backward, at its start.)"""
    import weakref

    from nbtune.predict import Predictor

    trainer = _wide_vocabulary()
    assert Predictor.of(trainer.model.config, "cpu").keeps_loss_pieces(trainer.techniques)
    model, seen, alive = trainer.model, [], []
    made = model.hidden_states

    def hidden_states(*args, **kwargs):
        hidden = made(*args, **kwargs)
        seen.append(weakref.ref(hidden))
        return hidden

    monkeypatch.setattr(model, "hidden_states", hidden_states)
    handle = model.model.embed_tokens.weight.register_hook(
        lambda grad: alive.append(seen[-1]() is not None))
    try:
        trainer.step(track=False)
    finally:
        handle.remove()
    assert len(seen) == 1 and alive == [False]


def test_the_sessions_estimate_takes_the_loss_pieces_as_its_step_does(monkeypatch):
    """``session.estimate()`` predicts the pieces the way the next step takes them: with
    gradients in forward where the trainer's rule says so, recomputed where it does not, and
    recomputed for several processes (they always recompute)."""
    from nbtune.predict import Predictor

    asked = []
    real = Predictor.estimate

    def spy(self, t, **kw):
        asked.append(kw.get("recompute_loss", True))
        return real(self, t, **kw)

    session = small_session(chunked_loss=4)
    for keeps in (True, False):
        monkeypatch.setattr(Predictor, "keeps_loss_pieces", lambda self, t, keeps=keeps: keeps)
        monkeypatch.setattr(Predictor, "estimate", spy)
        asked.clear()
        session.estimate(seq_len=64)
        assert asked == [not keeps]
    monkeypatch.setattr(Predictor, "keeps_loss_pieces", lambda self, t: True)
    asked.clear()
    session.estimate(ranks=2)
    assert asked == [True]


def test_an_estimate_that_breaks_leaves_the_pieces_recomputed_and_says_so(monkeypatch):
    from nbtune.predict import Predictor

    def broken(self, t):
        raise TypeError("a bug in the estimator")

    monkeypatch.setattr(Predictor, "keeps_loss_pieces", broken)
    wide = _wide_vocabulary()
    assert _head_calls(wide)[0] == 8
    assert any("TypeError: a bug in the estimator" in note for note in wide.notes)


def test_keeping_the_pieces_follows_the_two_estimates_and_never_tiles():
    from nbtune.predict import Predictor

    peaks = {True: 100, False: 100}

    def stand_in(config, t, *, recompute_loss=True, **_):
        if peaks[recompute_loss] is None:
            raise ValueError("cannot run it")
        from nbtune.memory import MemoryBreakdown
        return MemoryBreakdown(peak=peaks[recompute_loss])

    def keeps(**t):
        predictor = Predictor("qwen2.5-0.5b", "cpu", estimator=stand_in)
        return predictor.keeps_loss_pieces({"chunked_loss": 8, **t})

    from nbtune.predict.predictor import LOSS_PIECES_SLACK

    assert keeps()
    peaks[False] = 100 + LOSS_PIECES_SLACK
    assert keeps()
    peaks[False] += 1
    assert not keeps()
    peaks[False] = 100
    assert not keeps(tile_tokens=64)  # tiling recomputes by design
    assert not keeps(chunked_loss=0) and not keeps(chunked_loss=1)
    peaks[False] = None
    assert not keeps()  # an estimate that fails keeps the recompute


def test_compiled_layers_and_loss_match_eager():
    """Compiled layers and loss give eager's loss; the compiled pieces that make their
    gradients in forward (the loss compiled inside ``_GradientInForward``) give eager
    recomputed pieces' loss and gradients too."""
    session = small_session(method="full")
    batch = session.trainer.stream.next()
    model = session.model
    with torch.no_grad():
        eager = cross_entropy_sum(model.lm_head, model.hidden_states(batch["input_ids"]), batch["labels"])
        set_compiled(model, True)
        compiled = cross_entropy_sum(model.lm_head, model.hidden_states(batch["input_ids"]),
                                     batch["labels"], compiled=True)
        pieces = cross_entropy_sum(model.lm_head, model.hidden_states(batch["input_ids"]),
                                   batch["labels"], 4, compiled=True, recompute=False)
        set_compiled(model, False)
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    torch.testing.assert_close(compiled, eager, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(pieces, eager, atol=1e-3, rtol=1e-5)
    hidden = model.hidden_states(batch["input_ids"], normed=False).detach()
    runs = []
    for compiled, recompute in ((False, True), (True, False)):
        h = hidden.clone().requires_grad_()
        model.lm_head.weight.grad = model.model.norm.weight.grad = None
        loss = cross_entropy_sum(model.lm_head, h, batch["labels"], 4, compiled, norm=model.model.norm,
                                 recompute=recompute, divisor=100)
        loss.backward()
        runs.append((loss.detach(), h.grad, model.lm_head.weight.grad.clone(),
                     model.model.norm.weight.grad.clone()))
    for recomputed, compiled in zip(*runs):
        torch.testing.assert_close(compiled, recomputed, atol=1e-5, rtol=1e-4)


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
              "cpu_offload_optimizer": True, "optimizer": "paged_adamw8bit", "compile": True,
              "objective": "dpo", "packing": True, "method": "full", "tile_tokens": 16,
              "reference": "adapters_off", "eval_every": 1, "beta": 0.0, "seq_len": 96, "split_pairs": True}
    if "GRPO" in rule.reason or "max_completion" in rule.reason:
        values.update(objective="grpo", reference="precomputed", kl=0.5, max_completion=96)
    if "is full finetuning's reference" in rule.reason:
        values.update(reference="copy", method="lora")
    if "LoRA dropout would draw" in rule.reason:
        values.update(lora_dropout=0.1, method="lora")
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
