"""lm-evaluation-harness on a session: the bridge's log-likelihoods (batched, padded, a
context's ids split as lm-eval's own HF model splits them) equal nbtune's own scoring of the
same continuations, one sequence at a time; generation equals the session's; a task defined
here over a local JSONL file is scored before and after a demo run, offline."""

import json

import pytest
import torch

import nbtune as nt
from nbtune.data import IGNORE, prompt_and_reference
from nbtune.objectives.preference import completion_logps

lm_eval = pytest.importorskip("lm_eval")

from nbtune.benchmark import SessionLM  # noqa: E402


class Request:
    """lm-eval's Instance as the model sees it: ``args``."""

    def __init__(self, *args):
        self.args = args


def nbtune_logp(session, context: str, continuation: str) -> float:
    """The continuation's log-probability by nbtune's own scorer (the preference objectives'),
    on the unpadded sequence, its ids split as lm-eval splits them."""
    tok = session.tokenizer
    whole, n = tok.encode(context + continuation), len(tok.encode(context))
    ids = [tok.bos_id] + whole if tok.bos_id is not None and whole[:1] != [tok.bos_id] else whole
    n += len(ids) - len(whole)
    labels = torch.tensor([[IGNORE] * (n - 1) + ids[n:]])
    session.model.eval()
    with torch.no_grad():
        return completion_logps(session.model(torch.tensor([ids[:-1]])), labels).logps.item()


def test_loglikelihoods_equal_nbtunes_own_scoring_with_the_adapters_on():
    session = nt.Session.demo(lora_rank=8, method="lora")
    session.run(3, progress=False)  # adapters trained a little: the bridge must see them
    examples = session.heldout_examples[:5]
    requests = []
    for ex in examples:
        prompt, answer = prompt_and_reference(ex, session.tokenizer)
        requests += [Request(prompt, answer), Request(prompt + " ", answer), Request(prompt, "zzz odd")]
    bridge = SessionLM(session.model, session.tokenizer, batch_size=4)
    got = bridge.loglikelihood(requests)
    for request, (logp, _) in zip(requests, got):
        context, continuation = request.args
        spaces = len(context) - len(context.rstrip())  # lm-eval moves a context's trailing
        if spaces:  # whitespace to the continuation (its HF model does the same)
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        assert logp == pytest.approx(nbtune_logp(session, context, continuation), abs=1e-5)
    # the rolling log-likelihood of a text is its tokens' sum, BOS the first context
    text = "Is the number even or odd?"
    (rolling,) = bridge.loglikelihood_rolling([Request(text)])
    assert rolling == pytest.approx(nbtune_logp(session, "", text), abs=1e-5)


def test_benchmark_waits_for_no_run_and_names_each_metric_with_its_filter():
    from nbtune.benchmark import flat

    results = {"gsm8k": {"exact_match,strict-match": 0.25, "exact_match,flexible-extract": 0.5},
               "mmlu": {"acc,none": 0.4}}
    assert flat(results) == {"benchmark/gsm8k/exact_match/strict-match": 0.25,
                             "benchmark/gsm8k/exact_match/flexible-extract": 0.5, "benchmark/mmlu/acc": 0.4}
    session = nt.Session.demo()
    run = session.start(30)
    with pytest.raises(nt.BusyError):
        session.benchmark(["mmlu"])
    run.stop()


def write_task(folder, session, rows) -> None:
    """A multiple-choice lm-eval task over a local JSONL file: the demo's capital-letter
    question (the answer or another letter of the word), its prompt as the model's training
    rows write it."""
    lines = []
    for i, ex in enumerate(rows):
        prompt, answer = prompt_and_reference(ex, session.tokenizer)
        other = next(c for c in ex.instruction[1] if c != answer)
        choices = [answer, other] if i % 2 == 0 else [other, answer]
        lines.append(json.dumps({"prompt": prompt, "choices": choices, "answer": choices.index(answer)}))
    (folder / "capital.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "capital.yaml").write_text(f"""task: nbtune_capital
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'capital.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
""")


@pytest.mark.slow
def test_a_local_task_is_scored_before_and_after_a_demo_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    session = nt.Session.demo()
    rows = [ex for ex in session.heldout_examples if ex.instruction[0].startswith("Which letter is a capital")]
    write_task(tmp_path, session, rows)
    import random

    generators = random.getstate(), torch.random.get_rng_state()
    before = session.benchmark(["nbtune_capital"], include_path=tmp_path)["nbtune_capital"]["acc,none"]
    assert random.getstate() == generators[0]  # lm-eval seeds them; the caller's come back
    assert torch.equal(torch.random.get_rng_state(), generators[1])
    session.run(60, progress=False)
    after = session.benchmark(["nbtune_capital"], include_path=tmp_path)["nbtune_capital"]["acc,none"]
    # independently: the share of rows whose answer the model ranks above the other letter
    right = 0
    for ex in rows:
        prompt, answer = prompt_and_reference(ex, session.tokenizer)
        other = next(c for c in ex.instruction[1] if c != answer)
        right += nbtune_logp(session, prompt, answer) > nbtune_logp(session, prompt, other)
    assert after == pytest.approx(right / len(rows))
    assert before < 0.5 < 0.9 <= after
    with pytest.raises(ValueError, match="lm-eval knows no task 'no_such_task'"):
        session.benchmark(["no_such_task"], include_path=tmp_path)
    # greedy: the continuation the model writes itself; generation: the session's own
    bridge = SessionLM(session.model, session.tokenizer)
    written = [(p, str(session.generate(p, raw=True, max_new_tokens=6)))
               for p in (prompt_and_reference(ex, session.tokenizer)[0] for ex in session.heldout_examples)]
    prompt, reply = next((p, r) for p, r in written if len(r) >= 3 and not r[0].isspace())
    ((_, greedy),) = bridge.loglikelihood([Request(prompt + reply[0], reply[1:])])
    assert greedy
    whole, cut = bridge.generate_until([Request(prompt, {"until": ["\n\n\n"], "max_gen_toks": 6}),
                                        Request(prompt, {"until": [reply[1:3]], "max_gen_toks": 6})])
    assert (whole, cut) == (reply, reply[:1])


@pytest.mark.slow
def test_run_file_benchmark_entry_scores_before_and_after(tmp_path, monkeypatch):
    import yaml

    from nbtune.cli import main as cli

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    session = nt.Session.demo()
    (tmp_path / "tasks").mkdir()
    rows = [ex for ex in session.heldout_examples if ex.instruction[0].startswith("Which letter is a capital")]
    write_task(tmp_path / "tasks", session, rows)
    session.save_config(tmp_path / "run.yaml", steps=2)
    config = yaml.safe_load((tmp_path / "run.yaml").read_text())
    config["benchmark"] = {"tasks": ["nbtune_capital"], "include_path": "tasks", "limit": 8}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "o")]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    before, after = (summary[f"benchmark_{when}"]["nbtune_capital"]["acc,none"] for when in ("before", "after"))
    assert before in {i / 8 for i in range(9)} and after in {i / 8 for i in range(9)}
    again = nt.Session.demo().benchmark(["nbtune_capital"], include_path=tmp_path / "tasks", limit=8)
    assert again["nbtune_capital"]["acc,none"] == before  # the untrained demo scores the same
