"""Every figure the README and the documentation site quote from a committed benchmark result
is the figure in that file: a rerun changes the file, and without this the pages would go on
quoting the run before (reading files only, no model runs)."""

from __future__ import annotations

import json
import re
import statistics
from decimal import ROUND_HALF_UP, Decimal
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
RESULTS = "benchmarks/results"
README, INDEX, GPU = "README.md", "docs/benchmarks/index.md", "docs/benchmarks/gpu.md"
INSTALL, MEMORY = "docs/get-started/install.md", "docs/guides/memory.md"
GPUS, LONG = "docs/guides/several-gpus.md", "docs/guides/long-contexts.md"
MIB, GIB = 2 ** 20, 2 ** 30


@cache
def page(path: str) -> str:
    """A page's text with its line breaks and runs of spaces made single spaces."""
    return " ".join((ROOT / path).read_text().split())


@cache
def load(path: str):
    """A JSON results file parsed; a results folder (or its README) as {file name: parsed JSON,
    "README.md": its text} of the files in it."""
    file = ROOT / path
    if file.suffix == ".json":
        return json.loads(file.read_text())
    folder = file if file.is_dir() else file.parent
    out = {f.name: json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))}
    if (folder / "README.md").exists():
        out["README.md"] = (folder / "README.md").read_text()
    return out


def half_up(value: float, places: int = 0) -> str:
    """A figure the file stores already rounded, rounded again as a reader does (46.55 -> 46.6;
    Python's format would give 46.5, the float being 46.549...)."""
    step = Decimal(1).scaleb(-places)
    return str(Decimal(repr(value)).quantize(step, rounding=ROUND_HALF_UP))


def mib(n: float) -> str:
    return f"{n / MIB:,.0f}"


def signed_pct(error: float) -> str:
    """The pages' error column: one decimal under 15 %, whole percents above, a real minus."""
    percent = abs(Decimal(repr(error))) * 100  # the file stores it to 4 decimals: -0.0725 is 7.3 %
    text = half_up(float(percent), 1 if percent < 15 else 0)
    return ("−" if error < 0 else "+") + text + " %"


# --- the peers (benchmarks/peers.py) ---------------------------------------------------------

def summaries(result: dict) -> dict:
    """rung -> the run's summary (framework -> medians, plus "ratios"), skipped rungs left out."""
    return {row["rung"]: row["summary"] for row in result["rows"] if row.get("summary")}


def peers_of(summary: dict) -> dict:
    return {f: v for f, v in summary.items() if f != "ratios" and not f.startswith("nbtune")}


def bold_under_one(ratio: float) -> str:
    text = f"{ratio:.2f}"
    return f"**{text}**" if text < "1.00" else text


def pairs(row: dict, peer: str) -> list[float]:
    """A peer's step time over nbtune's of the same cycle, every pair of the run."""
    return [theirs / mine for a, b in zip(row["runs"]["nbtune"], row["runs"][peer])
            for mine, theirs in zip(a["step_seconds"], b["step_seconds"])]


def epyc_row(rung: str, s: dict) -> str:
    """A row of the index page's first table (AMD EPYC, interleaved steps)."""
    ours, peers, per_step = s["nbtune"], peers_of(s), s["ratios"]["per_step_vs"]
    lightest = min(peers, key=lambda f: peers[f]["peak_bytes"])
    fastest = max(peers, key=lambda f: peers[f]["tokens_per_second"])
    tt = peers["torchtune"]

    def step(peer):
        v = per_step[peer]
        return f"{v['median']:.2f} [{v['q1']:.2f}-{v['q3']:.2f}]"

    return (f"| {rung} | {mib(ours['peak_bytes'])} | {mib(peers[lightest]['peak_bytes'])} ({lightest}) | "
            f"{bold_under_one(ours['peak_bytes'] / peers[lightest]['peak_bytes'])} | "
            f"{ours['tokens_per_second']:.1f} | {tt['tokens_per_second']:.1f} | "
            f"{ours['tokens_per_second'] / tt['tokens_per_second']:.2f} ({step('torchtune')}) | "
            f"{peers[fastest]['tokens_per_second']:.1f} ({fastest}) | "
            f"{ours['tokens_per_second'] / peers[fastest]['tokens_per_second']:.2f} ({step(fastest)}) |")


