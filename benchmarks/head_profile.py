"""Where a checkpointed, chunked-loss step spends its time (issue 38): the 125M Llama shape of
``benchmarks/peers.py`` (32k vocabulary), fp32, full finetuning, batch 2 x 512, activation
checkpointing and the loss in 8 pieces, nothing else running.

    python benchmarks/head_profile.py profile   # torch.profiler table, by op and input shape
    python benchmarks/head_profile.py current   # seconds a step, 6 steps after 2 untimed
    python benchmarks/head_profile.py nockpt    # the same with the pieces not checkpointed
                                                # (the head not recomputed in backward)

Measured (2 cores, AVX2, 2026-11-26, two profiles; results/head-profile/ holds the second):
the head and its loss take 28-31 % of the step's CPU time: its forward (run twice: once more in
backward) 0.35-0.36 s a step, its weight gradient 0.32-0.41 s (a [32000, 128] x [128, 768]
product per piece: 128 tokens deep, 1.8-2.4x slower a FLOP than the forward's), its input gradient 0.16 s, adding up the pieces' weight
gradients about 0.08 s. Not recomputing the head gains 2-4 % (315-319 -> 326-327 tokens/s in
two alternating pairs): the recompute alone is not the gap to torchtune (0.83x in issue 38's
measurement), which keeps each piece's log-probabilities (B x T x V in float32) instead.
"""
import sys
import time
from pathlib import Path

import torch
from torch.profiler import profile, ProfilerActivity
import nbtune as nt
import nbtune.loss as L
from nbtune.models import CausalLM, ModelConfig
from nbtune.data import IGNORE, BatchStream, Sample
from nbtune.trainer import Trainer

mode = sys.argv[1] if len(sys.argv) > 1 else "profile"
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
trainer.step(track=False); trainer.step(track=False)
if mode == "profile":
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            trainer.step(track=False)
    table = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=30, max_shapes_column_width=60)
    print(table)
    out = Path(__file__).resolve().parent / "results" / "head-profile" / "profile.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
else:
    began = time.perf_counter()
    for _ in range(6):
        trainer.step(track=False)
    s = (time.perf_counter() - began) / 6
    print(f"{mode}: {s:.3f} s/step, {1024 / s:.0f} tokens/s")
