"""The run factory: one finetuning run's parts, built once for either front end.

``Session`` (the notebook) and ``nbtune train`` (unattended, and under torchrun) both build
their run here, from a model and data, a model folder or Hub id, a demo or a run file, and
both drive what is built: its ``trainer`` (the training state), its ``runner`` (run control
and events) and the operations on the run as a whole (checkpoints, saves, held-out scores).
The session adds the notebook's side (printing in the cell, the panel, charts, questions
for the estimator); the CLI adds its output folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..adapters import (TECHNIQUES_NOTE, AdapterError, adapter_techniques, base_of, is_adapter_folder,
                        load_adapter_weights, read_adapter, trained_record)
from ..data import (Data, DataError, Example, StreamedRows, TextRow, TrainingData, check_renderable, examples_from,
                   read_rows,
                   prompt_and_reference, prompt_ids, prompt_text)
from ..generate import Reply, TextStream, generate_ids, greedy_replies
from ..hub import resolve_model_folder
from ..memory.usage import note_runtime
from ..models import Tokenizer, load_model
from ..models.loading import read_config
from ..models.decoder import CausalLM
from ..models.gguf import GGUFFile, gguf_tokenizer, is_gguf
from .runner import Runner
from ..shards import build_sharded, is_sharded
from ..techniques import RULES, Techniques, as_techniques
from .trainer import Trainer


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def demo_data_file(split: str, demo: str = "tiny") -> Path:
    """Path of a split ("train" or "heldout") of a demo's dataset shipped with nbtune."""
    from ..demos import data_file

    return data_file(demo, split)