def epyc_quotes(r: dict) -> list[tuple[str, str]]:
    run = r["peers-125m-cpu.json"]
    s = summaries(run)
    rows = {row["rung"]: row for row in run["rows"] if row.get("summary")}
    quotes = [(INDEX, epyc_row(rung, v)) for rung, v in s.items()]
    # the bytes quoted beside the table
    fp32, ckpt = s["full fp32"], s["+ activation checkpointing"]
    assert max(peers_of(s["QLoRA"]), key=lambda f: peers_of(s["QLoRA"])[f]["tokens_per_second"]) == "transformers"
    n, t = ckpt["nbtune"]["peak_bytes"], ckpt["transformers"]["peak_bytes"]
    quotes += [
        (INDEX, f"it is {(t - n) / 1024:.0f} KB under transformers' ({n:,} against {t:,} bytes"),
        (INDEX, f"gap to transformers' peak ({fp32['transformers']['peak_bytes'] - fp32['nbtune']['peak_bytes']:,} bytes)"),
        (INDEX, f"**QLoRA was 0.86× transformers, now {s['QLoRA']['ratios']['speed_vs_best_peer']:.2f}×**"),
        (INDEX, f"in fp32 all three to the last bit, {fp32['nbtune']['first_loss']!r}"),
        (INDEX, f"LoRA ({mib(s['LoRA']['nbtune']['peak_bytes'])} against "
                f"{mib(s['LoRA']['torchtune']['peak_bytes'])} MiB)"),
    ]
    # the page faults: per framework, its timed steps and those that fault 100 pages or more
    faults = {}
    for row in rows.values():
        for framework, results in row["runs"].items():
            counts = [p for result in results for p in result["page_faults"]]
            total, many = faults.get(framework, (0, 0))
            faults[framework] = (total + len(counts), many + sum(p >= 100 for p in counts))
    steps, many = sum(t for t, _ in faults.values()), sum(m for _, m in faults.values())
    (nb_all, nb), (tf_all, tf), (tt_all, tt) = (faults[f] for f in ("nbtune", "transformers", "torchtune"))
    quotes += [(INDEX, f"{steps - many} of the run's {steps} timed steps fault under 100 pages; "
                       f"the other {many} still fault"),
               (INDEX, f"(nbtune {nb} of {nb_all} steps, transformers {tf} of {tf_all}, torchtune {tt} of {tt_all})")]
    # the verdict against issue 38's goal
    by_tps = {rung: v["nbtune"]["tokens_per_second"] / v["torchtune"]["tokens_per_second"] for rung, v in s.items()}
    quotes.append((INDEX, f"fp32 ({by_tps['full fp32']:.3f}× torchtune by tokens/s) and bf16 ({by_tps['+ bf16']:.3f}×)"))
    faster = {rung: sum(p > 1 for p in pairs(rows[rung], "torchtune")) for rung in s}
    quotes.append((INDEX, f"faster in {faster['+ optimizer in backward']} of {len(pairs(rows['QLoRA'], 'torchtune'))} "
                          f"pairs with the optimizer in backward and with QLoRA"))
    assert faster["+ optimizer in backward"] == faster["QLoRA"]
    quotes += [(INDEX, f"{faster['+ chunked loss']} with the chunked loss, {faster['+ activation checkpointing']} "
                       f"with checkpointing and with LoRA, {faster['+ bf16']} with bf16 and with 8-bit AdamW "
                       f"(whose lower quartile is {s['+ 8-bit AdamW']['ratios']['per_step_vs']['torchtune']['q1']:.2f}"),
               (INDEX, f"and {faster['full fp32']} with fp32 (median "
                       f"{s['full fp32']['ratios']['per_step_vs']['torchtune']['median']:.3f})")]
    assert faster["+ activation checkpointing"] == faster["LoRA"] and faster["+ bf16"] == faster["+ 8-bit AdamW"]
    fastest = [v["ratios"]["speed_vs_best_peer"] for v in s.values()]
    per_step = [v["ratios"]["per_step_vs"][max(peers_of(v), key=lambda f: peers_of(v)[f]["tokens_per_second"])]["median"]
                for v in s.values()]
    quotes.append((INDEX, f"Against the fastest peer it is at {min(fastest):.2f}× or above by tokens/s and "
                          f"{min(per_step):.2f}× or above per step everywhere"))
    return quotes


def glibc_defaults_quotes(result: dict) -> list[tuple[str, str]]:
    """The three interleaved runs with glibc's defaults (this one and the two before it), pooled."""
    runs = [result] + [load(f"{RESULTS}/peers/epyc-avx512/peers-125m-cpu-interleaved-run-{n}.json") for n in (1, 2)]
    pooled = {}
    for run in runs:
        for row in run["rows"]:
            if row.get("summary"):
                for peer in ("torchtune", "transformers"):
                    if peer in row["runs"]:
                        pooled.setdefault((row["rung"], peer), []).extend(pairs(row, peer))

    def tt(rung):  # the median of the pairs against torchtune
        return f"{statistics.median(pooled[rung, 'torchtune']):.2f}"

    def faster(rung):  # in how many of them nbtune's step was the faster
        p = pooled[rung, "torchtune"]
        return f"{sum(x > 1 for x in p)} of {len(p)}"

    return [
        (INDEX, f"- {tt('full fp32')} for fp32 (nbtune faster in {faster('full fp32')} pairs) "
                f"and {tt('+ bf16')} for bf16;"),
        (INDEX, f"- {tt('+ activation checkpointing')} for checkpointing ({faster('+ activation checkpointing')}) "
                f"and {tt('+ chunked loss')} for the chunked loss;"),
        (INDEX, f"- {tt('+ optimizer in backward')} for the optimizer in backward ({faster('+ optimizer in backward')}) "
                f"and {tt('+ 8-bit AdamW')} for 8-bit AdamW ({faster('+ 8-bit AdamW')});"),
        (INDEX, f"- {tt('LoRA')} for LoRA and {tt('QLoRA')} for QLoRA ({faster('QLoRA')})."),
        (INDEX, f"({statistics.median(pooled['QLoRA', 'transformers']):.2f}× step by step "
                f"over the three interleaved runs)"),
    ]


def run_1_quotes(result: dict) -> list[tuple[str, str]]:
    """The first interleaved run, before the peers' batch was counted."""
    chunked = summaries(result)["+ chunked loss"]
    return [(INDEX, f"({chunked['nbtune']['peak_bytes']:,} against {chunked['torchtune']['peak_bytes']:,} bytes)")]


def xeon_quotes(r: dict) -> list[tuple[str, str]]:
    s = summaries(r["peers-125m-cpu.json"])
    quotes = []
    for rung, v in s.items():
        ours, peers, ratios = v["nbtune"], peers_of(v), v["ratios"]
        lightest = min(peers, key=lambda f: peers[f]["peak_bytes"])
        fastest = max(peers, key=lambda f: peers[f]["tokens_per_second"])
        if rung in ("+ optimizer in backward", "+ 8-bit AdamW"):
            continue  # these two rows come from the rerun after issue 26 (issue26_quotes)
        plain = v["nbtune-norollback"]["peak_bytes"]
        peak = mib(ours["peak_bytes"]) + ("" if mib(plain) == mib(ours["peak_bytes"]) else f" ({mib(plain)} without)")
        ratio = bold_under_one(ratios["peak_vs_best_peer"])
        if mib(plain) != mib(ours["peak_bytes"]):
            ratio += f" ({plain / peers[lightest]['peak_bytes']:.2f})"
        quotes.append((INDEX, f"| {rung} | {peak} | {mib(peers[lightest]['peak_bytes'])} ({lightest}) | {ratio} | "
                              f"{ours['tokens_per_second']:.0f} | {peers[fastest]['tokens_per_second']:.0f} ({fastest}) | "
                              f"{ratios['speed_vs_best_peer']:.2f} | {ratios['every_step_tracking_cost']:.2f}× |"))
    oib, adam8 = s["+ optimizer in backward"], s["+ 8-bit AdamW"]
    quotes.append((INDEX, "(the first run's were {:.0f} / {:.0f} and {:.0f} / {:.0f} tokens/s)".format(
        *(v[f]["tokens_per_second"] for v in (oib, adam8) for f in ("nbtune", "torchtune")))))
    tracking = [v["ratios"]["every_step_tracking_cost"] for v in s.values()]
    full = [s[rung]["ratios"]["speed_vs_best_peer"] for rung in
            ("full fp32", "+ bf16", "+ activation checkpointing", "+ chunked loss")]
    chunked = s["+ chunked loss"]
    quotes += [
        (INDEX, f"Tracking every step costs {min(tracking):.2f}-{max(tracking):.2f}× a plain step"),
        (INDEX, f"({mib(chunked['nbtune']['peak_bytes'])} against {mib(chunked['torchtune']['peak_bytes'])} MiB)"),
        (INDEX, f"{min(full):.2f}-{max(full):.2f}× on the full rungs"),
        (INDEX, f"LoRA is {s['LoRA']['ratios']['speed_vs_best_peer']:.2f}×"),
        (INDEX, f"QLoRA is {s['QLoRA']['ratios']['speed_vs_best_peer']:.2f}×"),
    ]
    return quotes


