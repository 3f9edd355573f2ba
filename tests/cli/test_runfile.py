"""Run files and ``nbtune train``: a saved session repeats exactly, unattended, and resumes."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import nbtune as nt
import nbtune.cli.main as cli
import nbtune.cli.train as train_cli
from nbtune import runfile
from nbtune.data import load_examples
from nbtune.models import demo_model_dir
from nbtune.peft import merged_state_dict
from nbtune.session import demo_data_file

pytestmark = pytest.mark.usefixtures("one_thread")

LORA = dict(method="lora", batch_size=4, seq_len=96, lr=2e-3, lora_rank=4, lora_alpha=8.0)


def rows(n=32, split="train"):
    return [{"instruction": e.instruction[0], "input": e.instruction[1], "output": e.messages[-1][1]}
            for e in load_examples(demo_data_file(split))[:n]]


def session_in_code(**changes):
    torch.manual_seed(0)
    return nt.Session.from_pretrained(demo_model_dir(), rows(), heldout=rows(8, "heldout"),
                                      techniques={**LORA, **changes}, device="cpu")


def steps(session, n):
    return [session.step().loss for _ in range(n)]


def test_save_config_then_from_config_repeats_the_session_bit_for_bit(tmp_path):
    trained = session_in_code()
    trained.match = "contains"
    steps(trained, 2)
    path = trained.save_config(tmp_path / "run.yaml")
    text = yaml.safe_load(path.read_text())
    # the file says it all, in plain YAML: the techniques as set, the length trained so far
    assert text["techniques"] == {**nt.Techniques().as_dict(), **LORA,
                                  "lora_targets": list(nt.Techniques().lora_targets)}
    assert text["run"]["steps"] == 2 and text["data"]["match"] == "contains"
    # rows given in code were written beside the file, relative to it
    assert text["data"]["train"] == "run.train.jsonl" and (tmp_path / "run.heldout.jsonl").exists()
    assert Path(text["model"]) == demo_model_dir()

    again = nt.Session.from_config(path, device="cpu")
    assert again.techniques == trained.techniques
    assert again.train_examples == trained.train_examples
    assert again.heldout_examples == trained.heldout_examples and again.match == "contains"
    twin = session_in_code()  # a never-saved session made the same way
    torch.manual_seed(0)
    assert steps(again, 3) == steps(twin, 3)
    for (name, a), (_, b) in zip(again.model.named_parameters(), twin.model.named_parameters()):
        assert torch.equal(a, b), name


def test_from_config_reads_paths_relative_to_the_file_and_save_config_keeps_them(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows(16)) + "\n")
    (tmp_path / "run.yaml").write_text(
        f"model: {demo_model_dir()}\ndata:\n  train: data/train.jsonl\n"
        "techniques: {method: lora, batch_size: 2, seq_len: 96}\nrun: {steps: 3}\n")
    session = nt.Session.from_config(tmp_path / "run.yaml", device="cpu")
    assert len(session.train_examples) == 16
    assert session.techniques == nt.Techniques(method="lora", batch_size=2, seq_len=96)
    elsewhere = tmp_path / "elsewhere"
    session.save_config(elsewhere / "copy.yaml")
    saved = yaml.safe_load((elsewhere / "copy.yaml").read_text())
    assert Path(saved["data"]["train"]) == (data / "train.jsonl").resolve()  # not under it: absolute
    assert saved["run"]["steps"] == 3  # read from the first file, not trained yet
    assert not (elsewhere / "copy.train.jsonl").exists()


def test_overrides_reach_the_maths(tmp_path):
    session_in_code().save_config(tmp_path / "run.yaml", steps=2)
    base = nt.Session.from_config(tmp_path / "run.yaml", device="cpu")
    hot = nt.Session.from_config(tmp_path / "run.yaml", device="cpu",
                                 overrides={"techniques.lr": 0.05, "techniques.lora_rank": 2})
    assert hot.optimizer.param_groups[0]["lr"] == 0.05
    assert {p.shape[0] for n, p in hot.model.named_parameters() if n.endswith("lora_A.weight")} == {2}
    first = steps(base, 2), steps(hot, 2)
    assert first[0][0] != first[1][0] or first[0][1] != first[1][1]


def test_run_file_errors_name_the_line_and_the_field(tmp_path):
    text = (f"model: {demo_model_dir()}\n"
            "data:\n  train: x.jsonl\n"
            "techniques:\n  method: lora\n  lr: fast\n  packin: true\n"
            "run:\n  steps: -1\n  sve: [hf]\n")
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    lines = text.splitlines()

    def line_of(key):
        return next(i + 1 for i, line in enumerate(lines) if line.strip().startswith(key + ":"))

    with pytest.raises(runfile.RunFileError) as err:
        nt.Session.from_config(path)
    message = str(err.value)
    assert f"line {line_of('lr')}, techniques.lr:" in message and "'fast'" in message
    assert f"line {line_of('packin')}, techniques.packin: unknown field" in message
    assert "Did you mean 'packing'?" in message
    assert f"line {line_of('steps')}, run.steps:" in message
    assert f"line {line_of('sve')}, run.sve" in message and "'save'" in message

    path.write_text("demo: tiny\ntechniques:\n  optimizer_in_backward: true\n  grad_accum: 2\n")
    with pytest.raises(runfile.RunFileError, match=r"line 4, techniques.grad_accum: optimizer_in_backward"):
        nt.Session.from_config(path)
    path.write_text("demo: tiny\ntechniques:\n\tlr: 1\nrun: {steps: 2}\n")  # a tab indent
    with pytest.raises(runfile.RunFileError, match=r"line 3: not valid YAML"):
        nt.Session.from_config(path)
    path.write_text("demo: tiny\nmodel: x\n")
    with pytest.raises(runfile.RunFileError, match="line 1: set model: or demo:, not both"):
        nt.Session.from_config(path)
    path.write_text("techniques: {}\n")
    with pytest.raises(runfile.RunFileError, match="no model"):
        nt.Session.from_config(path)
    with pytest.raises(runfile.RunFileError, match="no such run file.*save_config"):
        nt.Session.from_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("text,match", [
    # YAML 1.1 reads yes/no/on/off as booleans, and pydantic a boolean as 1 or 0
    ("demo: tiny\nrun:\n  steps: yes\n", r"line 3, run\.steps: .*integer.*got 'yes'"),
    ("demo: tiny\nrun:\n  steps: true\n", r"line 3, run\.steps: true is a boolean, but this field is a number"),
    ("demo: tiny\ntechniques: {lr: false}\n", r"line 2, techniques\.lr: false is a boolean"),
    # YAML keeps the last of two equal keys silently
    ("demo: tiny\ntechniques:\n  lr: 1e-3\n  lr: 1e-2\n", r"line 4, techniques\.lr: given twice"),
    ("demo: tiny\nrun: {steps: 2}\nrun: {steps: 3}\n", r"line 3, run: given twice"),
], ids=["yes-for-a-number", "true-for-a-number", "false-for-a-float", "key-twice", "section-twice"])
def test_a_boolean_for_a_number_and_a_key_given_twice_are_refused_by_line(tmp_path, text, match):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(runfile.RunFileError, match=match):
        runfile.load(path)


def test_yaml_1_1_words_are_read_as_the_words_they_are(tmp_path):
    """``off`` is one of memory_tracking's values, not False; true and false stay booleans."""
    path = tmp_path / "run.yaml"
    path.write_text("demo: tiny\nmemory_tracking: off\ntechniques: {packing: true}\n")
    config = runfile.load(path, {"run.steps": runfile.parse_value("3")})
    assert config.memory_tracking == "off" and config.techniques.packing is True
    assert config.run.steps == 3 and runfile.parse_value("no") == "no"
    with pytest.raises(runfile.RunFileError, match=r"overridden: run\.steps=True.*is a boolean"):
        runfile.load(path, {"run.steps": runfile.parse_value("true")})


