"""Session behaviour: steps, equal maths of the techniques, live changes, generation."""

import dataclasses
import io

import pytest
import torch

import nbtune as nt
from nbtune.data import DataError

from helpers import small_session


def losses(session, steps=5):
    return [session.step().loss for _ in range(steps)]


def assert_same_weights(a, b, atol):
    for (name, pa), (_, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=0, msg=name)


def test_step_report_fields_and_history():
    session = small_session()
    report = session.step()
    assert isinstance(report, nt.StepReport)
    assert report.loss > 0 and report.tokens > report.trained_tokens > 0 and report.seconds > 0
    assert isinstance(report.memory, nt.MemoryBreakdown) and report.memory.peak > 0
    assert session.history == [report] and report.step == 1


def test_repr_names_only_the_techniques_that_differ_from_the_defaults():
    session = small_session()
    session.set(lora_rank=4, method="lora")
    session.step()
    first, second = repr(session).splitlines()
    assert "steps=1" in first and "cpu" in first
    defaults = nt.Techniques()
    expected = [f"{k}={getattr(session.techniques, k)!r}" for k in nt.Techniques.__dataclass_fields__
                if getattr(session.techniques, k) != getattr(defaults, k)]
    assert second == "  techniques (besides the defaults): " + ", ".join(expected)
    assert "method='lora'" in second and "lora_rank=4" in second and "optimizer=" not in second


@pytest.mark.slow
def test_loss_falls_on_repeated_data():
    session = small_session(lr=3e-3)
    trace = losses(session, 30)
    assert sum(trace[-5:]) / 5 < 0.6 * trace[0]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_accumulation_equals_one_larger_batch(optimizer):
    lr = 1e-3 if optimizer == "adamw" else 0.1  # SGD must move the weights measurably
    big = small_session(batch_size=8, grad_accum=1, optimizer=optimizer, lr=lr)
    accumulated = small_session(batch_size=4, grad_accum=2, optimizer=optimizer, lr=lr)
    start = {n: p.detach().clone() for n, p in big.model.named_parameters()}
    torch.testing.assert_close(losses(accumulated), losses(big), atol=1e-5, rtol=0)
    if optimizer == "sgd":
        moved = max((p - start[n]).abs().max().item() for n, p in big.model.named_parameters())
        assert moved > 1e-2  # far beyond the tolerance below
        # Gradients agree to fp32 rounding (~1e-7). AdamW's first steps move each weight by
        # about lr * sign(grad), so rounding noise on near-zero gradients shows up at ~lr
        # in a few weights: compare weights where the update is linear in the gradient.
        assert_same_weights(accumulated, big, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 2])
def test_checkpointing_does_not_change_the_maths(every):
    plain = small_session()
    checkpointed = small_session(activation_checkpointing=every)
    assert sum(layer.checkpointed for layer in checkpointed.model.model.layers) == 4 // every
    torch.testing.assert_close(losses(checkpointed), losses(plain), atol=1e-5, rtol=0)
    assert_same_weights(checkpointed, plain, atol=1e-5)


def test_lora_merged_outputs_equal_unmerged():
    session = small_session(method="lora", lr=1e-2)
    losses(session, 3)  # make the adapters non-zero
    ids = torch.randint(0, 250, (2, 30))
    session.model.eval()
    with torch.no_grad():
        adapted = session.model(ids)
        session.set(method="full")  # folds the adapters into the base weights
        assert not any("lora" in n for n, _ in session.model.named_parameters())
        session.model.eval()
        merged = session.model(ids)
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_lora_trains_only_adapters_and_loss_falls():
    session = small_session(method="lora", lr=1e-2, lora_rank=8)
    before = {n: p.detach().clone() for n, p in session.model.named_parameters()}
    trace = losses(session, 20)
    assert sum(trace[-5:]) / 5 < trace[0]
    for name, p in session.model.named_parameters():
        changed = not torch.equal(before[name], p)
        assert changed == ("lora_" in name), name


@pytest.mark.slow
def test_lr_change_keeps_optimizer_state():
    session = small_session()
    session.step()
    state = session.optimizer.state
    session.set(lr=5e-4)
    assert session.optimizer.state is state and len(state) > 0
    assert session.optimizer.param_groups[0]["lr"] == 5e-4


@pytest.mark.slow
def test_batch_size_change_continues_through_the_epoch():
    session, reference = small_session(batch_size=4), small_session(batch_size=4)
    session.step()
    reference.trainer.stream.next()
    session.set(batch_size=2)
    expected = reference.trainer.stream.next()["input_ids"][:2]
    got = session.trainer.stream.next()["input_ids"]
    assert torch.equal(got, expected[:, : got.shape[1]])