def issue26_quotes(result: dict) -> list[tuple[str, str]]:
    """The Xeon table's rows with the optimizer in backward and 8-bit AdamW, rerun after issue 26."""
    first = summaries(load(f"{RESULTS}/peers/xeon-amx/peers-125m-cpu.json"))  # the tracking column
    quotes = []
    for rung, v in summaries(result).items():
        ours, peers, ratios = v["nbtune"], peers_of(v), v["ratios"]
        lightest = min(peers, key=lambda f: peers[f]["peak_bytes"])
        fastest = max(peers, key=lambda f: peers[f]["tokens_per_second"])
        assert v["nbtune-norollback"]["peak_bytes"] == ours["peak_bytes"]  # "nbtune now equals nbtune-norollback"
        quotes.append((INDEX, f"| {rung} | {mib(ours['peak_bytes'])} | {mib(peers[lightest]['peak_bytes'])} ({lightest}) | "
                              f"{bold_under_one(ratios['peak_vs_best_peer'])} | {ours['tokens_per_second']:.0f} | "
                              f"{peers[fastest]['tokens_per_second']:.0f} | {ratios['speed_vs_best_peer']:.2f} | "
                              f"{first[rung]['ratios']['every_step_tracking_cost']:.2f}× |"))
    return quotes


def avx2_peers_quotes(result: dict) -> list[tuple[str, str]]:
    """The AVX2-only EPYC run (the index table's "peers" link), quoted in one sentence."""
    s = summaries(result)
    peak = {rung: v["ratios"]["peak_vs_best_peer"] for rung, v in s.items()}
    speed = [v["ratios"]["speed_vs_best_peer"] for v in s.values()]
    return [(INDEX, f"where bf16 runs {result['bf16_slowdown']:.0f}× slower than fp32"),
            (INDEX, f"(peak ratios {peak['+ activation checkpointing']:.2f} with checkpointing and chunked loss, "
                    f"{peak['+ optimizer in backward']:.2f} / {peak['+ 8-bit AdamW']:.2f} with the undo copy, "
                    f"speeds {min(speed):.2f}-{max(speed):.2f};")]


# --- long contexts (benchmarks/long_context.py) ----------------------------------------------

def long_context_quotes(result: dict) -> list[tuple[str, str]]:
    quotes = []
    for tokens in ("4096", "8192"):
        v = result["results"][tokens]
        cells = [f"{mib(v[f]['peak_bytes'])} MiB, {v[f]['tokens_per_second']:.0f} tok/s"
                 for f in ("nbtune + tiling", "nbtune, no tiling", "transformers + PEFT", "torchtune")]
        best = min(v["transformers + PEFT"]["peak_bytes"], v["torchtune"]["peak_bytes"])
        ratio = f"{v['nbtune + tiling']['peak_bytes'] / best:.2f}"
        quotes.append((LONG, f"| {int(tokens):,} | " + " | ".join(cells)
                             + f" | {ratio if tokens == '4096' else f'**{ratio}**'} |"))
    s = result["summary"]
    quotes += [
        (LONG, f"Tiling costs no speed here ({s['8192']['tiling: speed ratio']:.2f}× and "
               f"{s['4096']['tiling: speed ratio']:.2f}× the tokens/s of nbtune without it) and takes "
               f"{(1 - s['8192']['tiling: peak ratio']) * 100:.0f} % off the peak at 8k"),
        (LONG, f"this shape's MLP is only {result['shape']['mlp'] / result['shape']['hidden']:.1f}× its width"),
        (LONG, f"All four give the same first loss ({s['8192']['nbtune + tiling']['first_loss']} at 8k)"),
    ]
    return quotes


def long_context_rerun_quotes(result: dict) -> list[tuple[str, str]]:
    """The 8k rerun after issue 38, against the first run's bytes."""
    v, before = result["results"]["8192"], load(f"{RESULTS}/long-context/peers-125m-cpu.json")["results"]["8192"]
    tiles, plain = v["nbtune + tiling"]["peak_bytes"], v["nbtune, no tiling"]["peak_bytes"]
    assert tiles == before["nbtune + tiling"]["peak_bytes"]  # "the same bytes as above"
    best = min(v["transformers + PEFT"]["peak_bytes"], v["torchtune"]["peak_bytes"])
    speeds = [f"{v[f]['tokens_per_second']:.0f}" for f in v]
    return [(LONG, f"nbtune with tiles: the same bytes as above ({tiles:,})"),
            (LONG, f"nbtune without tiling: {(before['nbtune, no tiling']['peak_bytes'] - plain) / MIB:.0f} MB less "
                   f"({plain:,})"),
            (LONG, f"transformers: {v['transformers + PEFT']['peak_bytes']:,} bytes; "
                   f"torchtune: {v['torchtune']['peak_bytes']:,}"),
            (LONG, f"nbtune / best peer: {tiles / best:.2f}"),
            (LONG, f"Speeds on this machine: {', '.join(speeds[:3])} and {speeds[3]} tokens/s")]