def test_save_config_refuses_what_it_cannot_repeat(tmp_path):
    from nbtune.models import CausalLM

    session = nt.Session.demo("tiny", device="cpu")
    in_code = nt.Session(CausalLM(session.model.config), session.tokenizer, rows(8),
                         techniques={"seq_len": 96}, device="cpu")
    with pytest.raises(runfile.RunFileError, match="built in code.*from_pretrained"):
        in_code.save_config(tmp_path / "run.yaml")
    fresh = session_in_code()
    with pytest.raises(ValueError, match="has not trained yet.*steps=100"):
        fresh.save_config(tmp_path / "run.yaml")
    assert not (tmp_path / "run.yaml").exists()
    demo = nt.Session.demo("tiny", device="cpu").save_config(tmp_path / "demo.yaml")
    assert yaml.safe_load(demo.read_text())["run"]["steps"] == nt.demos.DEMOS["tiny"].steps


def test_epochs_become_optimizer_steps(tmp_path):
    session_in_code(grad_accum=2).save_config(tmp_path / "run.yaml", epochs=1.5)
    config = runfile.load(tmp_path / "run.yaml")
    session = nt.Session.from_config(config, device="cpu")
    assert train_cli.total_steps(config.run, session) == math.ceil(1.5 * math.ceil(32 / (4 * 2)))


