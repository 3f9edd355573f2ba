"""The host's free memory as nbtune reads it: the kernel's count, capped by a container's limit."""

import pytest

from nbtune import host

GiB = 2**30


def machine(tmp_path, total_gib=32, available_gib=20, cgroup=None, version=2):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text(
        f"MemTotal:       {total_gib * 1024 * 1024} kB\n"
        f"MemFree:         1000 kB\n"
        f"MemAvailable:   {available_gib * 1024 * 1024} kB\n")
    if cgroup is not None:
        limit, usage = cgroup
        if version == 2:
            folder = tmp_path / "sys/fs/cgroup"
            folder.mkdir(parents=True)
            (folder / "memory.max").write_text("max\n" if limit is None else f"{limit}\n")
            (folder / "memory.current").write_text(f"{usage}\n")
        else:
            folder = tmp_path / "sys/fs/cgroup/memory"
            folder.mkdir(parents=True)
            (folder / "memory.limit_in_bytes").write_text(f"{limit or 2**63 - 4096}\n")
            (folder / "memory.usage_in_bytes").write_text(f"{usage}\n")
    return tmp_path


def test_a_machine_without_a_container_limit(tmp_path):
    root = machine(tmp_path)
    assert host.total(root) == 32 * GiB
    assert host.available(root) == 20 * GiB
    # room: what is free, plus the copy's own buffers, less the step's reserve and 10 % margin
    assert host.room(held=2 * GiB, reserve=3 * GiB, root=root) == 20 * GiB + 2 * GiB - 3 * GiB - int(3.2 * GiB)


@pytest.mark.parametrize("version", [1, 2])
def test_a_container_limit_below_the_machine_caps_both(tmp_path, version):
    root = machine(tmp_path, total_gib=256, available_gib=200, cgroup=(24 * GiB, 10 * GiB),
                   version=version)
    assert host.total(root) == 24 * GiB
    assert host.available(root) == 14 * GiB
    assert host.margin(host.total(root)) == int(2.4 * GiB)


def test_an_unlimited_cgroup_leaves_the_machines_numbers(tmp_path):
    root = machine(tmp_path, cgroup=(None, 5 * GiB))
    assert host.total(root) == 32 * GiB and host.available(root) == 20 * GiB


def test_a_small_host_keeps_at_least_one_gib_free(tmp_path):
    assert host.margin(4 * GiB) == GiB and host.margin(None) == GiB


def test_this_machine_is_readable():
    assert 0 < host.available() <= host.total()


# ---- the host side of the estimate, against what the code really moves ------------------------

import torch  # noqa: E402

import nbtune as nt  # noqa: E402
import nbtune.activations  # noqa: E402
import nbtune.checkpoint  # noqa: E402
import nbtune.models.hf  # noqa: E402
import nbtune.step  # noqa: E402
from nbtune.undo import copy_bytes, undo_units  # noqa: E402

from helpers import small_session  # noqa: E402


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.slow
@pytest.mark.parametrize("changes", [dict(), dict(activation_checkpointing=True)])
def test_offloaded_bytes_are_what_the_saved_tensor_hooks_park(monkeypatch, changes):
    """The most held by activations parked at once on a real step (counted at the hooks,
    each host copy once and alive until backward has used it) is the estimate's ``offloaded``."""
    session = small_session(activation_offloading=True, batch_size=2, seq_len=96, **changes)
    parked, held, most = {}, [0], [0]
    real = nbtune.activations.OffloadActivations

    class Counting(real):
        def __init__(self, model, **kwargs):
            super().__init__(model, **kwargs)
            pack, unpack = self.pack_hook, self.unpack_hook

            def counted(t):
                out = pack(t)
                # each host copy once: a tensor parked again (the rope tables) shares its copy
                if not isinstance(out, torch.Tensor) and id(out.host) not in parked:
                    copy = out.host
                    held[0] += copy.untyped_storage().nbytes()
                    most[0] = max(most[0], held[0])
                    parked[id(copy)] = copy.untyped_storage().nbytes()

                    def gone(key=id(copy)):
                        held[0] -= parked.pop(key)

                    import weakref
                    weakref.finalize(copy, gone)
                return out

            self.pack_hook = counted
            self.unpack_hook = unpack

    monkeypatch.setattr(nbtune.step, "OffloadActivations", Counting)
    ids = torch.randint(0, 250, (2, 96))
    nbtune.step.update(session.model, session.optimizer, [{"input_ids": ids, "labels": ids}], 192,
                       nbtune.step._Untracked(), nbtune.step.StepOptions(activation_offloading=True))
    predicted = nt.estimate(session.model.config, session.techniques, device="cuda").host
    assert most[0] > 0 and predicted.offloaded == most[0]
    assert nt.estimate(session.model.config, session.techniques, device="cpu").host.offloaded == 0