def slope_quotes(result: dict) -> list[tuple[str, str]]:
    labels = {"checkpointing": "checkpointing", "+ chunked loss": "+ loss in 8 chunks",
              "+ tiling": "+ tiles of 256 tokens",
              "+ offloading": "+ offloading (CUDA estimate; a CPU has no host to move to)"}
    quotes = []
    for row in result["rows"]:
        cuda = row["technique"] == "+ offloading"  # no host to move to on a CPU: the CUDA estimate
        peaks = [p["estimate_cuda_peak"] if cuda else p["measured_peak"] for p in row["points"]]
        slope = row["cuda_estimate_slope_bytes_per_1k_tokens" if cuda else "slope_bytes_per_1k_tokens"]
        quotes.append((LONG, f"| {labels[row['technique']]} | " + " | ".join(f"{mib(p)} MiB" for p in peaks)
                             + f" | {mib(slope)} MiB |"))
        if not cuda:  # "The estimate (fake tensors) equals every measured peak to the byte."
            assert all(p["estimate_peak"] == p["measured_peak"] for p in row["points"])
    return quotes


def predicted_8b_quotes(result: dict) -> list[tuple[str, str]]:
    rows = {(r["card"], r["host"], r["techniques"]): r for r in result["rows"]}
    plain, tiled = "checkpointing + chunked loss", "+ tiles of 4096 + offloading"
    g16, g16t = rows["16GiB", "64GiB", plain], rows["16GiB", "64GiB", tiled]
    r32, r32t, r64t = rows["RTX 3090", "32GiB", plain], rows["RTX 3090", "32GiB", tiled], rows["RTX 3090", "64GiB", tiled]
    g48, g48t = rows["48GiB", "64GiB", plain], rows["48GiB", "64GiB", tiled]
    before = load(f"{RESULTS}/long-context/host-32gb.json")["before_issue_33"]["tokens"]
    return [
        (LONG, f"| 16 GB | {g16['tokens']:,} | {g16t['tokens']:,} ({g16t['limit']}-limited; "
               f"{g16t['host_GiB']:.1f} GiB on a 64 GB host) | {g16['unsloth']:,} | {g16['hf_fa2']:,} |"),
        (LONG, f"| 24 GB (RTX 3090) | {r32['tokens']:,} | {r32t['tokens']:,} with a 32 GB host (the {r32t['limit']} "
               f"is the limit: {r32t['host_GiB']:.1f} GiB; {before:,} before"),
        (LONG, f"**{r64t['tokens']:,}, the whole context**, with a 64 GB host ({r64t['card_GiB']:.1f} GiB card, "
               f"{r64t['host_GiB']:.1f} GiB host) | {r32['unsloth']:,} | {r32['hf_fa2']:,} |"),
        (LONG, f"| 48 GB | {g48['tokens']:,} | {g48t['tokens']:,} (the {g48t['limit']}'s whole context) | "
               f"{g48['unsloth']:,} | {g48['hf_fa2']:,} |"),
        (LONG, f"the 16 GB row's {g16t['tokens']:,} took {g16t['seconds']:.0f} s and the 3090's "
               f"{r64t['tokens']:,} no time"),
    ]


def host_32gb_quotes(result: dict) -> list[tuple[str, str]]:
    before, after = result["before_issue_33"], result["after"]
    return [(LONG, f"which moved the 32 GB answer from {before['tokens']:,} to {after['tokens']:,} tokens"),
            (LONG, f"more than the {after['host_GiB']:.1f} GiB such a host has usable")]


# --- several GPUs (fsdp_predictions.py, rank_memory.py, processes_overhead.py) ---------------

def fsdp_quotes(result: dict) -> list[tuple[str, str]]:
    seed = result["seed_001"]
    worlds = {w: {row["label"]: row for row in rows} for w, rows in seed["worlds"].items()}
    chosen = worlds[str(seed["world"])]
    quotes = [(GPUS, f"| {label} | {row['published_gib']:.2f} | {row['predicted_gib']:.2f} | "
                     f"{signed_pct(row['error'])} |") for label, row in chosen.items()]
    quotes.append((GPUS, f"| row | published | nbtune, {seed['world']} ranks | error |"))

    def two(w):  # the two rows that keep the sharded state on the GPU
        a, b = worlds[w]["FSDP2"], worlds[w]["+ activation checkpointing"]
        return (f"{a['predicted_gib']:.1f} and {b['predicted_gib']:.1f}",
                f"{signed_pct(a['error'])}, {signed_pct(b['error'])}")

    quotes.append((GPUS, "2 ranks predict {} GiB ({}), 8 ranks {} ({}), 4 ranks {} ({})".format(
        *two("2"), *two("8"), *two("4"))))
    plain, ckpt = chosen["FSDP2"], chosen["+ activation checkpointing"]
    offload, embed, chunked = chosen["+ CPU offload"], chosen["+ shard embedding layer"], chosen["+ chunked loss"]
    held = ckpt["at_peak_gib"]
    offloaded = ("+ CPU offload", "+ shard embedding layer", "+ chunked loss")
    gpu = [chosen[k]["with_optimizer_state_on_gpu_gib"] for k in offloaded]
    gpu_err = [signed_pct(chosen[k]["error_with_optimizer_state_on_gpu"]) for k in offloaded]
    quotes += [
        (GPUS, f"*FSDP2*, {plain['published_gib'] - plain['predicted_gib']:.1f} GiB more in the table"),
        (GPUS, f"*+ CPU offload*, {offload['published_gib'] - offload['predicted_gib']:.1f} GiB more in the table"),
        # the sharded gradients are the weights' size (bf16, the same shards)
        (GPUS, f"moves {2 * held['parameters'] + held['optimizer_state']:.1f} GiB per rank off the GPU in nbtune's "
               f"prediction (weights {held['parameters']:.2f}, gradients {held['parameters']:.2f}, "
               f"AdamW state {held['optimizer_state']:.2f})"),
        (GPUS, f"row only {ckpt['published_gib'] - offload['published_gib']:.1f} below the one before"),
        (GPUS, f"offloaded rows predict {gpu[0]:.2f}, {gpu[1]:.2f} and {gpu[2]:.2f} GiB ({', '.join(gpu_err)})"),
        (GPUS, f"it *raises* the peak by {chunked['predicted_gib'] - embed['predicted_gib']:.1f} GiB here, where the "
               f"table's fell by {embed['published_gib'] - chunked['published_gib']:.2f}"),
        (GPUS, f"(`python benchmarks/fsdp_predictions.py`, {result['seconds']:.0f} s;"),
    ]
    l2, l3 = ({r["model"]: r for r in result["seventy_b"]}[m] for m in ("llama-2-70b", "llama-3.1-70b"))
    assert l2["ranks"] == l3["ranks"] == 2 and l2["card_gib"] == l3["card_gib"] == 24  # "two 24 GB cards"
    assert l2["fits_24gb_card"] and l3["fits_24gb_card"]  # "both fitting a 24 GB card"
    quotes += [
        (GPUS, f"measured {l2['published_gib']:.2f} GiB per GPU"),
        (GPUS, f"predicts {l2['predicted_gib']:.2f} GiB per GPU for Llama-2-70B and {l3['predicted_gib']:.2f} "
               f"for Llama-3.1-70B"),
        (GPUS, f"with {l2['host_training_gib']:.0f} and {l3['host_training_gib']:.0f} GiB of host memory while "
               f"training for both ranks ({l2['host_sharded_gib']:.0f} and {l3['host_sharded_gib']:.0f} of it the "
               f"offloaded shards), {half_up(l2['host_peak_gib'], 1)} and {half_up(l3['host_peak_gib'], 1)} GiB "
               f"at the most"),
    ]
    return quotes