@dataclass(eq=False)
class Run:
    """One run's parts. ``source``: the base model's folder, repo id or ``.gguf`` file;
    ``match``: how ``evaluate`` scores replies; ``data_files``, ``demo_name`` and ``settings``
    (a run file's ``run`` section): what ``save_config`` writes back."""

    trainer: Trainer
    runner: Runner
    tokenizer: Tokenizer
    device: torch.device
    parallel: object = None  # a distributed.Parallel under torchrun (FSDP2), else None
    source: str | None = None
    match: str | Callable[[str, str], bool] = "exact"
    data_files: dict = field(default_factory=dict)
    demo_name: str | None = None
    settings: object = None

    ranks = None  # a kernel driving ranks: ``ranked.RankedRun``
    data = property(lambda self: self.trainer.data)
    model = property(lambda self: self.trainer.model)
    techniques = property(lambda self: self.trainer.techniques)
    history = property(lambda self: self.trainer.history)
    base_changed = property(lambda self: self.trainer.base_changed)

    def close(self) -> None:
        """Nothing to end: the run lives in this process (``ranked.RankedRun`` ends its ranks)."""

    # ---- the state on disk ------------------------------------------------------------------

    def save_checkpoint(self, folder: str | os.PathLike) -> Path:
        """Weights or adapters, optimizer state, RNG, data position and history."""
        from ..sharded_checkpoint import save_checkpoint

        return save_checkpoint(self.trainer, folder, self.source, self.parallel)

    def load_checkpoint(self, folder: str | os.PathLike) -> None:
        """Continue from ``save_checkpoint``'s folder; the runner then measures and tells."""
        from ..sharded_checkpoint import load_checkpoint

        with self.runner.replacing():
            load_checkpoint(self.trainer, folder, self.parallel)

    def save(self, folder: str | os.PathLike, merge: bool = False, format: str = "hf",
             quantization: str | None = None) -> Path:
        """The trained model as ``Session.save`` describes it (HF, PEFT, merged or GGUF)."""
        from ..checkpoint import check_save_args, save_session
        from ..sharded_checkpoint import save_sharded_session

        if format == "gguf" and quantization is None:
            quantization = "f16"
        check_save_args(format, quantization)
        save = save_session if self.parallel is None else save_sharded_session
        return save(self, folder, merge=merge, format=format, quantization=quantization)

    # ---- using the model --------------------------------------------------------------------

    def generate(self, prompt: str, *, input: str = "", max_new_tokens: int = 48,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 raw: bool = False, stream=None) -> Reply:
        """``Session.generate``: the prompt written as training rows are unless ``raw``."""
        if not isinstance(prompt, str) or not isinstance(input, str):
            raise TypeError(f"generate: prompt and input must be strings, got "
                            f"{type(prompt).__name__} and {type(input).__name__}.")
        return self._reply(prompt if raw else prompt_text(self.tokenizer, prompt, input),
                           stream, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_p=top_p, seed=seed)

    def _reply(self, text: str, stream, *, max_new_tokens, temperature, top_p, seed) -> Reply:
        """Generate after ``text``; ``stream``: True prints each piece as it is made, a
        function is given each piece."""
        if stream is True:
            def stream(piece: str) -> None:
                print(piece, end="", flush=True)
        elif stream is not None and not callable(stream):
            raise TypeError(f"stream={stream!r}: pass True (print as it comes) or a function "
                            "that takes each piece of text.")
        generator = torch.Generator(self.device).manual_seed(seed) if seed is not None else None
        pieces = TextStream(self.tokenizer.decode, stream) if stream else None
        was_training = self.model.training
        self.model.eval()
        try:
            new = generate_ids(self.model, prompt_ids(self.tokenizer, text),
                               max_new_tokens=max_new_tokens, stop_ids=self.tokenizer.stop_ids,
                               temperature=temperature, top_p=top_p, generator=generator,
                               on_token=pieces)
        finally:
            self.model.train(was_training)
        if pieces is not None:
            pieces(new, last=True)  # what a cut-off character held back
        return Reply(self.tokenizer.decode(new))

    def chat(self, message: str, history: list[dict], stream, **settings) -> Reply:
        """``Session.chat``: ``message`` after ``history`` (role/content dicts), through the
        model's chat template; ``settings``: generation's (max_new_tokens, temperature, ...)."""
        if not isinstance(message, str):
            raise TypeError(f"chat: the message must be a string, got {type(message).__name__}.")
        if self.tokenizer.chat_template is None:
            raise ValueError("This model has no chat template, so it cannot hold a conversation: "
                             "use session.generate(prompt), which writes the prompt as its "
                             "training rows were written.")
        turns = history + [{"role": "user", "content": message}]
        reply = self._reply(self.tokenizer.render_chat(turns, add_generation_prompt=True), stream,
                            **settings)
        history += [{"role": "user", "content": message}, {"role": "assistant", "content": str(reply)}]
        return reply

    def evaluate(self, examples: Iterable[Example] | None = None,
                 match: str | Callable[[str, str], bool] | None = None) -> float:
        """``Session.evaluate``: the share of greedy replies that match the references; for
        preference pairs, the share of pairs whose chosen completion the model ranks above the
        rejected one (by the objective's reward; under ``sft``, the average log-probability)."""
        from ..data import Pair, PromptRow, TextRow
        from ..scoring import resolve_match

        matches = resolve_match(self.match if match is None else match)
        examples = list(self.data.heldout if examples is None else examples)
        if not examples:
            raise DataError("No held-out rows to evaluate on: pass heldout= when creating the "
                            "session, or give examples.")
        if self.trainer.techniques.objective == "grpo":
            return self._mean_reward(examples)
        if isinstance(examples[0], Pair):
            return self._ranked_right(examples)
        if isinstance(examples[0], TextRow):
            raise DataError("These held-out rows are raw text, with no question and answer to compare "
                            "a reply with: eval_every measures the model's loss on them instead; "
                            "evaluate() takes rows with answers (instruction, chat or pairs).")
        if isinstance(examples[0], PromptRow):
            raise DataError("These held-out rows are prompts alone, with no answer to compare a reply "
                            "with: evaluate on rows with answers (instruction, chat or pairs), or under "
                            "objective='grpo', where evaluate() answers their mean reward.")
        hits = 0
        asked = [prompt_and_reference(ex, self.tokenizer) for ex in examples]
        replies = self._greedy([prompt for prompt, _ in asked],
                               [len(self.tokenizer.encode(reference)) + 4 for _, reference in asked],
                               self.tokenizer, self.trainer.techniques.batch_size)
        for (_, reference), reply in zip(asked, replies):
            hits += bool(matches(reply, reference))
        return hits / len(examples)

    def _greedy(self, texts: list[str], budgets: list[int], tokenizer: Tokenizer, at_once: int,
                int8: bool = False) -> list[str]:
        """Greedy replies to ``texts`` (rendered prompts), ``at_once`` in one batch
        (``greedy_replies``; ``int8``: its KV cache in 8 bits)."""
        at_once, was_training = max(1, at_once), self.model.training
        self.model.eval()
        try:
            replies = []
            for start in range(0, len(texts), at_once):
                new = greedy_replies(self.model, [prompt_ids(tokenizer, text) for text in texts[start:start + at_once]],
                                     budgets[start:start + at_once], stop_ids=tokenizer.stop_ids, int8=int8)
                replies += [tokenizer.decode(ids) for ids in new]
        finally:
            self.model.train(was_training)
        return replies


    def _mean_reward(self, examples: list) -> float:
        """GRPO's held-out figure: the mean reward (the weighted sum of ``session.rewards``) of
        one greedy completion of each row's prompt, of at most ``max_completion`` tokens (greedy,
        so the figure before and after training compares the model, not the draws), written as
        many at once as the writing writes, in its cache (``kv_cache``)."""
        from ..data import as_prompt
        from ..objectives.grpo import score

        rewards, t = self.data.rewards, self.trainer.techniques
        if not rewards:
            raise ValueError("evaluate() under objective='grpo' scores completions with the reward "
                             "functions: set session.rewards = [my_reward, ...] first.")
        rows = [as_prompt(row) for row in examples_from(examples, "the rows to evaluate")]
        tokenizer = self.data.tokenizer  # (the training's: its stop tokens)
        texts = self._greedy([prompt_and_reference(row.example, tokenizer)[0] for row in rows],
                             [t.max_completion] * len(rows), tokenizer,
                             min(t.generation_batch or t.generations, t.generations), t.kv_cache == "int8")
        values = score(rewards, rows, texts) @ torch.tensor([r.weight for r in rewards])
        return float(values.mean())

    def _ranked_right(self, pairs: list) -> float:
        """The share of ``pairs`` ranked right, scored as a held-out evaluation is."""
        from ..data import collate_pairs, tokenize_pairs
        from ..step import StepOptions, held_out_loss

        t = self.trainer.techniques
        if t.reference_kind == "precomputed":
            raise ValueError("Held-out pairs are not yet scored against a precomputed reference "
                             "(only the training pairs are precomputed): evaluate with "
                             "reference='adapters_off' (LoRA), or compare generations with rows.")
        tokenized, _ = tokenize_pairs(examples_from(pairs, "the pairs to evaluate"), self.tokenizer,
                                      t.seq_len, "the pairs to evaluate")
        batches = [collate_pairs(tokenized[i:i + t.batch_size], self.tokenizer.pad_id)
                   for i in range(0, len(tokenized), t.batch_size)]
        options = StepOptions.of(t, objective=t.objective if t.paired else "simpo")  # (sft, grpo: avg log-prob)
        return held_out_loss(self.trainer.model, batches, options, device=self.trainer.device,
                             track=False, copy=self.trainer.reference_copy).preference.accuracy