def _train(run_file, out, *flags):
    return cli.main(["train", str(run_file), "--out", str(out), *flags])


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_nbtune_train_is_the_notebook_step_and_writes_metrics_checkpoints_and_saves(tmp_path):
    session_in_code().save_config(tmp_path / "run.yaml", steps=4, checkpoint_every=2,
                                  save=["hf", "merged"])
    assert _train(tmp_path / "run.yaml", tmp_path / "out") == 0
    out = tmp_path / "out"
    metrics = _metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert {"step", "loss", "tokens", "seconds", "peak_bytes", "rank"} <= set(m) and m["rank"] == 0
        assert m["tokens"] > 0 and m["seconds"] > 0 and m["peak_bytes"] > 0
    notebook = nt.Session.from_config(tmp_path / "run.yaml", device="cpu")
    torch.manual_seed(0)
    assert [m["loss"] for m in metrics] == steps(notebook, 4)  # the same step, bit for bit
    assert [p.name for p in train_cli.checkpoints(out)] == ["step-00000002", "step-00000004"]
    merged = nt.load_model(out / "merged")
    reference = merged_state_dict(notebook.model)
    for name, value in merged.state_dict().items():
        assert torch.equal(value, reference[name]), name
    assert (out / "final" / "adapter_model.safetensors").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["loss_first"] == metrics[0]["loss"]
    # a second run into the same folder is refused rather than mixing two runs' metrics
    assert _train(tmp_path / "run.yaml", out) == 2
    assert len(_metrics(out)) == 4


def test_a_last_step_off_the_checkpoint_interval_is_checkpointed_and_a_finished_run_resumes_to_nothing(
        tmp_path):
    """5 steps, a checkpoint every 2: the run ends with a checkpoint at step 5 (not 4), so
    --resume with the same step count trains no step, and a longer one starts at step 6."""
    session_in_code().save_config(tmp_path / "run.yaml", steps=5, checkpoint_every=2)
    out = tmp_path / "out"
    assert _train(tmp_path / "run.yaml", out) == 0
    assert [p.name for p in train_cli.checkpoints(out)][-1] == "step-00000005"
    before = (out / "metrics.jsonl").read_text()
    assert _train(tmp_path / "run.yaml", out, "--resume") == 0
    assert (out / "metrics.jsonl").read_text() == before  # no step trained, none logged
    assert _train(tmp_path / "run.yaml", out, "--resume", "--steps", "6") == 0
    assert [m["step"] for m in _metrics(out)] == [1, 2, 3, 4, 5, 6]