def rank_memory_quotes(result: dict) -> list[tuple[str, str]]:
    """The table of each rank's memory (the rank with the most, of each run, against one process)."""
    runs = {}
    for r in result["results"]:
        runs.setdefault((r["method"], r["ranks"]), []).append(r)
    names = {"lora": "LoRA ", "full": "full ", "qlora": "QLoRA"}
    quotes = []
    for (method, ranks), rs in runs.items():
        alone = runs[method, 1][0]
        cells = []
        for key in ("loading_mib", "run_mib", "tracked_mib"):
            most = max(r[key] for r in rs)
            cells.append(f"{most:,.0f} MiB" + ("" if ranks == 1 else f" ({most / alone[key]:.2f}x)"))
        quotes.append((GPUS, f"| {names[method]} | {ranks} | " + " | ".join(cells) + " |"))
    config, weights = result["config"], result["weight_bytes"]
    quotes.append((GPUS, f"a random Llama of {weights / 4 / 1e6:.0f} M parameters with Llama-3.1-8B's proportions "
                         f"({config['num_hidden_layers']} layers, {weights / GIB:.2f} GiB of fp32 weights)"))
    return [(p, " ".join(t.split())) for p, t in quotes]


def processes_quotes(result: dict) -> list[tuple[str, str]]:
    small, big = result["rows"]
    starts = sorted(r["cluster_start_s"] for r in result["rows"])

    def steps(row, unit=1000, fmt=".0f"):
        return f"{min(row['torchrun_step_s']) * unit:{fmt}}-{max(row['torchrun_step_s']) * unit:{fmt}}"

    def rounds(row):
        return f"rounds {half_up(min(row['ratios']), 2)}-{half_up(max(row['ratios']), 2)}"

    start = " to ".join(dict.fromkeys(f"{s:.0f}" for s in (starts[0], starts[-1])))
    return [(GPUS, f"{start} s to start two engines"),
            (GPUS, f"**{half_up(small['ratio'], 2)}x at a step of {steps(small)} ms** (the tiny model, "
                   f"batch {small['batch_size']}; {rounds(small)})"),
            (GPUS, f"**{half_up(big['ratio'], 2)}x at a step of {steps(big, 1, '.2f')} s** (batch {big['batch_size']}; "
                   f"{rounds(big)})"),
            (GPUS, f"`benchmarks/results/processes/overhead.json`, {result['cores']} cores, {result['rounds']} "
                   f"alternating rounds")]


# --- memory (rollback_cost.py, fit_refresh.py, instrumentation_overhead.py) ------------------

def rollback_quotes(result: dict) -> list[tuple[str, str]]:
    m = result["measured_cpu"]
    quotes = []
    for name, label in (("SmolLM2: full fp32 AdamW", "SmolLM2-135M, full fp32 AdamW"),
                        ("SmolLM2: full, optimizer in backward", "SmolLM2-135M, full, optimizer in backward")):
        v = m[name]
        quotes.append((MEMORY, f"| {label} | {v['copy']['time_ratio']:.2f}×, {v['copy']['peak_ratio']:.2f}× | "
                               f"{half_up(v['auto']['time_ratio'], 2)}×, {v['auto']['peak_ratio']:.2f}× | "
                               f"{mib(v['copy']['undo_copy_bytes'])} MiB |"))
    tiny = [m[k] for k in ("tiny: full fp32 AdamW", "tiny: full, optimizer in backward", "tiny: LoRA r8")]
    copy_peaks = [t["copy"]["peak_ratio"] for t in tiny]
    auto_times = [t["auto"]["time_ratio"] for t in tiny]
    assert all(t["auto"]["peak_ratio"] == 1.0 for t in tiny)  # "1.00×"
    quotes.append((MEMORY, "| tiny demo, full AdamW / in backward / LoRA | "
                           + " / ".join(f"{half_up(t['copy']['time_ratio'], 2)}×" for t in tiny)
                           + f", {min(copy_peaks):.2f}-{max(copy_peaks):.2f}× | "
                           + f"{min(auto_times):.2f}-{max(auto_times):.2f}×, 1.00× | "
                           + " / ".join(f"{t['copy']['undo_copy_bytes'] / MIB:.1f}" for t in tiny) + " MiB |"))
    worst = max(v["copy"]["peak_ratio"] for v in m.values())
    quotes.append((MEMORY, f"up to {worst:.1f}× the peak for a full finetune"))
    quotes.append((MEMORY, f"(`python benchmarks/rollback_cost.py --steps {result['steps_per_arm']} "
                           f"--rounds {result['rounds']}`"))
    p = result["predicted_llama_3_1_8b_cuda"]
    for name, label in (("QLoRA r8 (all projections)", "QLoRA r8, all projections"),
                        ("LoRA r8", "LoRA r8, all projections"),
                        ("full, AdamW, optimizer in backward",) * 2,
                        ("full, paged 8-bit AdamW, optimizer in backward",) * 2):
        v = p[name]
        # the card's peak column is not in the file: from the copy's size on
        quotes.append((MEMORY, f"{v['undo_copy_bytes'] / GIB:.1f} GiB, {v['copy_seconds_at_25GBps']:.2f} s | "
                               f"{v['host_without_undo_bytes'] / GIB:.1f} / {v['host_with_undo_bytes'] / GIB:.1f} |"))
        assert f"| {label} | " in page(MEMORY)
    paged = p["full, paged 8-bit AdamW, optimizer in backward"]["undo_copy_bytes"] / GIB
    quotes += [(MEMORY, f"no undo copy ({paged:.1f} GiB would not fit)"),
               (MEMORY, f"(it would need {paged:.0f} GiB)")]
    return quotes