def test_all_problems_are_named_at_once():
    with pytest.raises(ValueError) as err:
        nt.Techniques(batch_size=0, dtype="fp8", lora_dropout=2.0)
    message = str(err.value)
    assert "batch_size" in message and "'fp8'" in message and "lora_dropout" in message


def test_corrupt_weights_are_named(tmp_path):
    import shutil

    from nbtune.models import demo_model_dir

    shutil.copytree(demo_model_dir(), tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="damaged or not safetensors"):
        nt.load_model(tmp_path / "m")


@pytest.mark.slow
def test_optimizer_change_rebuilds_and_says_so(capsys):
    session = small_session()
    session.step()
    session.set(optimizer="sgd")
    assert isinstance(session.optimizer, torch.optim.SGD)
    assert "optimizer state reset" in capsys.readouterr().out
    session.step()


@pytest.mark.slow
def test_bad_value_changes_nothing_and_names_the_fix():
    session = small_session()
    session.step()
    before, optimizer, stream = session.techniques, session.optimizer, session.trainer.stream
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        session.set(batch_size=0, lr=1.0)
    with pytest.raises(DataError, match="Raise seq_len"):
        session.set(seq_len=8)
    with pytest.raises(TypeError, match="unknown technique"):
        session.set(learning_rate=1.0)
    assert session.techniques is before
    assert session.optimizer is optimizer and session.trainer.stream is stream
    session.step()  # still usable


def test_a_misspelt_technique_gets_did_you_mean_as_on_the_command_line():
    with pytest.raises(TypeError, match=r"Techniques: unknown technique 'methd' \(did you mean 'method'\?\)"):
        nt.Techniques(methd="lora")
    with pytest.raises(TypeError, match=r"'lorarank' \(did you mean 'lora_rank'\?\), 'zzz'\. Known: method"):
        nt.Techniques().replace(lorarank=4, zzz=1)
    assert nt.Techniques(method="lora").replace(lora_rank=4).lora_rank == 4  # known ones pass


def test_techniques_are_immutable_with_a_helpful_message():
    t = nt.Techniques()
    with pytest.raises(AttributeError, match=r"session.set\(lr=...\)"):
        t.lr = 1.0
    assert t.replace(lr=1.0).lr == 1.0 and t.lr == 2e-5


def test_assigning_techniques_goes_through_set():
    session = small_session()
    session.techniques = session.techniques.replace(batch_size=2, dtype="bf16")
    assert session.techniques.batch_size == 2
    assert all(p.dtype == torch.bfloat16 for p in session.model.parameters())
    assert session.step().loss > 0


@pytest.mark.slow
def test_dtype_switch_casts_weights_and_keeps_training():
    session = small_session()
    session.set(dtype="bf16")
    assert session.optimizer.param_groups[0]["params"][0].dtype == torch.bfloat16
    assert torch.isfinite(torch.tensor(losses(session, 2))).all()


def test_subscribers_hear_changes_and_steps():
    session = small_session()
    events = []

    def listener(event):
        events.append(event.kind)

    session.subscribe(listener)
    session.set(lr=1e-4)
    session.step()
    assert events == ["techniques", "step"]


@pytest.mark.slow
def test_run_shows_progress_and_returns_reports(capsys):
    session = small_session()
    reports = session.run(3, live=False)
    assert [r.step for r in reports] == [1, 2, 3] and len(session.history) == 3
    assert "3/3" in capsys.readouterr().err  # the tqdm bar


def test_a_run_on_a_busy_machine_says_so_and_a_quiet_one_does_not(monkeypatch, capsys):
    """Against a process the test starts (``test_ladder``'s spinner measures the same
    ``Contention``): here its figure is set, and the run says it or stays quiet."""
    from nbtune import hardware

    session = small_session()
    monkeypatch.setattr(hardware, "BUSY_SECONDS", 0.0)
    for others, said in ((1.6, True), (0.1, False)):
        monkeypatch.setattr(hardware.Contention, "so_far", lambda self, v=others: v)
        session.run(1, progress=False, live=False)
        out = capsys.readouterr().out
        assert ("nbtune: machine busy: other processes used 1.6 of" in out) is said, out
        assert "slower than it would alone" in out or not said


def test_generate_and_evaluate():
    session = small_session()
    text = session.generate("Which vowel is in the word?", input="bcad", max_new_tokens=5)
    assert isinstance(text, str) and len(session.tokenizer.encode(text)) <= 5
    assert 0.0 <= session.evaluate(session.heldout_examples[:4]) <= 1.0
    assert session.model.training  # generation leaves training mode as it found it


