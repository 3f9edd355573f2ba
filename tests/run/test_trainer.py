"""The trainer's ``set``: flipping toggles back and forth releases what was replaced, so memory
returns to where it was (the trainer's rollback is in ``properties/test_faults.py``, its
held-out evaluation in ``test_eval.py``)."""

import gc
import weakref

import pytest
import torch

from helpers import small_session


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (deduplicated)."""
    gc.collect()
    seen, total = set(), 0
    from torch._subclasses.fake_tensor import FakeTensor

    for obj in gc.get_objects():  # fake tensors (an estimate's) hold no memory
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not isinstance(obj, FakeTensor):
            try:
                storage = obj.untyped_storage()
                pointer = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                continue  # fake / functional tensors left in torch.compile's caches hold no memory
            if pointer and pointer not in seen:
                seen.add(pointer)
                total += storage.nbytes()
    return total


def step_on(session, position):
    """One step on the batch at ``position`` of the data order (same shapes, same peak)."""
    session.trainer.stream.epoch, session.trainer.stream.position = position
    session.trainer.stream._order = session.trainer.stream._shuffle()
    return session.step()


@pytest.mark.parametrize("away", [
    dict(optimizer="sgd"),
    dict(method="lora", lora_rank=16),
    dict(method="qlora"),
    dict(dtype="bf16"),
    dict(activation_checkpointing=True, chunked_loss=4, activation_offloading=True),
    dict(batch_size=2, packing=True, seq_len=256),
])
@pytest.mark.slow
def test_round_trip_returns_memory_within_one_percent(away):
    session = small_session()
    session.step()  # optimizer state exists from the first update on
    position = (session.trainer.stream.epoch, session.trainer.stream.position)
    first = step_on(session, position)
    before = live_tensor_bytes()
    back = {name: getattr(session.techniques, name) for name in away}
    session.set(**away)
    session.step()
    session.set(**back)
    session.step()  # a rebuilt optimizer has its state again after one update
    again = step_on(session, position)
    assert abs(live_tensor_bytes() - before) <= 0.01 * before
    assert abs(again.memory.peak - first.memory.peak) <= 0.01 * first.memory.peak


def test_replaced_parts_are_released():
    session = small_session()
    session.step()
    old_optimizer = weakref.ref(session.optimizer)
    session.set(method="lora")
    session.step()
    adapter = weakref.ref(session.model.model.layers[0].self_attn.q_proj.lora_A.weight)
    lora_optimizer = weakref.ref(session.optimizer)
    session.set(method="full")
    session.step()
    gc.collect()
    assert old_optimizer() is None and lora_optimizer() is None and adapter() is None


def test_optimizer_in_backward_round_trip_removes_its_hooks():
    session = small_session()
    session.step()
    session.set(optimizer_in_backward=True)
    session.step()
    session.set(optimizer_in_backward=False)
    before = {n: p.detach().clone() for n, p in session.model.named_parameters()}
    batch = session.trainer.stream.next()
    loss = session.model(batch["input_ids"]).sum()
    loss.backward()  # a backward outside any step: no hook may update a weight now
    assert all(torch.equal(before[n], p) for n, p in session.model.named_parameters())
    assert all(p.grad is not None for p in session.model.parameters())


def test_where_a_trainer_is_names_its_phase_step_and_a_save(tmp_path, monkeypatch):
    """What a heartbeat says of a rank: the phase of the step under way, between steps, or
    the checkpoint being written (seen from inside the save), and "done" again after it."""
    import nbtune.checkpoint
    from nbtune.step import _Phases

    session = small_session()
    trainer = session.trainer
    assert trainer.where() == "between steps (after step 0)"
    heard = []
    real_optimizer = _Phases.before_optimizer

    def before_optimizer(self):
        real_optimizer(self)
        heard.append(trainer.where())
    monkeypatch.setattr(_Phases, "before_optimizer", before_optimizer)
    session.step()
    assert heard == ["during the optimizer phase of step 1"]
    real_save = nbtune.checkpoint.save_file

    def save_file(*args, **kwargs):
        heard.append(trainer.where())
        return real_save(*args, **kwargs)
    monkeypatch.setattr(nbtune.checkpoint, "save_file", save_file)
    session.save_checkpoint(tmp_path / "ckpt")
    assert set(heard[1:]) == {"while saving the checkpoint of step 1"}
    assert trainer.where() == "between steps (after step 1)"
