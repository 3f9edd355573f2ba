"""Where a checkpointed, chunked-loss step spends its time (issue 38): the 125M Llama shape of
``benchmarks/peers.py`` (32k vocabulary), fp32, full finetuning, batch 2 x 512, activation
checkpointing and the loss in 8 pieces, nothing else running.

    python benchmarks/head_profile.py profile   # torch.profiler table, by op and input shape
    python benchmarks/head_profile.py current   # seconds a step, 6 steps after 2 untimed
    python benchmarks/head_profile.py nockpt    # the same with the pieces not checkpointed
                                                # (the head not recomputed in backward; since
                                                # the pieces make their gradients in forward,
                                                # ``current`` does not recompute it either)
    .venv-torchtune/bin/python benchmarks/head_profile.py torchtune-profile   # or torchtune:
                                                # torchtune 0.6.1's own step, the same shape

Measured (2 cores, AVX2, 2026-11-26, two profiles; results/head-profile/ holds the second):
the head and its loss take 28-31 % of the step's CPU time: its forward (run twice: once more in
backward) 0.35-0.36 s a step, its weight gradient 0.32-0.41 s (a [32000, 128] x [128, 768]
product per piece: 128 tokens deep, 1.8-2.4x slower a FLOP than the forward's), its input gradient 0.16 s, adding up the pieces' weight
gradients about 0.08 s. Not recomputing the head gains 2-4 % (315-319 -> 326-327 tokens/s in
two alternating pairs): the recompute alone is not the gap to torchtune (0.83x in issue 38's
measurement), which keeps each piece's log-probabilities (B x T x V in float32) instead.

Side by side with torchtune 0.6.1 (its venv: ``benchmarks/peers.py`` makes it), the same shape,
checkpointing and 8 output chunks, on a second machine (2 cores, AMD EPYC, AVX-512; 2026-11-26):

    .venv-torchtune/bin/python benchmarks/head_profile.py torchtune-profile
    python benchmarks/head_profile.py profile

two steps took 15.08 and 14.22 s of CPU in nbtune and 13.49 and 13.24 s in torchtune (two
profiles: 0.89x, 0.93x; results/head-profile/ holds the second of each). The same kernels at the
same shapes take the same time in both; the difference is the head recomputed per piece: its
forward product [128, 768] x [768, 32000] runs 32 times in nbtune (2.15, 2.22 s) and 16 in
torchtune (1.17, 1.12 s), its log-softmax 32 and 16 times (+0.13, +0.15 s): 1.1-1.25 s, as much
as or more than the whole difference (the head's weight gradient, 1.54-1.67 against 1.45-1.46 s,
is within run to run noise). Attention (GQA through ``enable_gqa`` against torchtune's expanded
keys) and the fused AdamW take the same time. Timed, in two alternating rounds (timings.txt):
torchtune 169, 162 tokens/s; nbtune with the pieces not recomputed 173, 174; nbtune now 157,
137. On this machine the recompute is 7-9 % of the step's CPU time, not 2-4 %: its share follows
how fast the machine's matmuls are. It is the gap.
"""
import sys
import time
from pathlib import Path

import torch
from torch.profiler import profile, ProfilerActivity

mode = sys.argv[1] if len(sys.argv) > 1 else "profile"
OUT = Path(__file__).resolve().parent / "results" / "head-profile"


def report(step, name: str) -> None:
    """Profile two steps after two untimed ones (``*profile``), or time six."""
    step(); step()
    if mode.endswith("profile"):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(2):
                step()
        table = prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=30,
            max_shapes_column_width=60)
        print(table)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"{name}.txt").write_text(table + "\n")
    else:
        began = time.perf_counter()
        for _ in range(6):
            step()
        s = (time.perf_counter() - began) / 6
        print(f"{mode}: {s:.3f} s/step, {1024 / s:.0f} tokens/s")


if mode.startswith("torchtune"):  # torchtune's own model, chunked output and loss
    from torchtune import training
    from torchtune.models.llama3._component_builders import llama3
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    torch.manual_seed(0)
    tt = llama3(vocab_size=32000, num_layers=12, num_heads=12, num_kv_heads=4, embed_dim=768,
                max_seq_len=1024, intermediate_dim=2048, norm_eps=1e-5, rope_base=500000.0)
    training.set_activation_checkpointing(tt, auto_wrap_policy={TransformerSelfAttentionLayer})
    loss_fn = CEWithChunkedOutputLoss()
    tt.set_num_output_chunks(loss_fn.num_output_chunks)
    adamw = torch.optim.AdamW(tt.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, 32000, (2, 512), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)

    def tt_step():
        loss = loss_fn(tt(ids), labels)
        loss.backward()
        adamw.step()
        adamw.zero_grad(set_to_none=True)

    report(tt_step, "torchtune-profile")
    sys.exit()

import nbtune as nt
import nbtune.loss as L
from nbtune.models import CausalLM, ModelConfig
from nbtune.data import IGNORE, BatchStream, Sample
from nbtune.run.trainer import Trainer

shape = dict(vocab=32000, hidden=768, mlp=2048, layers=12, heads=12, kv=4, batch=2, seq=512)
config = ModelConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["mlp"],
                     num_layers=shape["layers"], num_heads=shape["heads"], num_kv_heads=shape["kv"],
                     max_position_embeddings=1024, rope_theta=500000.0, head_dim=64)
torch.manual_seed(0)
model = CausalLM(config); model.reset_parameters()
gen = torch.Generator().manual_seed(1)
samples = []
for _ in range(2 * 12):
    ids = torch.randint(0, shape["vocab"], (shape["seq"],), generator=gen)
    samples.append(Sample(input_ids=ids, labels=torch.cat([ids[1:], torch.tensor([IGNORE])])))
class Batches:
    pad_id = 0
    def stream(self, t): return BatchStream(samples, shape["batch"], pad_id=0, seed=0), []
    def problems(self, t): return []
    def eval_batches(self, t): return []
t = nt.Techniques(batch_size=2, seq_len=512, lr=1e-5, activation_checkpointing=True, chunked_loss=8)
if mode == "nockpt":  # the pieces without their checkpoint: the head is not recomputed
    L.checkpoint = lambda fn, *a, use_reentrant=False: fn(*a)
trainer = Trainer(model, Batches(), t, torch.device("cpu"))
report(lambda: trainer.step(track=False), "profile")
