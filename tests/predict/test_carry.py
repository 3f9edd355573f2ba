"""A tiled step carried to many tiles from two recorded runs of a few (``nbtune.predict.carry``),
against the same step traced on every tile and every layer (``extrapolate=False``): equal to
the byte, breakdown, the composition of the peak moment, each phase's peak and the host
included; and where a condition of the carry fails, the step is traced instead."""

import pytest

import nbtune as nt
import nbtune.predict.carry as carry
import nbtune.predict.estimator as est
from nbtune.models import ModelConfig
from nbtune.predict import Predictor, longest_context

from helpers import returns_of

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_layers=8, num_heads=4,
             num_kv_heads=2, head_dim=16, max_position_embeddings=1 << 16)
FAMILIES = {
    "llama": ModelConfig(**SMALL),
    "qwen2": ModelConfig(**SMALL, model_type="qwen2", attention_bias=True, tie_word_embeddings=True),
    "qwen3": ModelConfig(**SMALL, model_type="qwen3", qk_norm=True),
}

# Tiles of 8 tokens (256 with offloading: smaller saved tensors are not offloaded, so the
# carry is refused); the loss in fixed pieces (chunked_loss >= the tiles) or one per tile.
COMBOS = [
    ("llama", dict(method="lora", activation_checkpointing=True, chunked_loss=8), "cpu"),
    ("qwen2", dict(), "cpu"),
    ("qwen3", dict(method="qlora", dtype="bf16", activation_checkpointing=True,
                   activation_offloading=True, chunked_loss=16, tile_tokens=256), "cuda"),
    ("llama", dict(grad_accum=2, max_grad_norm=1.0), "cpu"),
    ("qwen3", dict(optimizer_in_backward=True, activation_checkpointing=True), "cpu"),
    ("qwen2", dict(method="lora", lora_dropout=0.1, activation_checkpointing=2), "cpu"),
    ("qwen3", dict(dtype="bf16", optimizer="adamw8bit", chunked_loss=16, tile_tokens=16), "cuda"),
    ("llama", dict(activation_offloading=True, method="lora", tile_tokens=256), "cuda"),
]


def assert_same(a: nt.MemoryBreakdown, b: nt.MemoryBreakdown) -> None:
    assert a == b  # every byte count, the device and the evaluation's peak
    assert a.at_peak == b.at_peak and a.phases == b.phases and a.host == b.host


@pytest.fixture
def drawn(monkeypatch):
    """The Lines each pair of recorded runs gave (None where a condition failed)."""
    return returns_of(monkeypatch, est, "lines")


def carried_and_traced(family, changes, device, tiles, layers=8):
    changes = {"tile_tokens": 8, **changes}
    t = nt.Techniques(batch_size=2, seq_len=changes["tile_tokens"] * tiles, **changes)
    config = FAMILIES[family].replace(num_layers=layers)  # (4: still two shallow runs)
    return est.estimate(config, t, device=device), est.estimate(config, t, device=device,
                                                                extrapolate=False)


@pytest.mark.slow
def test_a_tiled_step_carried_to_more_tiles_equals_every_tile_traced(monkeypatch, drawn):
    """Through a model's Predictor: the two runs are recorded once (3 and 4 tiles, each at the
    two shallow depths), give themselves back, and carry the step to 6 tiles; each answer
    equals the step traced on every tile and every layer."""
    made = []
    real = est._fake_step

    def spy(config, t, target, shape, by_layer, tiles=(False, False), spread=None, **loss):
        made.append((config.num_layers, shape, tiles))
        return real(config, t, target, shape, by_layer, tiles, spread, **loss)

    monkeypatch.setattr(est, "_fake_step", spy)
    family, changes, device = COMBOS[0]
    config = FAMILIES[family].replace(num_layers=4)  # (4: still two shallow runs)
    predictor = Predictor(config, device)
    t = nt.Techniques(batch_size=2, tile_tokens=8, **changes)
    answers = {n: predictor.estimate(t, seq_len=8 * n) for n in (carry.BASE, carry.BASE + 1, 6)}
    assert len(made) == 4 and all(tiles[0] for *_, tiles in made)  # 2 depths x 3 and 4 tiles
    assert drawn and all(d is not None for d in drawn), "the step was not carried"
    assert drawn[0].segments[("backward", 0, "layer", 1)][0]  # (lines of a layer's backward)
    for n, answer in answers.items():
        assert_same(answer, est.estimate(config, t.replace(seq_len=8 * n), extrapolate=False))
    assert answers[6].peak > answers[6].parameters > 0