def fit_refresh_quotes(result: dict) -> list[tuple[str, str]]:
    rows = {r["measure"]: r for r in result["rows"]}
    est, badge = rows["8B estimate"], rows["badge after a slider"]
    fit, longest = rows["fit 8B full bf16 on RTX 3090"], rows["longest context, 8B QLoRA, 3090"]
    here, base = result["this_tree"], result["baseline_tree"]
    assert here["estimate_peak_bytes"][0] - base["estimate_peak_bytes"][0] == here["cublas_bytes"]
    return [
        (MEMORY, f"(`python benchmarks/fit_refresh.py`, against {result['baseline']}, the commit before issue 33"),
        (MEMORY, f"an estimate {est['seconds']:.2f} s (target {est['target_seconds']}), the badge {badge['seconds']:.2f} s "
                 f"after a slider moves (target {badge['target_seconds']}, its {here['debounce_s']} s debounce included"),
        (MEMORY, f"the whole {here['longest_answer']['tokens']:,} tokens, {longest['seconds']:.1f} s (target "
                 f"{longest['target_seconds']:.0f}; {longest['baseline_seconds']:.1f} s on {result['baseline']})"),
        (MEMORY, f"`fit` for the 8B full bf16 on a 3090 {fit['seconds']:.1f} s (target {fit['target_seconds']:.0f}; "
                 f"{fit['baseline_seconds']:.1f} s on {result['baseline']})"),
        (MEMORY, f"the estimates' peaks are {here['cublas_bytes'] / MIB:.0f} MiB higher"),
        (MEMORY, f"its search stopped at `max_tries` ({base['fit_answer']['estimates']} estimates)"),
        (MEMORY, f"it now ends in {here['fit_answer']['estimates']} estimates"),
        (MEMORY, f"takes {here['fit_s']:.0f} s on 2 CPU cores (91 s before issue 30; "
                 f"{here['fit_answer']['estimates']} estimates)"),
    ]


def instrumentation_quotes(result: dict) -> list[tuple[str, str]]:
    ratios = [r["ratio"] for r in result["rounds"]]
    shares = [r["on"]["instrumentation_share"] * 100 for r in result["rounds"]]
    return [(MEMORY, f"({result['steps_per_arm']} demo steps per arm, {len(result['rounds'])} rounds in ABBA order"),
            (MEMORY, f"on/off time ratio {result['ratio_on_over_off']:.3f} overall, but single rounds range from "
                     f"{min(ratios):.2f} to {max(ratios):.2f}"),
            (MEMORY, f"is {min(shares):.1f}–{max(shares):.1f} % of each \"on\" run"),
            (INDEX, f"measures it on the demo: {result['ratio_on_over_off']:.3f})")]


# --- the rest -------------------------------------------------------------------------------

def cpu_demo_quotes(r: dict) -> list[tuple[str, str]]:
    s = r["demo_summary.json"]
    first, last = f"{s['loss_first']:.3f}", f"{s['loss_last']:.3f}"
    after = f"{s['heldout_accuracy_after'] * 100:.0f} %"
    took = f"{s['seconds']:.0f} s"
    return [(README, f"the demo's {s['steps']} steps"),
            (README, f"loss {first} → "),
            # the README and the install page send the reader to the folder for these figures
            (README, f"cpu-demo): {last} and {after} in {took}"),
            (INSTALL, f"loss {first} → "),
            (INSTALL, f"cpu-demo/README.md): {last} and {after} in {took})")]


def load_memory_quotes(r: dict) -> list[tuple[str, str]]:
    ratios = r["load_memory.json"]["ratios"]
    weights = r["load_memory.json"]["results"][0]["checkpoint_bytes"]
    return [("docs/guides/models-and-data.md",
             f"a {weights / 1e9:.0f} GB checkpoint is {ratios['bf16->bf16']:.3f}× its size (bf16 → bf16) and "
             f"{ratios['fp32->bf16']:.2f}× (fp32 → bf16)")]