# ---- building ---------------------------------------------------------------------------------

def assemble(model: CausalLM, tokenizer: Tokenizer, train: Iterable[Example] | str, *,
             heldout: Iterable[Example] | str | None = None,
             techniques: Techniques | dict | None = None, device=None, parallel=None,
             source: str | None = None, base=None) -> Run:
    """A run of a built ``model`` on ``train`` rows. What building it had to say (rows
    skipped) waits in the trainer's notes: the caller relays them once it listens."""
    ids, rows = tokenizer.backend.get_vocab_size(with_added_tokens=True), model.config.vocab_size
    if ids > rows:  # else the first token id past the embedding fails deep in a step
        raise ValueError(f"The tokenizer has {ids:,} tokens but the model's embedding has {rows:,} "
                         f"rows, so ids from {rows:,} on would index past it. Use the tokenizer "
                         "that came with this model, or a model whose embedding covers this "
                         "vocabulary.")
    if parallel is not None:
        device = parallel.device
    device = torch.device(device) if device is not None else default_device()
    data = TrainingData(train, tokenizer, heldout)
    techniques, followed = _fit_context(techniques, model.config.max_position_embeddings)
    if parallel is not None and not is_sharded(model):  # a whole model: each rank keeps its share
        model = build_sharded(model, model.config, techniques, parallel)
    trainer = Trainer(model, data, techniques, device, parallel=parallel, base=base, base_name=source)
    if followed:
        trainer.notes.append(followed)
    return Run(trainer, Runner(trainer), tokenizer, device, parallel=parallel, source=source)


