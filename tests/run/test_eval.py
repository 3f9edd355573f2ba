"""Held-out loss every N steps: its memory measured and predicted, and a failed evaluation
leaves the training exactly where a never-evaluating twin is."""

import pytest
import torch

import nbtune as nt
from nbtune.models import ModelConfig

from helpers import small_session

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_the_evaluation_peak_is_measured_and_predicted():
    s = small_session(eval_every=2)
    reports = [s.step() for _ in range(4)]
    assert [r.eval_loss is not None for r in reports] == [False, True, False, True]
    measured = reports[1].memory.eval_peak
    assert measured > 0 and all(r.memory.eval_peak == measured for r in reports[2:])
    assert reports[-1].memory.highest == max(reports[-1].memory.peak, measured)
    predicted = s.estimate().eval_peak
    # The estimate takes full-length rows; held-out rows are a little shorter.
    assert measured * 0.9 <= predicted <= measured * 1.15, (measured, predicted)
    assert small_session().estimate().eval_peak == 0  # off: nothing predicted


def test_chunked_loss_lowers_the_predicted_evaluation_peak_when_logits_dominate():
    config = ModelConfig(vocab_size=32_000, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    t = nt.Techniques(batch_size=8, seq_len=256, eval_every=10)
    whole = nt.estimate(config, t).eval_peak
    chunked = nt.estimate(config, t.replace(chunked_loss=8)).eval_peak
    logits = 8 * 256 * 32_000 * 4
    assert whole - chunked > logits / 2, (whole, chunked, logits)


@pytest.mark.slow
def test_a_failed_evaluation_keeps_the_step_and_changes_nothing(monkeypatch):
    s = small_session(eval_every=2)
    s.step()
    import nbtune.run.trainer

    real = nbtune.run.trainer.held_out_loss

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("injected at the evaluation")

    monkeypatch.setattr(nbtune.run.trainer, "held_out_loss", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        s.step()
    assert any("step 2 was applied" in note for note in caught.value.__notes__)
    assert len(s.history) == 2 and s.history[-1].eval_loss is None
    monkeypatch.setattr(nbtune.run.trainer, "held_out_loss", real)
    s.step()

    twin = small_session(eval_every=2)
    for _ in range(3):
        twin.step()
    assert [r.loss for r in twin.history] == [r.loss for r in s.history]
    for (name, a), b in zip(s.model.state_dict().items(), twin.model.state_dict().values()):
        assert torch.equal(a, b), name