@pytest.mark.slow
@pytest.mark.parametrize("changes", [dict(optimizer_in_backward=True), dict(method="lora"),
                                     dict(optimizer="adamw8bit", optimizer_in_backward=True)])
def test_undo_bytes_are_what_the_copy_of_a_real_step_holds(changes):
    session = small_session(**changes)
    session.step()  # the optimizer's state exists now
    real = copy_bytes(undo_units(session.model, session.optimizer))
    predicted = nt.estimate(session.model.config, session.techniques, device="cuda").host
    assert predicted.undo == real > 0
    assert nt.estimate(session.model.config, session.techniques, device="cpu").host.undo == 0


def _saved_bytes(monkeypatch, module) -> list[int]:
    """Bytes of tensors in each ``save_file`` call of ``module`` (written as usual)."""
    calls, real = [], module.save_file

    def counting(tensors, *args, **kwargs):
        calls.append(_bytes(tensors.values()))
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr(module, "save_file", counting)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("changes", [dict(), dict(method="lora"), dict(optimizer="adamw8bit")])
def test_checkpoint_bytes_are_the_larger_file(monkeypatch, tmp_path, changes):
    """On CUDA safetensors moves a file's tensors to the host together: the prediction is
    the larger of the weights file and the optimizer file, as written here."""
    session = small_session(**changes)
    session.step()
    calls = _saved_bytes(monkeypatch, nbtune.checkpoint)
    session.save_checkpoint(tmp_path / "ckpt")
    predicted = nt.estimate(session.model.config, session.techniques, device="cuda").host
    assert len(calls) == 3 and predicted.checkpoint == max(calls)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
def test_merged_save_bytes_are_every_weight(monkeypatch, tmp_path, method):
    session = small_session(method=method)
    session.step()
    calls = _saved_bytes(monkeypatch, nbtune.models.hf)
    session.save(tmp_path / "out", merge=method != "full")
    predicted = nt.estimate(session.model.config, session.techniques, device="cuda").host
    assert calls == [predicted.merged]


def test_gguf_export_bytes_are_what_the_writer_holds(monkeypatch, tmp_path):
    """The writer takes one converted tensor at a time (the largest: the embedding, in f16) and
    the conversion one float32 chunk of rows at a time: the prediction is that tensor and two
    chunks (the chunk and its transient), not the model."""
    import gguf

    import nbtune.models.gguf as writing

    session = small_session(method="lora")
    written, chunks = [], []
    real_write, real_numpy = gguf.GGUFWriter.write_tensor_data, writing._numpy

    def write(self, data, *args, **kwargs):
        written.append(data.nbytes)
        return real_write(self, data, *args, **kwargs)

    def numpy(chunk):
        chunks.append(chunk.numel() * chunk.element_size())
        return real_numpy(chunk)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", write)
    monkeypatch.setattr(writing, "_numpy", numpy)
    monkeypatch.setattr(writing, "CONVERT_CHUNK_BYTES", 4096)  # several chunks per tensor here
    session.save(tmp_path / "gguf", format="gguf")  # f16
    described = nbtune.models.hf.dense_weights(session.model).described
    assert len(written) == len(described)  # each tensor once
    assert max(written) == 2 * max(w.numel() for w in described.values())
    assert max(chunks) <= 4096 and len(chunks) > len(written)
    predicted = nt.estimate(session.model.config, session.techniques, device="cuda").host
    assert predicted.gguf == max(written) + 2 * 4096  # the prediction follows the chunk


@pytest.mark.parametrize("rollback", ["auto", "copy"])
def test_the_undo_copys_host_check_counts_what_the_step_itself_puts_on_the_host(monkeypatch, capsys,
                                                                               rollback):
    """Free host memory stubbed so the copy fits alone but not beside the step's own host use
    (offloaded activations, paged state: ``_host_reserve``): "auto" keeps no copy and says so;
    "copy" is refused with HostMemoryError before the step changes anything."""
    from nbtune.run.trainer import HostMemoryError, Trainer

    session = small_session()  # a new optimizer's first step: the copy is wanted on a CPU too
    session.rollback = rollback
    size = copy_bytes(undo_units(session.model, session.optimizer))
    assert size > 0
    slack = size // 4  # the copy fits with this to spare...
    monkeypatch.setattr(host, "available", lambda root=None: size + slack + host.margin(host.total()))
    monkeypatch.setattr(Trainer, "_host_reserve", lambda self, t: 2 * slack)  # ...but not beside this
    if rollback == "copy":
        with pytest.raises(HostMemoryError, match="rollback='copy' needs a host copy"):
            session.step()
        assert session.history == []
    else:
        session.step()
        assert session.trainer.last_undo_bytes == 0
        assert "no undo copy is kept for this update" in capsys.readouterr().out
    monkeypatch.setattr(Trainer, "_host_reserve", lambda self, t: slack // 2)  # now it fits beside it
    fresh = small_session()
    fresh.rollback = rollback
    fresh.step()
    assert fresh.trainer.last_undo_bytes == size