def _fit_context(techniques, limit: int) -> tuple[Techniques, str | None]:
    """A ``seq_len`` the user did not choose (none given, or the default) follows a model whose
    context is shorter, and says so; a chosen one stays, to be refused with its fix."""
    t, default = as_techniques(techniques), Techniques.__dataclass_fields__["seq_len"].default
    chosen = "seq_len" in techniques if isinstance(techniques, dict) else t.seq_len != default
    if t.seq_len <= limit or chosen:
        return t, None
    return t.replace(seq_len=limit), (
        f"seq_len follows the model: its context is {limit} tokens, shorter than the default "
        f"seq_len of {default}; set seq_len to choose a length.")


@dataclass
class RunSpec:
    """A run resolved from what it was given (a model's folder, Hub id or .gguf file, an
    adapter folder on its base, a demo, a run file) before anything loads: ``build`` makes
    every run from one of these, in one place. ``given``: the techniques as the user gave
    them (whether they chose seq_len, ``assemble``); ``seed``: torch's, set before building
    (a run file's, so that two runs of it agree)."""

    model: str | os.PathLike  # the base: a folder, Hub repo id or .gguf file
    train: list | None
    heldout: list | None
    techniques: Techniques
    given: Techniques | dict | None
    adapter: object = None  # an adapters.Adapter to load on the base
    device: object = None
    revision: str | None = None
    parallel: object = None
    data_files: dict = field(default_factory=dict)
    match: str | Callable[[str, str], bool] = "exact"
    demo_name: str | None = None
    settings: object = None
    memory_tracking: str | None = None
    seed: int | None = None
    rewards: tuple = ()  # GRPO's reward functions (``objectives.grpo.Reward``), a run file's
    notes: list = field(default_factory=list)  # what resolving it has to say (relayed once built)


def pretrained_spec(path_or_id: str | os.PathLike, data=None, *, heldout=None,
                    techniques: Techniques | None = None, device=None,
                    revision: str | None = None, parallel=None, base=None) -> RunSpec:
    """``from_pretrained``'s run, resolved: an adapter folder on its ``base`` (the one it
    names, or the one given), the data read (first, to fail fast on bad rows)."""
    given = techniques  # as the user gave it: did they choose seq_len? (``assemble``)
    adapter = read_adapter(path_or_id) if is_adapter_folder(path_or_id) else None
    said = []
    if adapter is not None:
        # a Techniques given replaces the adapter's; a dict changes them
        trained, said = _trained(adapter, device) if not isinstance(techniques, Techniques) else (None, [])
        techniques = given = adapter_techniques(adapter, techniques, trained)
        path_or_id = base_of(adapter, base)
    elif base is not None:
        raise ValueError(f"base={base!r} is for an adapter folder; {path_or_id} is a whole model.")
    train = read_rows(data) if data is not None else None
    held = examples_from(heldout, "the held-out data") if heldout is not None else None
    if techniques is None and train and isinstance(train[0], TextRow):
        techniques = given = {"packing": True}  # raw text: pieces of all lengths, packed into full rows
        said.append("the rows are raw text: packing is on (every token trained, the rows filled)")
    files = {split: _data_file(value) for split, value in (("train", data), ("heldout", heldout))
             if isinstance(getattr(value, "path", value), (str, os.PathLike))}
    return RunSpec(path_or_id, train, held, as_techniques(techniques), given, adapter, device,
                   revision, parallel, files, notes=said)