def gpu_quotes(result: dict) -> list[tuple[str, str]]:
    checks = {c["name"]: c["numbers"] for c in result["checks"]}
    a, undo, paged = checks["allocator phases"], checks["undo copy"], checks["paged state"]
    est, lc, longest = checks["estimate"]["rows"], checks["long-context estimate"]["rows"], checks["longest context"]
    under = {k: (v["measured"] - v["estimated"]) / MIB for k, v in est.items()}
    # the two cuBLAS workspaces (32 MiB each on compute capability 9.0) the estimate now adds
    after = {k: (v["estimated"] + 64 * MIB - v["measured"]) / v["measured"] * 100 for k, v in est.items()}
    two = [k for k, v in after.items() if abs(v) < 1]  # the rows short by just the workspaces
    long_under = [(v["measured"] - v["estimated"]) / MIB for v in lc.values()]
    long_after = [(v["estimated"] + 64 * MIB - v["measured"]) / v["measured"] * 100 for v in lc.values()]
    assert max(long_under) - min(long_under) < 1
    count = {5: "five", 6: "six", 7: "seven", 8: "eight"}
    errors = {k: f"{abs(v['error']) * 100:.1f} %" for k, v in est.items()}
    lc_errors = {f"{abs(v['error']) * 100:.1f}" for v in lc.values()}
    assert len(lc_errors) == 1
    return [
        (GPU, f"{a['tracked_peak']:,} bytes against `max_memory_allocated` {a['untracked_peak']:,} of the same step "
              f"untracked ({a['tracked_peak'] / a['untracked_peak']:.3f}x)"),
        (GPU, f"it costs {undo['time_ratio']:.2f}x the step time"),
        (GPU, f"its {undo['copy_alone_s'] * 1000:.0f} ms for {undo['host_bytes'] / 1e6:.0f} MB are not hidden at all "
              f"({undo['hidden_share'] * 100:.0f} % overlapped with backward)"),
        (GPU, f"paged 8-bit AdamW state ({paged['paged'] / MIB:.0f} MiB)"),
        (GPU, f"the estimate is {lc_errors.pop()} % under the measured peak at "
              + " and ".join(f"{int(t):,}" for t in lc) + " tokens"),
        (GPU, f"({longest['tokens']:,} tokens, the model's limit) ran: {longest['measured_peak'] / 1e9:.2f} GB measured "
              f"against {longest['predicted_card_bytes'] / 1e9:.2f} GB predicted"),
        (GPU, f"brings all {checks['prefetch overlap']['host_to_device_copies']} offloaded inputs back beside compute"),
        (GPU, f"under the measured peaks by up to {max(under[k] for k in two):.1f} MiB in {count[len(two)]} of "
              f"{count[len(est)]} rows ({errors['bf16']} for full bf16, {errors['LoRA']} LoRA, {errors['QLoRA']} QLoRA"),
        (GPU, f"which puts those {count[len(two)]} rows within {max(abs(after[k]) for k in two):.2f} %"),
        (GPU, f"the chunked-loss full finetunes, +{after['+ chunked loss']:.1f} % and +{after['+ 8-bit AdamW']:.1f} %"),
        (GPU, f"full fp32 stays {-after['full fp32']:.1f} % under"),
        (GPU, f"the 8B ones by the same {min(long_under):.0f} MiB"),
        (GPU, f"the 8B rows within {max(abs(v) for v in long_after):.2f} %"),
        (GPU, f"{under['full fp32']:.0f} MiB in fp32"),
        (GPU, f"({paged['outside'] / 1e6:,.0f} MB outside less the {paged['paged'] / 1e6:.0f} MB paged)"),
    ]


def gpu_rerun_quotes(result: dict) -> list[tuple[str, str]]:
    checks = {c["name"]: c["numbers"] for c in result["checks"]}
    off, comp = checks["activation offloading"], checks["compile"]
    slow = [s for s in comp["compiled"]["step_s"] if s > 1]
    return [
        (GPU, f"peaks at {off['peak_with'] / off['peak_without']:.2f}x ({off['peak_with'] / 1e6:.0f} MB against "
              f"{off['peak_without'] / 1e6:,.0f} MB), the same loss to 1e-5, "
              f"{off['device_to_host_copies']} device-to-host copies"),
        (GPU, f"compile keeps the losses (within {comp['largest_loss_difference']:.4f} "
              f"over {len(comp['compiled']['losses'])} steps)"),
        (GPU, f"took {', '.join(f'{s:.1f}' for s in slow[:-1])} and {slow[-1]:.1f} s while dynamo's graph count went "
              f"{', '.join(str(g) for g in comp['compiled']['unique_graphs'])} "
              f"({comp['compiled']['later_s'] * 1000:.0f} ms "
              f"when it did not recompile, {comp['eager']['later_s'] * 1000:.0f} ms eager)"),
    ]


def background_quotes(result: dict) -> list[tuple[str, str]]:
    latency = statistics.median(result["stop_latency_seconds"]) * 1000
    return [("docs/guides/background.md",
             f"stop lands within one step (median {latency:.0f} ms, "
             f"worst {result['worst_stop_latency_over_step']:.1f} step); "
             f"a background step takes {result['background_over_run']:.2f}× a synchronous one")]


def walks_quotes(result: dict) -> list[tuple[str, str]]:
    labels = {"nbtune train (1 step)": "`nbtune train` of the tiny demo, one step",
              "panel click mid-run: set": "a panel click mid-run (`set` while a run trains)",
              "estimate(llama-3.1-8b, ranks=2)": '`nt.estimate("llama-3.1-8b", ..., ranks=2)`',
              "Session.from_config(run file).step()": "`Session.from_config(run file)` and one `step`",
              "Session.from_config(run file, processes=2).step()":
                  "the same on two processes the notebook drives (`processes=2`; the kernel's side)"}
    return [("docs/architecture.md", f"| {labels[k]} | {v['files']} | {v['calls']} | {v['up']} | {v['returns']} |")
            for k, v in result.items()]


def checkpoint_save_quotes(result: dict) -> list[tuple[str, str]]:
    p, m = result["predicted_llama_3_1_8b"], result["measured_smollm2_lora_r64"]
    assert p["qlora"]["bytes"] == p["lora"]["bytes"]
    return [("docs/guides/run-files.md",
             f"an 8B QLoRA or LoRA checkpoint is {mib(p['qlora']['bytes'])} MiB (rank-16 adapters in bf16 and their "
             f"AdamW state), about {p['qlora']['seconds_at_100_MiB_s']:.0f} s at 100 MiB/s, while a full finetune's is "
             f"{mib(p['full']['bytes'])} MiB and takes {p['full']['seconds_here']:.0f} s on this machine's disk "
             f"({mib(m['bytes_per_second'])} MiB/s, measured writing a {mib(m['bytes'])} MiB SmolLM2 LoRA checkpoint) "
             f"and {p['full']['seconds_at_100_MiB_s'] / 60:.1f} min at 100 MiB/s")]