def test_chart_renders_png():
    session = small_session()
    session.run(2, progress=False, live=False)
    buffer = io.BytesIO()
    session.chart().savefig(buffer, format="png")
    assert buffer.getvalue()[:4] == b"\x89PNG"


def test_a_cpu_without_native_bf16_is_named_at_the_first_bf16_step(monkeypatch, capsys):
    from nbtune import hardware

    monkeypatch.setattr(hardware, "bf16_slowdown", lambda: 60.0)  # an AVX2-only processor
    session = small_session(batch_size=2)  # bf16 steps stay tiny
    session.step()
    assert "slower" not in capsys.readouterr().out  # fp32: nothing to say
    session.set(dtype="bf16")
    session.step()
    out = capsys.readouterr().out
    assert "bf16 matmuls run 60x slower than fp32 on this CPU" in out and "dtype='fp32'" in out
    session.step()
    assert "slower" not in capsys.readouterr().out  # said once per change of dtype
    monkeypatch.setattr(hardware, "bf16_slowdown", lambda: 0.5)  # a processor with native bf16
    session.set(dtype="fp32")
    session.set(dtype="bf16")
    session.step()
    assert "slower" not in capsys.readouterr().out


def test_the_bf16_probe_times_this_processor():
    from nbtune import hardware

    slow = hardware.bf16_slowdown()
    assert slow > 0 and hardware.bf16_slowdown() is slow  # measured once per process


def test_a_step_report_and_its_memory_print_in_one_line():
    """Outside a notebook ``print(report)`` was a screenful of nested dataclass fields."""
    from nbtune.units import format_bytes

    session = small_session()
    report = session.step()
    line, memory = repr(report), repr(report.memory)
    assert "\n" not in line + memory and len(line) < 160 and len(memory) < 200
    assert line.startswith(f"StepReport(step 1: loss {report.loss:.4f}, ")
    assert f"peak {format_bytes(report.memory.peak)}" in line and f"lr {report.lr:.3g}" in line
    assert memory.startswith(f"MemoryBreakdown(peak {format_bytes(report.memory.peak)} on cpu: ")
    assert f"parameters {format_bytes(report.memory.parameters)}" in memory
    assert memory.endswith("; measured)") and str(report) == line


def test_a_default_seq_len_follows_a_shorter_model_context_and_a_chosen_one_is_refused(capsys):
    """The demo model's context is 256 tokens, the default seq_len 512: a session given only
    method="lora" follows the model (and says so once); a seq_len the user chose is refused."""
    from nbtune.models import demo_model_dir
    from nbtune.session import demo_data_file

    limit = nt.Session.from_pretrained(demo_model_dir(), None).model.config.max_position_embeddings
    assert limit < nt.Techniques().seq_len
    assert "seq_len follows the model" in capsys.readouterr().out  # no techniques given: the same
    session = nt.Session.from_pretrained(demo_model_dir(), demo_data_file("train"),
                                         techniques=nt.Techniques(method="lora"))
    said = capsys.readouterr().out
    assert session.techniques.seq_len == limit and session.techniques.method == "lora"
    assert said.count(f"seq_len follows the model: its context is {limit} tokens") == 1
    session.step()  # rows of up to 256 tokens train
    assert "seq_len follows" not in capsys.readouterr().out  # said once
    with pytest.raises(ValueError, match=rf"set seq_len <= {limit}"):
        nt.Session.from_pretrained(demo_model_dir(), demo_data_file("train"),
                                   techniques=nt.Techniques(method="lora", seq_len=limit + 64))


def test_a_tokenizer_larger_than_the_embedding_is_refused_naming_both_sizes():
    """Refused when the session is made, not at the first id past the embedding."""
    from nbtune.models import Tokenizer, demo_model_dir
    from nbtune.models.config import ModelConfig
    from nbtune.models.decoder import CausalLM
    from nbtune.session import demo_data_file

    tokenizer = Tokenizer.from_folder(demo_model_dir())
    ids = tokenizer.backend.get_vocab_size(with_added_tokens=True)
    config = ModelConfig.from_file(demo_model_dir() / "config.json")
    small = CausalLM(dataclasses.replace(config, vocab_size=ids - 10))
    with pytest.raises(ValueError, match=rf"tokenizer has {ids:,} tokens but the model's embedding "
                                         rf"has {ids - 10:,} rows"):
        nt.Session(small, tokenizer, demo_data_file("train"), device="cpu")
    fits = CausalLM(dataclasses.replace(config, vocab_size=ids))  # padded or equal: accepted
    assert nt.Session(fits, tokenizer, demo_data_file("train"), device="cpu").model is fits