def _data_file(value) -> str | dict:
    """Where rows given by path came from, for ``save_config``: the path, or an ``nt.Data``'s
    path, split, revision and columns."""
    if not isinstance(value, Data):
        return str(value)
    entry = {"path": str(value.path), "split": value.split, "revision": value.revision,
             "columns": dict(value.columns) if value.columns else None,
             "streaming": value.streaming or None, "buffer": value.buffer if value.streaming else None}
    return {key: v for key, v in entry.items() if v is not None}


# What the data given now decides, not the note: its form (pairs, prompts, instruction rows)
# and whether it has held-out rows.
_FROM_THE_DATA = ("objective", "reference", "eval_every")


def _trained(adapter, device) -> tuple[Techniques | None, list[str]]:
    """The techniques the adapter was trained with, checked as a run file's are (a damaged or
    hostile note is refused by name, before anything loads), and what was left out of them
    in words: fields the data decides, ones an older nbtune does not know, and ones this
    device cannot run (back to LoRA's defaults)."""
    from pydantic import ValidationError

    from ..runfile import TechniquesFields

    record, said = trained_record(adapter), []
    if record is None:
        return None, said
    note = adapter.folder / TECHNIQUES_NOTE
    known = set(TechniquesFields.model_fields)
    unknown = sorted(set(record) - known)
    if unknown:
        said.append(f"{note.name}: {', '.join(unknown)} unknown to this nbtune, left out")
    kept = {k: v for k, v in record.items() if k in known and k not in _FROM_THE_DATA}
    try:
        t = Techniques(**TechniquesFields.model_validate(kept).model_dump())
    except (ValidationError, TypeError, ValueError) as err:
        first = " ".join(str(err).splitlines()[:3])
        raise AdapterError(f"{note} does not hold the techniques the adapter was trained with "
                           f"({first}). Delete the file to load the adapter with the default "
                           "techniques, or save the adapter again.") from None
    said.insert(0, f"the adapter's training settings came back from {note.name} (lr={t.lr:g}, "
                   f"seq_len={t.seq_len}, batch_size={t.batch_size}, ...): techniques= changes them")
    target, plain = torch.device(device or default_device()).type, Techniques(method="lora")
    for _ in range(len(RULES)):  # each pass puts one refused rule's fields back to the defaults
        refused = t.conflicts(target)
        if not refused:
            break
        back = {name: getattr(plain, name) for name in refused[0].fields}
        said.append(f"{', '.join(f'{k}={getattr(t, k)!r}' for k in back)} left at the default "
                    f"here ({refused[0].reason})")
        t = t.replace(**back)
    return t, said


def demo_spec(name: str = "tiny", techniques: Techniques | dict | None = None, device=None,
              parallel=None, **changes) -> RunSpec:
    """``Session.demo``'s run, resolved: the demo's model, data and techniques (``changes``
    on top)."""
    from ..demos import demo_named

    demo = demo_named(name)
    if isinstance(techniques, dict):  # a few fields: on top of the demo's (its seq_len fits)
        techniques, changes = None, {**techniques, **changes}
    techniques = (as_techniques(techniques) if techniques is not None
                  else demo.techniques).replace(**changes)
    spec = pretrained_spec(demo.model(), demo_data_file("train", name),
                           heldout=demo_data_file("heldout", name), techniques=techniques,
                           device=device, parallel=parallel)
    spec.match, spec.demo_name = demo.match, name
    return spec