def test_interrupted_then_resumed_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    session_in_code().save_config(tmp_path / "run.yaml", steps=6, checkpoint_every=4)
    assert _train(tmp_path / "run.yaml", tmp_path / "whole") == 0

    line = train_cli._line

    def interrupt_after_3(report):
        if report.step == 3:
            raise KeyboardInterrupt
        return line(report)

    monkeypatch.setattr(train_cli, "_line", interrupt_after_3)
    assert _train(tmp_path / "run.yaml", tmp_path / "cut") == 130
    monkeypatch.setattr(train_cli, "_line", line)
    assert [p.name for p in train_cli.checkpoints(tmp_path / "cut")] == ["step-00000003"]
    assert _train(tmp_path / "run.yaml", tmp_path / "cut", "--resume") == 0
    whole, cut = _metrics(tmp_path / "whole"), _metrics(tmp_path / "cut")
    assert [m["step"] for m in cut] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for m in cut] == [m["loss"] for m in whole]
    wa = load_file(str(tmp_path / "whole" / "final" / "adapter_model.safetensors"))
    wb = load_file(str(tmp_path / "cut" / "final" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # training further: a larger --steps continues from the last checkpoint
    assert _train(tmp_path / "run.yaml", tmp_path / "whole", "--resume", "--steps", "8") == 0
    assert [m["step"] for m in _metrics(tmp_path / "whole")] == list(range(1, 9))


def _adapters(out, folder="final"):
    return load_file(str(out / folder / "adapter_model.safetensors"))


def _equal_runs(whole, cut):
    wa, wb = _adapters(whole), _adapters(cut)
    return ([m["loss"] for m in _metrics(cut)] == [m["loss"] for m in _metrics(whole)]
            and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa))


def test_sigterm_mid_step_undoes_it_saves_and_resumes_like_an_uninterrupted_run(tmp_path,
                                                                               monkeypatch):
    """A rented GPU is stopped with SIGTERM: a real signal to this process in the middle of
    step 4's forward ends the run as Ctrl-C does (the step undone, a checkpoint of step 3,
    exit 143), and the resumed run equals one never stopped, bit for bit."""
    import os
    import signal

    session_in_code().save_config(tmp_path / "run.yaml", steps=6, checkpoint_every=4)
    assert _train(tmp_path / "run.yaml", tmp_path / "whole") == 0
    build = train_cli.factory.from_config
    forwards = []

    def stopped_in_step_4(*args, **kwargs):
        run = build(*args, **kwargs)

        def hook(module, inputs):
            if not module.training:  # generation (the held-out evaluation) runs in eval mode
                return
            forwards.append(1)
            if len(forwards) == 4:  # one micro-batch a step: step 4's forward
                os.kill(os.getpid(), signal.SIGTERM)
        run.model.model.layers[1].register_forward_pre_hook(hook)
        return run

    monkeypatch.setattr(train_cli.factory, "from_config", stopped_in_step_4)
    before = signal.getsignal(signal.SIGTERM)
    assert _train(tmp_path / "run.yaml", tmp_path / "cut") == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back
    monkeypatch.setattr(train_cli.factory, "from_config", build)
    assert [m["step"] for m in _metrics(tmp_path / "cut")] == [1, 2, 3]
    assert [p.name for p in train_cli.checkpoints(tmp_path / "cut")] == ["step-00000003"]
    assert _train(tmp_path / "run.yaml", tmp_path / "cut", "--resume") == 0
    assert [m["step"] for m in _metrics(tmp_path / "cut")] == [1, 2, 3, 4, 5, 6]
    assert _equal_runs(tmp_path / "whole", tmp_path / "cut")


def test_sighup_between_steps_saves_and_a_second_signal_does_not_cut_the_save(tmp_path,
                                                                             monkeypatch):
    """The terminal goes away (SIGHUP) after step 2, and a second signal comes while the
    checkpoint is written: the checkpoint is whole (it resumes), the exit code 129."""
    import os
    import signal

    from nbtune.run.checkpoints import StepCheckpoints

    session_in_code().save_config(tmp_path / "run.yaml", steps=3)
    line, save = train_cli._line, StepCheckpoints.save

    def hang_up_after_2(report):
        if report.step == 2:
            os.kill(os.getpid(), signal.SIGHUP)
        return line(report)

    def save_through_a_second_signal(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return save(*args)

    monkeypatch.setattr(train_cli, "_line", hang_up_after_2)
    monkeypatch.setattr(StepCheckpoints, "save", save_through_a_second_signal)
    assert _train(tmp_path / "run.yaml", tmp_path / "cut") == 128 + signal.SIGHUP
    monkeypatch.setattr(train_cli, "_line", line)
    monkeypatch.setattr(StepCheckpoints, "save", save)
    assert [p.name for p in train_cli.checkpoints(tmp_path / "cut")] == ["step-00000002"]
    assert _train(tmp_path / "run.yaml", tmp_path / "cut", "--resume") == 0
    assert [m["step"] for m in _metrics(tmp_path / "cut")] == [1, 2, 3]


@pytest.mark.slow
def test_a_real_nbtune_train_stopped_with_sigterm_resumes_exactly(tmp_path):
    """``python -m nbtune train`` as its own process, sent SIGTERM from outside once it has
    written two steps: exit 143, a checkpoint, and the resumed run equals an unstopped one."""
    import signal
    import time

    session_in_code().save_config(tmp_path / "run.yaml", steps=40)
    assert _train(tmp_path / "run.yaml", tmp_path / "whole") == 0
    cut = tmp_path / "cut"
    process = subprocess.Popen([sys.executable, "-m", "nbtune", "train", str(tmp_path / "run.yaml"),
                                "--out", str(cut)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.monotonic() + 240
    while not ((cut / "metrics.jsonl").exists() and len(_metrics(cut)) >= 2):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "SIGTERM: ending the step, then saving a checkpoint" in stderr
    saved = train_cli.checkpoints(cut)
    assert len(saved) == 1 and f"saved {saved[0]}" in stdout
    assert 2 <= len(_metrics(cut)) < 40
    assert _train(tmp_path / "run.yaml", cut, "--resume") == 0
    assert _equal_runs(tmp_path / "whole", cut)


@pytest.mark.slow
def test_python_m_nbtune_train_runs_headless_with_flags_over_the_file(tmp_path):
    session_in_code().save_config(tmp_path / "run.yaml", steps=50)
    done = subprocess.run([sys.executable, "-m", "nbtune", "train", str(tmp_path / "run.yaml"),
                           "--steps", "3", "--out", str(tmp_path / "o"), "--set", "techniques.lr=1e-2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [m["step"] for m in _metrics(tmp_path / "o")] == [1, 2, 3]
    assert [m["lr"] for m in _metrics(tmp_path / "o")] == [1e-2] * 3
    assert sum(line.startswith("step ") for line in done.stdout.splitlines()) == 3
    assert yaml.safe_load((tmp_path / "o" / "run.yaml").read_text())["techniques"]["lr"] == 1e-2
    bad = subprocess.run([sys.executable, "-m", "nbtune", "train", str(tmp_path / "run.yaml"),
                          "--set", "techniques.method=qlorra", "--out", str(tmp_path / "p")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert "(overridden: techniques.method='qlorra'), techniques.method: " in bad.stderr
    assert not (tmp_path / "p").exists()


def _on_a_terminal(*args):
    """Run ``python -m nbtune ...`` with stderr on a pseudo-terminal (as in a shell or a
    notebook's ``!``), where the progress bar is drawn; returns (exit code, stderr text)."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # 0 columns: no bar
    done = subprocess.run([sys.executable, "-m", "nbtune", *map(str, args)], stdout=subprocess.PIPE,
                          stderr=follower, timeout=300)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal is closed and drained
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return done.returncode, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_the_progress_bar_is_drawn_on_a_terminal_unless_no_progress(tmp_path):
    session_in_code().save_config(tmp_path / "run.yaml", steps=2)
    code, shown = _on_a_terminal("train", tmp_path / "run.yaml", "--out", tmp_path / "bar")
    assert code == 0 and "training: 100%" in shown
    code, shown = _on_a_terminal("train", tmp_path / "run.yaml", "--out", tmp_path / "quiet",
                                 "--no-progress")
    assert code == 0 and "training:" not in shown
    assert len(_metrics(tmp_path / "quiet")) == 2


def test_bad_data_named_by_the_run_file_is_one_line_not_a_traceback(tmp_path, capsys):
    session_in_code().save_config(tmp_path / "run.yaml", steps=2)
    (tmp_path / "train.jsonl").write_text('{"instruction": "hi", "output": "yo"}\n{"oops\n')
    text = (tmp_path / "run.yaml").read_text()
    data_line = next(line for line in text.splitlines() if line.startswith("data:"))
    (tmp_path / "run.yaml").write_text(text.replace(data_line, "data: {train: train.jsonl}"))
    assert cli.main(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nbtune train: ") and "train.jsonl" in err and "line 2" in err
    assert "Traceback" not in err


def test_a_failed_runs_account_is_one_write_so_ranks_ending_together_do_not_mix(monkeypatch):
    """Unbuffered (PYTHONUNBUFFERED, as in CI), ``print`` writes a text and its newline apart,
    and two ranks ending at once ran their accounts into one line (seen in CI). Each rank's
    account, with how to resume, must reach stderr in one write."""
    from nbtune.step import NonFiniteError

    def fails(args, parser):
        raise NonFiniteError("Step 3 was not applied: its loss is nan (lr=0.001).")
    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)
            return len(text)

        def flush(self):
            pass
    monkeypatch.setattr(cli, "run_train", fails)
    monkeypatch.setattr(sys, "stderr", Recorder())
    assert cli.main(["train", "run.yaml", "--out", "o"]) == 1
    assert writes == ["nbtune train: Step 3 was not applied: its loss is nan (lr=0.001).\n"
                      "nbtune train: the run stopped there; if a checkpoint was written "
                      "(checkpoint_every), continue from the newest with: nbtune train run.yaml "
                      "--resume --out o\n"]


def test_tensorboard_logging_writes_each_steps_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    session_in_code().save_config(tmp_path / "run.yaml", steps=3)
    assert _train(tmp_path / "run.yaml", tmp_path / "o", "--set", "run.log=[tensorboard]") == 0
    events = EventAccumulator(str(tmp_path / "o" / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    expected = [(m["step"], m["loss"]) for m in _metrics(tmp_path / "o")]
    assert [s for s, _ in logged] == [1, 2, 3]
    assert all(math.isclose(a, b, rel_tol=1e-6) for (_, a), (_, b) in zip(logged, expected))
    peak = events.Scalars("memory/peak_bytes")[0].value  # stored as float32
    assert math.isclose(peak, _metrics(tmp_path / "o")[0]["peak_bytes"], rel_tol=1e-6)


def test_a_missing_data_file_is_named_as_resolved_from_the_run_files_folder(tmp_path, capsys,
                                                                            monkeypatch):
    """A relative path in a run file starts from the file's folder (as it always did); the
    message used to say it started from the current folder."""
    folder = tmp_path / "runs"
    session_in_code().save_config(folder / "run.yaml", steps=1)
    text = yaml.safe_load((folder / "run.yaml").read_text())
    text["data"]["train"] = "data/missing.jsonl"
    (folder / "run.yaml").write_text(yaml.safe_dump(text))
    monkeypatch.chdir(tmp_path)  # elsewhere: the path must not be read from here
    assert _train(folder / "run.yaml", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"{folder / 'data' / 'missing.jsonl'}: no such data file. Check the path." in err
    assert "current folder" not in err


def test_processes_in_a_run_file_start_ranks_from_a_notebook_and_point_a_terminal_to_torchrun(
        tmp_path, monkeypatch, capsys):
    """``processes: 2`` is what ``Session.from_config(file)`` passes on as ``processes=2`` (the
    ranks themselves are started in tests/run/test_processes.py); ``nbtune train`` outside torchrun
    refuses it with the torchrun line, having written nothing; fewer than 2 is refused. (Under
    torchrun each process is a rank already: the field is not read there.)"""
    import nbtune.run.ranked

    path = tmp_path / "run.yaml"
    path.write_text("demo: tiny\nprocesses: 2\ntechniques: {batch_size: 4}\n")
    started = []

    class Started(Exception):
        pass

    def ranked_run(run_file, processes, overrides=None, local=None, address=None):
        started.append((run_file, processes, local, address))
        raise Started

    monkeypatch.setattr(nbtune.run.ranked, "RankedRun", ranked_run)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(Started):
        nt.Session.from_config(path)
    assert started == [(path, 2, None, None)]  # every rank on this machine by default
    with pytest.raises(TypeError, match="run file's path"):  # a loaded config: ranks read files
        nt.Session.from_config(runfile.load(path))
    assert _train(path, tmp_path / "out") != 0
    assert "torchrun --nproc_per_node 2 -m nbtune train" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    path.write_text("demo: tiny\nprocesses: 1\n")
    with pytest.raises(runfile.RunFileError, match="line 2, processes:"):
        nt.Session.from_config(path)
