"""What writing held-out replies together saves: ``evaluate()``'s greedy replies to 8 held-out
questions of SmolLM2-135M-Instruct's JSON task (its embedded GGUF, LoRA), one prompt at a time
(``generate_ids``, as evaluate() wrote them before) against 2, 4 and 8 at once
(``greedy_replies``, left-padded), each arm timed in alternating rounds; the replies must be
the same ids. One CPU thread (a core of the 2-core machines).

    python benchmarks/batched_replies.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--out", default=str(HERE / "results" / "replies" / "batched.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    import nbtune as nt
    from nbtune.data import prompt_and_reference, prompt_ids
    from nbtune.demos import data_file
    from nbtune.generate import generate_ids, greedy_replies

    session = nt.Session.from_pretrained(nt.smollm2_path(), data_file("smollm2", "train"),
                                         heldout=data_file("smollm2", "heldout"),
                                         techniques=nt.Techniques(method="lora", batch_size=4, seq_len=96))
    tokenizer, model = session.parts.tokenizer, session.model.eval()
    asked = [prompt_and_reference(row, tokenizer) for row in session.heldout_examples[:args.rows]]
    prompts = [prompt_ids(tokenizer, prompt) for prompt, _ in asked]
    budgets = [len(tokenizer.encode(reference)) + 4 for _, reference in asked]

    def alone():
        return [generate_ids(model, p, max_new_tokens=b, stop_ids=tokenizer.stop_ids)
                for p, b in zip(prompts, budgets)]

    def together(at_once):
        def write():
            return [ids for i in range(0, len(prompts), at_once)
                    for ids in greedy_replies(model, prompts[i:i + at_once], budgets[i:i + at_once],
                                              stop_ids=tokenizer.stop_ids)]
        return write

    arms = {"1 at a time": alone, **{f"{n} at once": together(n) for n in (2, 4, 8)}}
    seconds = {name: [] for name in arms}
    replies = {}
    for round_ in range(args.rounds):
        for name in (list(arms) if round_ % 2 == 0 else list(arms)[::-1]):
            began = time.perf_counter()
            replies[name] = arms[name]()
            seconds[name].append(time.perf_counter() - began)
    base = statistics.median(seconds["1 at a time"])
    result = {
        "machine": platform.processor() or platform.machine(), "threads": 1, "rows": args.rows,
        "prompt_tokens": [len(p) for p in prompts], "budgets": budgets,
        "tokens_written": sum(map(len, replies["1 at a time"])),
        "seconds": {name: [round(s, 2) for s in times] for name, times in seconds.items()},
        "speedup": {name: round(base / statistics.median(times), 2) for name, times in seconds.items()},
        "same_replies": all(replies[name] == replies["1 at a time"] for name in arms),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    if not result["same_replies"]:
        raise SystemExit("the replies written together differ from those written alone")


if __name__ == "__main__":
    main()