def config_spec(config, *, overrides: dict | None = None, device=None, parallel=None) -> RunSpec:
    """A run file's run (``save_config`` writes one) or a loaded ``RunConfig``'s, resolved.

    ``overrides`` are dotted fields that win over the file (``{"techniques.lr": 1e-4}``); a
    bad field is refused naming its line (``RunFileError``) before anything loads."""
    from .. import runfile

    if not isinstance(config, runfile.RunConfig):
        config = runfile.load(config, overrides)
    elif overrides:
        raise ValueError("overrides apply to a run file path; change a RunConfig with "
                         "config.model_copy(update=...) instead.")
    techniques = config.to_techniques()
    device = device or config.device
    if config.demo is not None:
        spec = demo_spec(config.demo, techniques=techniques, device=device, parallel=parallel)
    else:
        spec = pretrained_spec(config.path(config.model), config.data_source(config.data.train),
                               heldout=config.data_source(config.data.heldout), techniques=techniques,
                               device=device, revision=config.revision, parallel=parallel)
        spec.match = config.data.match
    spec.memory_tracking, spec.settings, spec.seed = config.memory_tracking, config.run, techniques.seed
    spec.rewards = config.to_rewards()  # (the user's Python, read before the model loads)
    return spec


def build(spec: RunSpec) -> Run:
    """The run ``spec`` says, built: the tokenizer and the model read (each rank its rows of
    every weight, under torchrun; NF4 as each weight is read for QLoRA), the trainer and
    runner made (``assemble``), an adapter loaded on it."""
    note_runtime()  # the process before it loads: what every CPU step's figure leaves out
    if spec.seed is not None:
        torch.manual_seed(spec.seed)  # adapters' initial values and dropout: repeatable runs
    techniques, parallel, device = spec.techniques, spec.parallel, spec.device
    if is_gguf(spec.model):
        base = GGUFFile(spec.model)  # parsed once for the tokenizer and the weights
        tokenizer = gguf_tokenizer(base)
    else:
        base = resolve_model_folder(spec.model, spec.revision)
        tokenizer = Tokenizer.from_folder(base)
    train = [spec.train.first] if isinstance(spec.train, StreamedRows) else spec.train  # (the rest as read)
    check_renderable((train or []) + (spec.heldout or []), tokenizer)
    if parallel is not None:  # each rank reads its rows of every weight, nothing whole
        config = read_config(base)
        fitted, _ = _fit_context(spec.given, config.max_position_embeddings)
        model = build_sharded(base, config, fitted, parallel)
    else:
        model = load_model(base, dtype=techniques.dtype, device=device or default_device(),
                           quantize=techniques.nf4_targets)  # NF4 as each weight is read: lean loading
    run = assemble(model, tokenizer, spec.train, heldout=spec.heldout, techniques=spec.given,
                   device=device, parallel=parallel, source=str(spec.model), base=base)
    if spec.adapter is not None:
        load_adapter_weights(run.model, spec.adapter)
    run.data_files, run.match, run.demo_name, run.settings = (spec.data_files, spec.match,
                                                              spec.demo_name, spec.settings)
    if spec.memory_tracking is not None:
        run.runner.sampler.mode = spec.memory_tracking
    if spec.rewards:
        run.trainer.data.rewards = spec.rewards
    run.trainer.notes += spec.notes
    return run


def from_pretrained(path_or_id: str | os.PathLike, data=None, **options) -> Run:
    """A Hugging Face folder, Hub repo id, ``.gguf`` file or saved LoRA adapter folder, and
    the training data (JSONL path, rows or a datasets.Dataset; None to chat, evaluate or save
    only: training then says it needs data); ``options`` as ``pretrained_spec`` takes them."""
    return build(pretrained_spec(path_or_id, data, **options))


def from_demo(name: str = "tiny", techniques: Techniques | dict | None = None, device=None,
              parallel=None, **changes) -> Run:
    """``Session.demo``'s run: the demo's model, data and techniques (``changes`` on top)."""
    return build(demo_spec(name, techniques, device, parallel, **changes))


def from_config(config, *, overrides: dict | None = None, device=None, parallel=None) -> Run:
    """A run file's run (``config_spec``); torch's random generator is seeded with
    ``techniques.seed`` first, so two runs of a file agree."""
    return build(config_spec(config, overrides=overrides, device=device, parallel=parallel))