def restore_copy_quotes(result: dict) -> list[tuple[str, str]]:
    step = statistics.median(r["without_ms"] for r in result["rounds"])
    return [("docs/guides/faults.md", f"{result['median_ratio']:.3f}x on a {step:.0f} ms LoRA step")]


def replies_quotes(result: dict) -> list[tuple[str, str]]:
    assert result["same_replies"]
    faster = result["speedup"]
    return [("docs/guides/families-and-objectives.md",
             f"{result['rows']} SmolLM2 replies took {faster['8 at once']:.2f}x less time written 8 at once "
             f"than one at a time on a CPU thread, and {faster['4 at once']:.2f}x 4 at once")]


# One entry per results file: its path and what the pages quote from it, formatted from the file.
QUOTES = [
    (f"{RESULTS}/peers/peers-125m-cpu.json", avx2_peers_quotes),
    (f"{RESULTS}/peers/epyc-avx512/README.md", epyc_quotes),
    (f"{RESULTS}/peers/epyc-avx512/peers-125m-cpu-malloc-system.json", glibc_defaults_quotes),
    (f"{RESULTS}/peers/epyc-avx512/peers-125m-cpu-interleaved-run-1.json", run_1_quotes),
    (f"{RESULTS}/peers/xeon-amx/README.md", xeon_quotes),
    (f"{RESULTS}/peers/xeon-amx/issue26/peers-125m-cpu-oib-8bit.json", issue26_quotes),
    (f"{RESULTS}/long-context/peers-125m-cpu.json", long_context_quotes),
    (f"{RESULTS}/long-context/peers-125m-cpu-8192-after-issue-38.json", long_context_rerun_quotes),
    (f"{RESULTS}/long-context/slope-smollm2.json", slope_quotes),
    (f"{RESULTS}/long-context/predicted-8b.json", predicted_8b_quotes),
    (f"{RESULTS}/long-context/host-32gb.json", host_32gb_quotes),
    (f"{RESULTS}/fsdp/predictions.json", fsdp_quotes),
    (f"{RESULTS}/rank-memory/rank_memory.json", rank_memory_quotes),
    (f"{RESULTS}/processes/overhead.json", processes_quotes),
    (f"{RESULTS}/load-memory/README.md", load_memory_quotes),
    (f"{RESULTS}/rollback-cost/rollback_cost.json", rollback_quotes),
    (f"{RESULTS}/fit-refresh/fit_refresh.json", fit_refresh_quotes),
    (f"{RESULTS}/instrumentation-overhead/instrumentation_overhead.json", instrumentation_quotes),
    (f"{RESULTS}/gpu/NVIDIA-H200.json", gpu_quotes),
    (f"{RESULTS}/gpu/NVIDIA-H200-rerun.json", gpu_rerun_quotes),
    (f"{RESULTS}/cpu-demo/README.md", cpu_demo_quotes),
    (f"{RESULTS}/background/background_run.json", background_quotes),
    (f"{RESULTS}/walks.json", walks_quotes),
    (f"{RESULTS}/checkpoint-save/checkpoint_save.json", checkpoint_save_quotes),
    (f"{RESULTS}/restore-copy/cost.json", restore_copy_quotes),
    (f"{RESULTS}/replies/batched.json", replies_quotes),
]

# Results files named on the pages that need no entry above, and why.
NOT_QUOTED = {
    # its figures are checked by tests/test_docs.py (test_the_family_predictions_quoted_are_the_committed_results)
    f"{RESULTS}/families/predictions.json": "checked in test_docs.py",
    # the chart the README shows; its numbers are demo_summary.json's, checked through cpu-demo above
    f"{RESULTS}/cpu-demo/demo_memory.png": "a chart, no figure quoted in text",
}


@pytest.mark.parametrize("path, quotes", QUOTES, ids=[p.removeprefix(RESULTS + "/") for p, _ in QUOTES])
def test_the_figures_quoted_are_the_results_files(path, quotes):
    missing = [(where, text) for where, text in quotes(load(path)) if text not in page(where)]
    assert not missing, "\n".join(f"{where} quotes other figures than {path}: expected {text!r}"
                                  for where, text in missing)


def results_named(text: str, prefix: str) -> set[str]:
    """The results files a page names under ``prefix``, as paths from the root (a folder as its README)."""
    out = set()
    for name in re.findall(re.escape(prefix) + r"([\w./-]+)", text):
        path = f"{RESULTS}/{name.rstrip('.')}"
        out.add(f"{path}/README.md" if (ROOT / path).is_dir() else path)
    return out


def test_every_results_file_the_pages_point_to_is_checked():
    """A new benchmark in the index's table or the README cannot be quoted unchecked."""
    index = (ROOT / INDEX).read_text()
    table = [line for line in index.split("\n## ")[0].splitlines() if line.startswith("|")]
    named = results_named("\n".join(table), "../results/") | results_named((ROOT / README).read_text(), f"{RESULTS}/")
    assert len(named) >= 10, named  # the table was found
    for path in named:
        assert (ROOT / path).exists(), f"{path} is named but not committed"
    checked = {p for p, _ in QUOTES} | set(NOT_QUOTED)
    assert named <= checked, f"results files quoted with no entry in QUOTES: {sorted(named - checked)}"


@pytest.mark.slow  # (two 70B estimates on 2 fake ranks: ~6 s)
def test_the_70b_predictions_the_pages_quote_are_what_the_code_predicts_today():
    """The results file could be older than the estimator: the most quoted prediction (70B
    QLoRA on two 24 GB cards, against Answer.AI's measured 14.92 GiB) is made again here and
    must be the committed one; rerun ``python benchmarks/fsdp_predictions.py`` when it moves."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fsdp_predictions", ROOT / "benchmarks/fsdp_predictions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = load(f"{RESULTS}/fsdp/predictions.json")["seventy_b"]
    for now, then in zip(module.seventy_b(), committed, strict=True):
        for key in ("predicted_gib", "host_training_gib", "host_peak_gib", "host_sharded_gib"):
            assert now[key] == then[key], (now["model"], key, now[key], then[key])