@pytest.mark.slow
@pytest.mark.parametrize("number,tiles", [(n, 9 if n % 2 else 5) for n in range(1, len(COMBOS))])
def test_every_combination_carried_equals_every_tile_traced(drawn, number, tiles):
    """Each combination at 5 or 9 tiles (every one at both took a minute more of CI's 25)."""
    carried, traced = carried_and_traced(*COMBOS[number], tiles=tiles)
    assert drawn and all(d is not None for d in drawn), "the step was not carried"
    assert_same(carried, traced)


@pytest.mark.parametrize("changes,tokens,why", [
    (dict(), 8 * 7 + 4, "not whole tiles"),
    (dict(), 8 * 2, "fewer than BASE tiles"),
    (dict(packing=True), 8 * 7, "a document mask"),
    (dict(eval_every=5), 8 * 7, "a held-out evaluation"),
    (dict(chunked_loss=5), 8 * 7, "pieces: fixed at 3 and 4 tiles, one a tile at 7"),
    (dict(chunked_loss=3), 8 * 2, "(one a tile from 3 tiles on: carried, but not 2 tiles)"),
    (dict(chunked_loss=16), 8 * 7, "pieces of a tile that do not divide it"),
    (dict(activation_offloading=True), 8 * 7, "tensors that may cross the size offloaded"),
])
def test_what_is_not_carried(changes, tokens, why):
    t = nt.Techniques(tile_tokens=8, seq_len=tokens, **changes)
    assert carry.carried_tiles(FAMILIES["llama"], t, tokens) is None, why
    window = ModelConfig(**SMALL, model_type="mistral", sliding_window=16)
    assert carry.carried_tiles(window, nt.Techniques(tile_tokens=8), 8 * 7) is None
    assert carry.carried_tiles(FAMILIES["llama"], nt.Techniques(tile_tokens=8), 8 * 7) == (7, True)
    assert carry.carried_tiles(FAMILIES["llama"], nt.Techniques(tile_tokens=8, chunked_loss=8),
                               8 * 7) == (7, False)


@pytest.mark.slow
def test_a_failed_condition_traces_the_step(monkeypatch, drawn):
    # The tile between the second and the last is taken off its line: nothing is carried,
    # and the estimate is the traced one.
    monkeypatch.setattr(carry, "_between", lambda *moments: False)
    carried, traced = carried_and_traced(*COMBOS[0], tiles=5, layers=4)
    assert drawn and all(d is None for d in drawn)
    assert_same(carried, traced)


@pytest.mark.slow
def test_longest_context_of_a_tiled_run_draws_its_line_through_carried_lengths():
    """The first two lengths are BASE and 2 * BASE tiles: the line is drawn where tiling
    holds, and every length that is whole tiles costs no trace of its own."""
    from nbtune.predict import required

    config = FAMILIES["llama"]
    t = dict(batch_size=1, activation_checkpointing=True, chunked_loss=8, tile_tokens=64,
             method="lora")
    budget = required(nt.estimate(config, {**t, "seq_len": 64 * 20}, device="cpu"))
    result = longest_context(Predictor(config, "cpu"), budget, t, device="cpu")
    assert [p[0] for p in result.tried[:2]] == [64 * carry.BASE, 64 * 2 * carry.BASE]
    assert required(result.memory) <= budget
    assert required(nt.estimate(config, {**t, "seq_len": result.tokens + 256},
                                device="cpu")) > budget
