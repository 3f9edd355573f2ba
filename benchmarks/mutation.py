"""Mutation testing: plant one small, plausible bug at a time and check that a test fails.

Each mutant is a textual replacement in one file of ``nbtune/`` (the old text must occur
exactly once, so a mutant that no longer matches the code fails loudly instead of silently
testing nothing) and the test files or test ids that should catch it. For each mutant, in
a temporary copy of the checkout (its tracked and untracked, not ignored, files):

1. the replacement is applied to the copy's file;
2. ``pytest -x -q`` runs the mutant's tests in the copy, with the copy first on
   ``PYTHONPATH`` and as the working directory; a guard imports ``nbtune`` before pytest
   starts and aborts unless it comes from the copy (never the checkout or an install);
3. the file is put back. Caught: pytest reports a failing test (exit status 1).

Before the mutants, the union of their tests runs once on the unmutated copy (a baseline
that must pass, else every mutant would look caught). No bytecode is written in the copy,
so a reverted file is never run from a stale ``.pyc``.

    python benchmarks/mutation.py              # all mutants, one at a time
    python benchmarks/mutation.py --list       # number, kind, file and bug of each
    python benchmarks/mutation.py --only 3 --only 7   # or --only 3,7
    python benchmarks/mutation.py -j 2         # two copies, two mutants at once

Slow (every mutant starts pytest and imports torch): not part of the test suite; it
lives outside ``testpaths``. Exit status 0 only when every mutant was caught.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    kind: str  # the family of bug (wrong scaling, dropped argument, off-by-one, ...)
    bug: str  # what the planted bug does, in words
    file: str  # relative to the repository root, under nbtune/
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # test files or ids, relative to the repository root


T = "tests/"
FAMILY_LORA = T + "models/test_family_paths.py::test_lora_merge_save_and_export_give_the_unmerged_logits"
FAMILY_QLORA = T + "models/test_family_paths.py::test_qlora_equals_the_dense_model_on_the_dequantized_weights"
PAIRS = T + "properties/test_pairs.py"
GRPO = T + "objectives/test_grpo.py"
COPY = T + "objectives/test_reference_copy.py"
PREF_TRAIN = T + "objectives/test_preference_training.py"
PROPERTIES = T + "properties/test_properties.py"
FAULT_FORWARD = T + "properties/test_faults.py::test_failed_step_equals_twin[layer_forward-runtime-step1-auto]"

MUTANTS: list[Mutant] = [
    # ---- wrong scaling ----
    Mutant("wrong scaling", "loss normalised by each micro-batch's own trained tokens",
           "nbtune/step.py",
           "batch[\"labels\"], 0,\n                                     options.compile) / trained",
           "batch[\"labels\"], 0,\n                                     options.compile) / int((batch[\"labels\"] != IGNORE).sum())",
           (T + "test_step.py::test_accumulated_step_divides_by_the_trained_tokens_of_all_micro_batches",
            PAIRS + "::test_chunked_accumulated_loss_equals_one_plain_batch")),
    Mutant("wrong scaling", "loss normaliser counts the first micro-batch's tokens only",
           "nbtune/step.py",
           "counts = torch.tensor([int(sum((b[\"labels\"] != IGNORE).sum() for b in micro_batches)),",
           "counts = torch.tensor([int(sum((b[\"labels\"] != IGNORE).sum() for b in micro_batches[:1])),",
           (PAIRS + "::test_clipped_accumulation_equals_one_clipped_batch",)),
    Mutant("wrong scaling", "LoRA scaling alpha / sqrt(rank) instead of alpha / rank",
           "nbtune/peft.py",
           "return self.alpha / self.rank",
           "return self.alpha / self.rank ** 0.5",
           (FAMILY_LORA,)),
    Mutant("wrong scaling", "merged weight adds B @ A without the scaling",
           "nbtune/peft.py",
           "(self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling",
           "(self.lora_B.weight.float() @ self.lora_A.weight.float())",
           (FAMILY_LORA,)),
    Mutant("wrong scaling", "exported adapter_config holds alpha / rank as lora_alpha",
           "nbtune/peft.py",
           "\"lora_alpha\": first.alpha,",
           "\"lora_alpha\": first.alpha / first.rank,",
           (FAMILY_LORA,)),
    # ---- dropped argument ----
    Mutant("dropped argument", "max_grad_norm not used by the update (no clipping)",
           "nbtune/step.py",
           "        norm = torch.nn.utils.clip_grad_norm_(grads, options.max_grad_norm)",
           "        norm = torch.nn.utils.get_total_norm([p.grad for p in grads])",
           (PAIRS + "::test_clipped_accumulation_equals_one_clipped_batch",)),
    Mutant("dropped argument", "weight_decay not given to the optimizer",
           "nbtune/optim.py",
           "kwargs = dict(lr=techniques.lr, weight_decay=techniques.weight_decay)",
           "kwargs = dict(lr=techniques.lr)",
           (T + "properties/test_every_field.py::test_field_set_at_build_time_takes_effect[weight_decay]",)),
    Mutant("dropped argument", "QLoRA base product drops the Linear's bias (Qwen2 q/k/v)",
           "nbtune/peft.py",
           "return out if base.bias is None else out + base.bias",
           "return out",
           (FAMILY_QLORA,)),
    Mutant("dropped argument", "merged export drops the adapted layers' biases",
           "nbtune/peft.py",
           "                if child != \"base_layer\":\n                    continue",
           "                if child != \"base_layer\" or leaf == \"bias\":\n                    continue",
           (FAMILY_LORA,)),
    Mutant("dropped argument", "Qwen2's q/k/v bias not switched on when config.json omits it",
           "nbtune/models/config.py",
           "\"attention_bias\": hf.get(\"attention_bias\", model_type == \"qwen2\"),",
           "\"attention_bias\": hf.get(\"attention_bias\", False),",
           (FAMILY_LORA,)),
    # ---- off-by-one ----
    Mutant("off-by-one", "warm-up counts steps from 0 (first step at lr 0)",
           "nbtune/techniques.py",
           "return self.lr * step / self.warmup_steps",
           "return self.lr * (step - 1) / self.warmup_steps",
           (PAIRS + "::test_schedule_at_first_boundary_and_last_steps",)),
    Mutant("off-by-one", "warm-up ends one step early",
           "nbtune/techniques.py",
           "if self.warmup_steps and step < self.warmup_steps:",
           "if self.warmup_steps and step < self.warmup_steps - 1:",
           (PAIRS + "::test_schedule_at_first_boundary_and_last_steps",)),
    Mutant("off-by-one", "the trainer asks lr_at for a 0-based step number",
           "nbtune/run/trainer.py",
           "number, shape = len(self.history) + 1, None",
           "number, shape = len(self.history), None",
           (T + "test_step.py::test_learning_rate_follows_the_warmup_schedule",)),
    Mutant("off-by-one", "packing closes a row when the next example would fill it exactly",
           "nbtune/data/batches.py",
           "if group and used + len(sample.input_ids) > seq_len:",
           "if group and used + len(sample.input_ids) >= seq_len:",
           (PROPERTIES,)),
    Mutant("off-by-one", "truncation keeps seq_len ids, so rows are one token short",
           "nbtune/data/batches.py",
           "ids, trained = ids[: seq_len + 1], trained[: seq_len + 1]",
           "ids, trained = ids[: seq_len], trained[: seq_len]",
           (PROPERTIES,)),
    Mutant("off-by-one", "label mask shifted: the prompt's last token trained, EOS not",
           "nbtune/data/batches.py",
           "zip(ids[1:], trained[1:])",
           "zip(ids[1:], trained[:-1])",
           (PROPERTIES,)),
    # ---- packing and batching ----
    Mutant("packing", "packed positions run on across documents instead of restarting",
           "nbtune/data/batches.py",
           "positions=torch.cat([torch.arange(len(s.input_ids)) for s in group])",
           "positions=torch.arange(sum(len(s.input_ids) for s in group))",
           (PROPERTIES,)),
    Mutant("packing", "document mask lets a document see the earlier ones in its row",
           "nbtune/models/decoder.py",
           "same = document_ids[:, :, None] == document_ids[:, None, :]",
           "same = document_ids[:, :, None] >= document_ids[:, None, :]",
           (T + "test_packing.py::test_packed_loss_equals_unpacked_loss",)),
    Mutant("padding", "padding labelled with the pad id, so padding is trained",
           "nbtune/data/batches.py",
           "fill = {\"input_ids\": pad_id, \"labels\": IGNORE}",
           "fill = {\"input_ids\": pad_id, \"labels\": pad_id}",
           (PROPERTIES,)),
    Mutant("tokens count", "tokens read counts the padding too",
           "nbtune/step.py",
           "int(sum((b[\"input_ids\"] != pad_id).sum() for b in micro_batches)),",
           "int(sum(b[\"input_ids\"].numel() for b in micro_batches)),",
           (T + "test_step.py::test_token_counts_from_the_samples",)),
    Mutant("batching", "every epoch walks the same order (no reshuffle)",
           "nbtune/data/batches.py",
           "gen = torch.Generator().manual_seed(self.seed + self.epoch)",
           "gen = torch.Generator().manual_seed(self.seed)",
           (PROPERTIES,)),
    # ---- skipped restore ----
    Mutant("skipped restore", "restoring a position does not reshuffle when the epoch differs",
           "nbtune/data/batches.py",
           "        moved = state[\"epoch\"] != self.epoch\n"
           "        self.epoch, self.position = state[\"epoch\"], state[\"position\"]\n",
           "        self.epoch, self.position = state[\"epoch\"], state[\"position\"]\n"
           "        moved = state[\"epoch\"] != self.epoch\n",
           (PROPERTIES,)),
    Mutant("skipped restore", "restoring a data position keeps the epoch only",
           "nbtune/data/batches.py",
           "self.epoch, self.position = state[\"epoch\"], state[\"position\"]",
           "self.epoch = state[\"epoch\"]",
           (PAIRS + "::test_resumed_pair_equals_the_uninterrupted_run_bit_for_bit",)),
    Mutant("skipped restore", "a failed step does not put the data position back",
           "nbtune/run/trainer.py",
           "        self.stream.load_state_dict(mark[\"data\"])\n",
           "",
           (FAULT_FORWARD,)),
    Mutant("skipped restore", "a failed step does not put the RNG back",
           "nbtune/run/trainer.py",
           "        set_rng_state(mark[\"rng\"])\n",
           "",
           (FAULT_FORWARD,)),
    Mutant("skipped restore", "loading a checkpoint does not restore the RNG (LoRA dropout)",
           "nbtune/run/trainer.py",
           "            set_rng_state(state[\"rng\"])\n",
           "",
           (T + "test_save.py::test_resume_continues_exactly",)),
    # ---- tied embeddings ----
    Mutant("tied embedding", "load_model does not tie the head to the loaded embedding",
           "nbtune/models/filling.py",
           "    model.tie_weights()\n    return model",
           "    return model",
           (FAMILY_LORA,)),
    # ---- chunked loss, accumulation, optimizer in backward ----
    Mutant("chunked loss", "chunked loss drops the last (shorter) chunk",
           "nbtune/loss.py",
           "zip(hidden.chunk(pieces, dim=1), labels.chunk(pieces, dim=1))",
           "zip(hidden.chunk(pieces, dim=1)[:-1], labels.chunk(pieces, dim=1)[:-1])",
           (PAIRS + "::test_chunked_accumulated_loss_equals_one_plain_batch",)),
    Mutant("accumulation", "gradients zeroed before each micro-batch (only the last one counts)",
           "nbtune/step.py",
           "            (loss if parallel is None else loss * parallel.world).backward()",
           "            model.zero_grad(set_to_none=True)\n            (loss if parallel is None else loss * parallel.world).backward()",
           (PAIRS + "::test_clipped_accumulation_equals_one_clipped_batch",)),
    Mutant("optimizer in backward", "the gradient is kept after its in-backward step, and summed into the next",
           "nbtune/optim.py",
           "        wrapper.optimizers[index].step()\n        param.grad = None",
           "        wrapper.optimizers[index].step()",
           (PAIRS + "::test_optimizer_in_backward_with_checkpointing_equals_the_plain_step",)),
    # ---- issue 26: the bounded undo, extrapolated estimates, host memory ----
    Mutant("skipped restore", "the undo copy puts back all but the last weight updated",
           "nbtune/undo.py",
           "        for index in self._updated:\n",
           "        for index in self._updated[:-1]:\n",
           (T + "properties/test_faults.py::test_copy_in_backward_restores_only_the_weights_already_updated",)),
    Mutant("skipped restore", "the undo copy forgets an optimizer state entry the update created",
           "nbtune/undo.py",
           "                state.pop(tensor, None)",
           "                pass",
           (T + "properties/test_faults.py::test_rollback_auto_on_cpu_copies_the_first_update_only",)),
    Mutant("rollback policy", "'auto' keeps the copy on every CPU step (the peers' rungs at 1.6x)",
           "nbtune/undo.py",
           "    return first or (device == \"cuda\" and (in_backward or size <= UNDO_AUTO_BYTES))",
           "    return first or in_backward or size <= UNDO_AUTO_BYTES",
           (T + "properties/test_faults.py::test_when_auto_keeps_the_undo_copy",)),
    Mutant("rollback policy", "the host's room ignores what the undo copy's buffers already hold",
           "nbtune/host.py",
           "    return free + held - reserve - margin(total(root))",
           "    return free - reserve - margin(total(root))",
           (T + "test_host.py",)),
    Mutant("extrapolation", "the estimate's depth line is one unit off",
           "nbtune/predict/estimator.py",
           "    units = (depth - depth_a) // (depth_b - depth_a)",
           "    units = (depth - depth_a) // (depth_b - depth_a) + 1",
           (T + "predict/test_estimate_depth.py::test_extrapolated_equals_every_layer_run",)),
    Mutant("extrapolation", "the estimate takes the second layer unit for the first",
           "nbtune/predict/estimator.py",
           "            out[(phase, micro, part, position, (\"front\", unit))] = segment",
           "            out[(phase, micro, part, position, (\"front\", min(unit + 1, front - 1)))] = segment",
           (T + "predict/test_estimate_depth.py::test_every_extrapolated_segment_is_the_deep_runs_own",)),
    Mutant("host memory", "the checkpoint's host peak is its two files together",
           "nbtune/predict/estimator.py",
           "        checkpoint=max(_part(weights_file, largest), _part(state - step.outside, largest * 2))",
           "        checkpoint=_part(weights_file, largest) + _part(state - step.outside, largest * 2)",
           (T + "test_host.py::test_checkpoint_bytes_are_the_larger_file",)),
    Mutant("host memory", "a checkpoint is written as one file, whatever its size",
           "nbtune/checkpoint.py",
           "        if groups[-1] and size + nbytes > PART_BYTES:",
           "        if False:",
           (T + "test_save.py::test_a_checkpoint_in_parts_resumes_exactly_and_writes_one_part_at_a_time",)),
    Mutant("host memory", "fit forgets the host when it judges a combination",
           "nbtune/predict/search.py",
           "            on_host = held is None or held <= self.host_room\n",
           "            on_host = True\n",
           (T + "predict/test_fit.py::test_fit_turns_down_what_moves_too_much_to_the_host",)),
    Mutant("fit", "fit's bound counts every layer as holding its activations whole",
           "nbtune/predict/search.py",
           "                held_whole = num_layers - round(saved * num_layers) - 1\n",
           "                held_whole = num_layers\n",
           (T + "predict/test_fit.py::test_reach_is_one_share_of_the_activations_per_layer_and_the_optimizers_memory",)),
    Mutant("fit", "fit's bound forgets what the optimizer toggles remove",
           "nbtune/predict/search.py",
           "    elif optimizer:\n",
           "    elif False:\n",
           (T + "predict/test_fit.py::test_reach_bounds_what_checkpointing_and_the_optimizer_toggles_save_on_real_estimates",)),
    Mutant("memory", "the CPU meter never resets the peak: every step shows the process's lifetime peak",
           "nbtune/memory/usage.py",
           '                _CLEAR_REFS.write_text("5")  # VmHWM := the resident memory now\n',
           "                pass\n",
           (T + "ui/test_charts.py::test_each_steps_figure_is_its_own_peak_not_the_processes_lifetime_one",)),
    Mutant("background", "a reply asked for during a run is made at once, beside the step under way",
           "nbtune/run/runner.py",
           "            if run is not None and threading.current_thread() is not run.thread:\n",
           "            if False:\n",
           (T + "run/test_runner.py::test_a_reply_during_a_run_comes_between_two_steps_and_changes_no_step",)),
    Mutant("background", "a SIGTERM to a kernel ends it without saving the background run",
           "nbtune/run/checkpoints.py",
           "            self.save(signal.Signals(signum).name)\n",
           "            pass\n",
           (T + "run/test_kernel_exit.py::test_sigterm_to_a_kernel_saves_the_background_run_and_exits_143",)),
    Mutant("ladder", "compare counts this process's own CPU time as other processes' load",
           "nbtune/hardware.py",
           "        own = (ours.user - self._ours.user) + (ours.system - self._ours.system)\n",
           "        own = 0.0\n",
           (T + "run/test_ladder.py::test_contention_counts_other_processes_not_this_one",)),
    Mutant("panel", "the longest-context answer never goes stale when a toggle changes",
           "nbtune/ui/panel.py",
           '                or bool(self.runner.planned.changed(techniques) - {"seq_len"}))\n',
           "                or False)\n",
           (T + "ui/test_panel.py::test_the_longest_context_button_answers_beside_the_fit_buttons",)),
    # ---- long contexts: tiling, offloaded checkpoints, the longest context ----
    Mutant("sequence tiling", "the final norm is skipped when the loss is computed in tiles",
           "nbtune/loss.py",
           "    if norm is not None:\n        hidden = norm(hidden)",
           "    if False:\n        hidden = norm(hidden)",
           (T + "predict/test_long_context.py::test_tiled_mlp_and_loss_equal_the_plain_model",)),
    Mutant("offloading", "backward prefetches the layer two before, not the one it needs next",
           "nbtune/activations.py",
           "    return range(runs[-2][1], runs[-1][1])",
           "    return range(runs[-3][1], runs[-2][1]) if len(runs) > 2 else range(0)",
           (T + "predict/test_long_context.py::test_offloaded_layer_inputs_are_prefetched_a_layer_ahead_in_backward",)),
    Mutant("longest context", "the line's crossing is taken one grain short",
           "nbtune/predict/longest.py",
           "        crossing = crossing // GRAIN * GRAIN\n",
           "        crossing = crossing // GRAIN * GRAIN - GRAIN\n",
           (T + "predict/test_long_context.py::test_longest_context_on_a_bending_memory_curve_is_exact_to_the_grain",)),
    # ---- prediction in one place: the shared cache and the advice from fit's space ----
    Mutant("prediction cache", "the cache takes one micro-batch for any accumulation",
           "nbtune/predict/predictor.py",
           "    return t.replace(grad_accum=min(t.grad_accum, 2),",
           "    return t.replace(grad_accum=min(t.grad_accum, 1),",
           (T + "predict/test_predictor.py::test_the_memory_twin_predicts_what_its_original_does",)),
    Mutant("out-of-memory advice", "the advice splits the batch all the way to one row",
           "nbtune/predict/space.py",
           "            moves.append((maths_steps(start, new, exact), -saving[i] if axis != \"batch_size\"\n"
           "                          else saving[i], changes, exact))",
           "            moves.append((maths_steps(start, new, exact), -saving[i], changes, exact))",
           (T + "predict/test_predictor.py::test_the_advice_offers_the_moves_it_always_did",)),
    Mutant("offloading", "a tensor parked again is taken for another one of its size",
           "nbtune/activations.py",
           "        if known is not None and known[0]() is t and known[1] == t._version:",
           "        known = next((c for c in self._copies.values() if c[2].shape == t.shape), known)\n"
           "        if known is not None:",
           (T + "predict/test_long_context.py::test_a_tensor_every_layer_saves_is_parked_once_and_gradients_stay_exact",)),
    Mutant("extrapolation", "offloading without checkpointing is extrapolated as any step",
           "nbtune/predict/estimator.py",
           "    if t.activation_offloading and not t.activation_checkpointing:\n        return 5, 6, 3, 2",
           "    if False:\n        return 5, 6, 3, 2",
           (T + "predict/test_estimate_depth.py::test_extrapolated_equals_every_layer_run",)),
    Mutant("tile carry", "the carried step is read one tile short",
           "nbtune/predict/carry.py",
           "        d, total = n - BASE, self.peak_keys.index(TOTAL_KEY)",
           "        d, total = n - BASE - 1, self.peak_keys.index(TOTAL_KEY)",
           (T + "predict/test_carry.py::test_a_tiled_step_carried_to_more_tiles_equals_every_tile_traced",)),
    Mutant("tile carry", "a pass over the tiles keeps its first tile only, not its last",
           "nbtune/predict/carry.py",
           "            pairs += [(a[0], b[0]), (a[-1], b[-1])]",
           "            pairs += [(a[0], b[0])]",
           (T + "predict/test_carry.py::test_a_tiled_step_carried_to_more_tiles_equals_every_tile_traced",)),
    Mutant("tile carry", "a moment is dropped when an earlier one holds more at the base only",
           "nbtune/predict/carry.py",
           "            if not any(p[0][total] >= a[total] and p[1][total] >= line[1][total] for p in peaks):",
           "            if not any(p[0][total] >= a[total] for p in peaks):",
           (T + "predict/test_carry.py::test_a_tiled_step_carried_to_more_tiles_equals_every_tile_traced",
            T + "predict/test_carry.py::test_every_combination_carried_equals_every_tile_traced")),
    Mutant("tile carry", "offloaded tensors near the size limit are carried anyway",
           "nbtune/predict/carry.py",
           "    if t.activation_offloading and t.batch_size * BASE * tile < MIN_BYTES:",
           "    if t.activation_offloading and t.batch_size * BASE * tile < 0:",
           (T + "predict/test_carry.py::test_what_is_not_carried",)),
    Mutant("tile carry", "a moment that falls is replaced by the next as if nothing was freed",
           "nbtune/memory/tracker.py",
           "        if peaks and self._last == where and (not self._fell or peaks[-1] == moment):",
           "        if peaks and self._last == where:",
           (T + "predict/test_carry.py::test_a_tiled_step_carried_to_more_tiles_equals_every_tile_traced",
            T + "predict/test_carry.py::test_every_combination_carried_equals_every_tile_traced")),
    Mutant("tile carry", "the longest-context line starts at the short lengths again",
           "nbtune/predict/longest.py",
           "        return BASE * tile\n",
           "        return min(FIRST, ceiling)\n",
           (T + "predict/test_carry.py::test_longest_context_of_a_tiled_run_draws_its_line_through_carried_lengths",)),
    Mutant("per-rank prediction", "under FSDP2 the shallow runs let the last layer be a front one too",
           "nbtune/predict/estimator.py",
           "    return (3, 4, 2, 1) if sharded else (2, 3, 2, 1)",
           "    return (2, 3, 2, 1)",
           (T + "predict/test_ranks.py::test_layers_are_carried_to_the_byte_under_fsdp",)),
    Mutant("per-rank prediction", "CPU offload leaves the sharded gradients on the card",
           "nbtune/memory/tracker.py",
           "    return (_MemRefType.PARAM, _MemRefType.GRAD, _MemRefType.OPT)",
           "    return (_MemRefType.PARAM, _MemRefType.OPT)",
           (T + "predict/test_ranks.py::test_cpu_offload_moves_the_sharded_state_to_every_ranks_host",)),
    Mutant("per-rank prediction", "a rank's frozen dense shards are counted as NF4 weights",
           "nbtune/memory/accounting.py",
           "        local = p.to_local() if isinstance(p, DTensor) else p  # FSDP2: this rank's shard",
           "        local = p",
           (T + "predict/test_ranks.py::test_a_rank_holds_its_share_of_the_weights_gradients_and_state",)),
    Mutant("QLoRA sharding", "NF4 scale blocks no longer leave a multiple of 8 to split over ranks",
           "nbtune/peft.py",
           "SHARDS = 8  # FSDP2 splits",
           "SHARDS = 1  # FSDP2 splits",
           (T + "cli/test_distributed.py::test_sharding_refusals_name_the_setting_and_the_fix",)),
    Mutant("processes", "a rank no longer notices that the kernel which started it is gone",
           "nbtune/run/processes.py",
           "    while os.getppid() == parent:",
           "    while True:",
           (T + "run/test_processes.py::test_a_killed_kernel_leaves_no_rank_and_no_controller_behind",)),
    Mutant("processes", "a change one rank refused is still made by the ranks that could",
           "nbtune/run/ranked.py",
           "        commit = refused is None\n",
           "        commit = True\n",
           (T + "run/test_processes.py::test_a_change_one_rank_refuses_is_made_by_no_rank",)),
    Mutant("processes", "Ctrl-C abandons the step under way on the ranks (the kernel stops counting first)",
           "nbtune/run/processes.py",
           "        def came() -> None:\n            self.interrupted = True\n",
           "        def came() -> None:\n            raise KeyboardInterrupt\n",
           (T + "run/test_processes.py::test_two_processes_from_the_kernel_equal_one_process_and_leave_nothing_behind[lora]",)),
    Mutant("processes", "a dropped change keeps the optimizer it built (abort undoes nothing)",
           "nbtune/run/trainer.py",
           "    def abort(self, prepared) -> None:\n        self._abort(prepared)",
           "    def abort(self, prepared) -> None:\n        self._commit(prepared)",
           (T + "run/test_processes.py::test_a_prepared_change_dropped_leaves_the_next_step_as_a_twin_never_asked_gives_it",)),
    Mutant("processes", "FSDP2-wrapped fields may change while the model is sharded",
           "nbtune/run/trainer.py",
           "        if fixed and self.parallel is not None:",
           "        if False:",
           (T + "run/test_processes.py::test_while_sharded_only_what_fsdp2_did_not_wrap_may_change",)),
    # ---- silent NaN (issue 37) ----
    Mutant("silent NaN", "the optimizer in backward writes a weight whose gradient is NaN",
           "nbtune/step.py",
           "        if not largest.isfinite().all():",
           "        if False:",
           (T + "properties/test_faults.py::test_a_nan_gradient_with_the_optimizer_in_backward_is_refused_not_applied",)),
    Mutant("silent NaN", "a training checkpoint holding NaN loads",
           "nbtune/checkpoint.py",
           "            check_finite(name, tensor, path, CheckpointRefused)",
           "            pass",
           (T + "test_checkpoint_files.py::test_a_checkpoint_holding_nan_or_infinity_is_refused_naming_file_and_tensor",)),
    Mutant("untrue message", "an out-of-memory error after a half-written update says it was rolled back",
           "nbtune/oom.py",
           "    if damaged:\n        head =",
           "    if False:\n        head =",
           (T + "properties/test_faults.py::test_failed_step_equals_twin[grad_hook_in_backward-oom-step3-auto]",)),
    # ---- pinned behaviours (issue 37, items 14 and 16) ----
    Mutant("dropped argument", "sampling ignores the temperature",
           "nbtune/generate.py",
           "    probs = torch.softmax(logits / temperature, dim=-1)",
           "    probs = torch.softmax(logits, dim=-1)",
           (T + "models/test_generate.py::test_sampling_at_a_temperature_draws_from_softmax_of_logits_over_it",)),
    Mutant("off-by-whitespace", "exact match strips the reply but not the reference",
           "nbtune/scoring.py",
           "    return reply.strip() == reference.strip()",
           "    return reply.strip() == reference",
           (T + "test_demos.py::test_exact_match_ignores_whitespace_around_the_reference_as_well",)),
    Mutant("unchecked input", "a single-process checkpoint's param_groups overwrite the run's unchecked",
           "nbtune/run/trainer.py",
           "            check_param_groups(prepared.optimizer, state[\"optimizer\"][\"param_groups\"])\n",
           "",
           (T + "test_checkpoint_files.py::test_a_wrong_typed_field_is_refused_naming_it_before_anything_is_applied",)),
    Mutant("wrong default", "a model with a shorter context than the default seq_len is refused",
           "nbtune/run/factory.py",
           "    if t.seq_len <= limit or chosen:",
           "    if True:",
           (T + "test_session.py::test_a_default_seq_len_follows_a_shorter_model_context_and_a_chosen_one_is_refused",)),
    Mutant("unchecked input", "a tokenizer larger than the embedding is accepted",
           "nbtune/run/factory.py",
           "    if ids > rows:  # else",
           "    if False:  # else",
           (T + "test_session.py::test_a_tokenizer_larger_than_the_embedding_is_refused_naming_both_sizes",)),
    Mutant("untrue message", "a read-only or full disk raises the raw OS error",
           "nbtune/atomic.py",
           "    if fix is None or not near:\n        return",
           "    if True:\n        return",
           (T + "test_atomic_save.py::test_a_read_only_or_full_disk_is_one_sentence_and_leaves_nothing",)),
    Mutant("off-by-one", "the last step is checkpointed only on the interval (5 steps every 2: step 4)",
           "nbtune/run/checkpoints.py",
           "        if self.every and (report.step % self.every == 0 or report.step == self.total):",
           "        if self.every and report.step % self.every == 0:",
           (T + "cli/test_runfile.py::test_a_last_step_off_the_checkpoint_interval_is_checkpointed_and_a_finished_run_resumes_to_nothing",)),
    Mutant("wrong order", "out-of-memory advice lists maths-changing moves as readily as exact ones",
           "nbtune/predict/advice.py",
           "    found.sort(key=lambda s: (s.fits is False, not s.exact))",
           "    found.sort(key=lambda s: s.fits is False)",
           (T + "predict/test_predictor.py::test_an_exact_change_is_advised_before_a_maths_changing_one_and_adapt_applies_it",)),
    Mutant("wrong order", "on_oom='adapt' applies the last suggestion, not the first",
           "nbtune/run/runner.py",
           "                best, adapted = err.suggestions[0], adapted + 1",
           "                best, adapted = err.suggestions[-1], adapted + 1",
           (T + "predict/test_predictor.py::test_an_exact_change_is_advised_before_a_maths_changing_one_and_adapt_applies_it",)),
    Mutant("wrong bound", "fit compares a CUDA start with the whole card, not its usable part",
           "nbtune/predict/search.py",
           "    room = usable(limit, target, reserve, margin)\n    given =",
           "    room = limit\n    given =",
           (T + "predict/test_fit.py::test_fit_with_the_default_reserve_and_margin_does_not_call_a_start_fitting_that_only_the_whole_card_holds",)),
    Mutant("wrong bound", "the undo copy's host check forgets what the step itself puts on the host",
           "nbtune/run/trainer.py",
           "        room = host.room(held=self._undo.nbytes, reserve=self._host_reserve(t)) if wanted else None",
           "        room = host.room(held=self._undo.nbytes) if wanted else None",
           (T + "test_host.py::test_the_undo_copys_host_check_counts_what_the_step_itself_puts_on_the_host",)),
    Mutant("wrong bound", "a chat template's output limit counts only flat string contents",
           "nbtune/template/budget.py",
           "                        total += len(part) + _ITEM if type(part) is str else _units(part, 1 << 62)",
           "                        total += len(part) + _ITEM if type(part) is str else 0",
           (T + "models/test_template_budget.py::test_a_conversation_over_4_mib_in_text_parts_and_long_tools_renders_as_jinja_does",)),
    Mutant("lost state", "a LoRA run keeps no restore copy: recover() has only a checkpoint or nothing",
           "nbtune/run/trainer.py",
           "        if self.parallel is not None or self.base_changed or not has_lora(self.model):\n            return\n        if not self._kept.due",
           "        if True:\n            return\n        if not self._kept.due",
           (T + "properties/test_faults.py::test_a_lora_run_recovers_to_its_last_step_from_the_copy_kept_in_host_memory",)),
    Mutant("wrong pace", "the restore copy is paced by nothing it costs: kept after every step",
           "nbtune/run/trainer.py",
           "        self._kept.pace(time.perf_counter() - began, report.seconds)",
           "        self._kept.pace(0.0, report.seconds)",
           (T + "properties/test_faults.py::test_the_restore_copys_pace_counts_all_its_work",)),
    Mutant("wrong order", "a GGUF chunk's query and key rows in the file's order, not llama.cpp's",
           "nbtune/models/gguf.py",
           "0, rows[start:start + step].to(tensor.device))",
           "0, rows[start:start + step].sort().values.to(tensor.device))",
           (T + "models/test_gguf.py::test_a_gguf_export_converts_a_chunk_of_rows_at_a_time_to_the_same_file",)),
    Mutant("wrong bound", "a merged save made and written all at once (one file, the whole model)",
           "nbtune/models/hf.py",
           "filename_pattern=\"model{suffix}.safetensors\", max_shard_size=PART_BYTES,",
           "filename_pattern=\"model{suffix}.safetensors\", max_shard_size=1 << 62,",
           (T + "test_save.py::test_a_merged_save_is_written_a_part_at_a_time",)),
    Mutant("wrong scaling", "Llama 3.1's RoPE factors written upside down",
           "nbtune/models/decoder.py",
           "rope_scaling=None)) / rope_frequencies(config)",
           "rope_scaling=None)) * rope_frequencies(config)",
           (T + "models/test_gguf.py::test_llama_3_1_rope_scaling_exports_as_llama_cpps_rope_freqs",)),
    Mutant("lost state", "a run given a checkpoint folder never writes its periodic checkpoint",
           "nbtune/run/runner.py",
           "            if after_step is not None:\n                after_step()",
           "            if after_step is None:\n                after_step()",
           (T + "properties/test_faults.py::test_a_run_checkpoints_every_so_many_minutes_and_recover_returns_there",)),
    Mutant("off by one", "the periodic checkpoint's minutes counted from the run's start, not the last save",
           "nbtune/run/checkpoints.py",
           "        finally:\n            self.since = self.clock()",
           "        finally:\n            pass",
           (T + "properties/test_faults.py::test_the_periodic_checkpoint_waits_its_minutes_and_a_failed_save_does_not_end_the_run",)),
    Mutant("wrong condition", "a chunked loss makes its gradients in forward even where that raises the predicted peak",
           "nbtune/predict/predictor.py",
           "<= self.estimate(t).peak + LOSS_PIECES_SLACK)",
           ">= 0)",
           (T + "test_techniques.py::test_keeping_the_pieces_follows_the_two_estimates_and_never_tiles",)),
    Mutant("dropped argument", "the step recomputes the loss pieces whatever the trainer chose",
           "nbtune/step.py",
           "recompute=options.recompute_loss or bool(options.tile_tokens)",
           "recompute=True",
           (T + "test_techniques.py::test_the_pieces_make_their_gradients_in_forward_where_that_raises_no_peak",)),
    Mutant("dropped argument", "the estimate of pieces with gradients in forward estimates recomputed ones",
           "nbtune/predict/estimator.py",
           "                                 recompute_loss=recompute_loss)",
           "                                 recompute_loss=True)",
           (T + "test_techniques.py::test_the_pieces_make_their_gradients_in_forward_where_that_raises_no_peak",)),
    Mutant("wrong condition", "the ranks' several steps ignore the other ranks' stop (each rank its own file)",
           "nbtune/run/processes.py",
           "if taken and parallel.sum_(torch.tensor([float(os.path.exists(flag))])).item():",
           "if taken and os.path.exists(flag):",
           (T + "run/test_processes.py::test_several_steps_to_a_command_end_at_the_first_boundary_any_rank_saw_stop",)),
    Mutant("dropped argument", "every step of a command measured as the first (track_rest unused)",
           "nbtune/run/processes.py",
           "report = trainer.step(track_rest if taken else track, True)",
           "report = trainer.step(track, True)",
           (T + "run/test_processes.py::test_several_steps_to_a_command_end_at_the_first_boundary_any_rank_saw_stop",)),
    Mutant("wrong condition", "the kernel sends every step asked for in one command, whatever their pace",
           "nbtune/run/ranked.py",
           "count = max(1, min(most, int(self.SECONDS_PER_COMMAND / last) if last > 0 else 1))",
           "count = most",
           (T + "run/test_processes.py::test_the_kernel_sends_as_many_steps_as_fill_its_seconds_per_command",)),
    Mutant("wrong condition", "the panel takes the browser's slider grid for a move (lr=3e-4 becomes 10**-3.5)",
           "nbtune/ui/panel.py",
           "        if _snapped(change[\"owner\"], getattr(self.runner.planned, name), change[\"new\"]):",
           "        if False:",
           (T + "ui/test_panel.py::test_a_slider_drawn_on_its_grid_changes_nothing_a_move_does",)),
    Mutant("dropped argument", "compare on ranks builds every row from the run file alone (its changes dropped)",
           "nbtune/run/ladder.py",
           "        names |= t.changed(ranks.config.to_techniques())",
           "        names = set()",
           (T + "run/test_processes.py::test_two_processes_from_the_kernel_equal_one_process_and_leave_nothing_behind[lora]",)),
    Mutant("dropped argument", "a run file's processes: is not read by from_config (one process trains)",
           "nbtune/session.py",
           "        return runfile.load(config, overrides).processes",
           "        return None",
           (T + "cli/test_runfile.py::test_processes_in_a_run_file_start_ranks_from_a_notebook_and_point_a_terminal_to_torchrun",)),
    Mutant("dropped argument", "the final norm's weight gets no gradient where the pieces make theirs in forward",
           "nbtune/loss.py",
           "divisor, len(parts), *parts, *_trainable(lm_head, norm))",
           "divisor, len(parts), *parts, *_trainable(lm_head))",
           (T + "test_techniques.py::test_pieces_with_gradients_in_forward_equal_recomputed_pieces_and_an_independent_whole_loss",)),
    Mutant("wrong scaling", "the gradients made in forward are not scaled by the gradient backward brings",
           "nbtune/loss.py",
           "*[g.mul_(grad) if g is not None else None for g in grads])",
           "*grads)",
           (T + "test_techniques.py::test_pieces_with_gradients_in_forward_equal_recomputed_pieces_and_an_independent_whole_loss",)),
    Mutant("wrong condition", "the optimizer in backward's gradient check reads only the largest entry (-inf passes)",
           "nbtune/step.py",
           "torch.stack(torch.aminmax(local.detach()))",
           "torch.amax(local.detach()).reshape(1)",
           (T + "properties/test_faults.py::test_a_nan_gradient_with_the_optimizer_in_backward_is_refused_not_applied",)),
    Mutant("dropped argument", "session.estimate predicts recomputed loss pieces where the step makes their gradients in forward",
           "nbtune/session.py",
           "return predictor.estimate(t, **shape, recompute_loss=not in_forward)",
           "return predictor.estimate(t, **shape)",
           (T + "test_techniques.py::test_the_sessions_estimate_takes_the_loss_pieces_as_its_step_does",)),
    Mutant("off-by-one", "QLoRA's dequantization reads a code byte's low nibble as its first value",
           "nbtune/peft.py",
           "torch.stack([nf4.repeat_interleave(16), nf4.repeat(16)], -1)",
           "torch.stack([nf4.repeat(16), nf4.repeat_interleave(16)], -1)",
           (FAMILY_QLORA,)),
    Mutant("off-by-one", "QLoRA's bf16 dequantization swaps the two code bytes a table entry stands for",
           "nbtune/peft.py",
           "torch.stack([pairs.expand(256, 256), pairs.view(256, 1).expand(256, 256)], -1)",
           "torch.stack([pairs.view(256, 1).expand(256, 256), pairs.expand(256, 256)], -1)",
           (T + "models/test_qlora.py::test_dequantize_and_the_nf4_linear_give_torchaos_values_bit_for_bit",)),
    Mutant("dropped statement", "the step holds the hidden states through backward though the loss pieces need none of them",
           "nbtune/step.py",
           "    return cross_entropy_sum(model.lm_head, hidden, batch[\"labels\"], pieces,",
           "    model.held = hidden\n    return cross_entropy_sum(model.lm_head, hidden, batch[\"labels\"], pieces,",
           (T + "test_techniques.py::test_with_gradients_made_in_forward_backward_runs_without_the_hidden_states",)),
    Mutant("wrong condition", "a Ctrl-C'd run's mark is cleared on the main thread only: the next run in the background stops at once",
           "nbtune/run/processes.py",
           "        self.interrupted = False\n\n        def came() -> None:",
           "        if threading.current_thread() is threading.main_thread():\n            self.interrupted = False\n\n        def came() -> None:",
           (T + "run/test_processes.py::test_two_processes_from_the_kernel_equal_one_process_and_leave_nothing_behind[lora]",)),
    # ---- issue 51: each rank its share ----
    Mutant("off-by-one", "a rank reads the rows one chunk of its own size over, not FSDP2's chunk",
           "nbtune/shards.py",
           "first = min(rows, mesh.get_local_rank(dim) * chunk)",
           "first = min(rows, mesh.get_local_rank(dim) * (rows // mesh.size(dim)))",
           (T + "test_shards.py::test_each_rank_holds_its_shards_of_the_one_process_model_and_reads_no_more",)),
    Mutant("wrong scaling", "a rank's NF4 subtracts the mean of its own rows' scales, not the whole weight's",
           "nbtune/peft.py",
           "    mean = absmax.mean()",
           "    mean = nf4_block_absmax(rows).mean()",
           (T + "test_shards.py::test_nf4_of_a_ranks_rows_is_byte_for_byte_its_shard_of_the_whole_weights_nf4",)),
    Mutant("dropped argument", "a rank keeps the first rows of each whole LoRA pair, not its own",
           "nbtune/shards.py",
           "                _local(mine).copy_(whole[first:end])",
           "                _local(mine).copy_(whole[:end - first])",
           (T + "test_shards.py::test_each_rank_holds_its_shards_of_the_one_process_model_and_reads_no_more",)),
    Mutant("dropped argument", "activation offloading parks the weights FSDP2 gathers",
           "nbtune/activations.py",
           "        weights = list(model.parameters()) + gather_buffers(model)",
           "        weights = list(model.parameters())",
           (T + "test_shards.py::test_offloading_parks_activations_only_so_n_ranks_park_n_times_one_ranks_share",)),
    Mutant("dropped statement", "a save from ranks hands the writer the gathered weight itself, freed at the next unit",
           "nbtune/shards.py",
           "        return made.clone() if made.device.type == \"cpu\" else made",
           "        return made",
           (T + "test_shards.py::test_each_rank_holds_its_shards_of_the_one_process_model_and_reads_no_more",)),
    Mutant("dropped argument", "the loading estimate forgets the rows a rank reads beside its shards",
           "nbtune/predict/estimator.py",
           "            need = n * dtype if spread is not None else 0",
           "            need = 0",
           (T + "test_shards.py::test_each_rank_holds_its_shards_of_the_one_process_model_and_reads_no_more",)),
    Mutant("wrong condition", "checkpointing and tiling fixed again while the model is sharded",
           "nbtune/plan.py",
           "SHARDED_FIELDS = REBUILDS_MODEL | {\"compile\"}",
           "SHARDED_FIELDS = REBUILDS_MODEL | RETUNES_MODEL",
           (T + "run/test_processes.py::test_while_sharded_only_what_fsdp2_sharded_and_compile_are_fixed",)),
    Mutant("dropped argument", "distributed.replicate is read but the mesh stays one-dimensional (plain FSDP)",
           "nbtune/distributed.py",
           "    if mesh is None and sharding.replicate > 1:",
           "    if False:",
           (T + "cli/test_distributed.py::test_two_machines_by_rendezvous_and_hsdp_equal_one_process",)),
    Mutant("wrong scaling", "host memory counts every rank on one machine whatever machines says",
           "nbtune/predict/ranks.py",
           "        return self.world // self.machines",
           "        return self.world",
           (T + "predict/test_ranks.py::test_host_memory_is_predicted_per_machine_and_hsdp_shards_within_a_group",)),
    Mutant("dropped statement", "a toggle's tooltip keeps only the first line of its entry in the Techniques docstring",
           "nbtune/techniques.py",
           '            found[name] += " " + line.strip()',
           "            pass",
           (T + "test_docs.py::test_each_toggles_tooltip_is_its_whole_line_in_the_techniques_docstring",)),
    Mutant("wrong scaling", "Gemma's RMSNorm scales by its weight, not by 1 + weight",
           "nbtune/models/decoder.py",
           "            return (x32 * (1.0 + self.weight.float())).to(x.dtype)",
           "            return (x32 * self.weight.float()).to(x.dtype)",
           (T + "models/test_families.py::test_logits_match_reference_fp32",)),
    Mutant("wrong condition", "Gemma 3's sliding layers attend past their window (the global layers' mask)",
           "nbtune/models/decoder.py",
           "            h = layer(h, *tables[layer.sliding], local if layer.sliding else full, cache)",
           "            h = layer(h, *tables[layer.sliding], full, cache)",
           (T + "models/test_gemma3.py::test_the_sliding_layers_see_only_their_window_and_the_global_ones_everything",)),
    Mutant("dropped argument", "Gemma 3's sliding layers rotate with the global layers' RoPE base and scaling",
           "nbtune/models/decoder.py",
           "            h = layer(h, *tables[layer.sliding], local if layer.sliding else full, cache)",
           "            h = layer(h, *tables[False], local if layer.sliding else full, cache)",
           (T + "models/test_families.py::test_logits_match_reference_fp32",)),
    Mutant("wrong condition", "the estimate extrapolates Gemma 3 by single layers, whatever their pattern",
           "nbtune/predict/estimator.py",
           "    period = every * config.layer_pattern // math.gcd(every, config.layer_pattern)",
           "    period = every",
           (T + "predict/test_estimate_depth.py::test_layer_period_covers_the_pattern_of_sliding_and_global_layers",
            T + "predict/test_estimate_depth.py::test_extrapolated_equals_every_layer_run")),
    Mutant("wrong scaling", "Phi-4-mini's partial rotary rotates the whole of each head",
           "nbtune/models/config.py",
           "        return int(self.head_dim * self.partial_rotary_factor)",
           "        return self.head_dim",
           (T + "models/test_families.py::test_logits_match_reference_fp32",)),
    Mutant("dropped statement", "LongRoPE's attention factor is not applied to cos and sin",
           "nbtune/models/decoder.py",
           "    if scale != 1.0:",
           "    if False:",
           (T + "models/test_phi3.py::test_short_factors_within_the_original_context_and_long_ones_past_it",)),
    Mutant("wrong condition", "LongRoPE keeps its short factors past the original context",
           "nbtune/models/decoder.py",
           "        beyond = positions.max() + 1 > config.rope_scaling[\"original_max_position_embeddings\"]",
           "        beyond = positions.max() < 0",
           (T + "models/test_phi3.py::test_short_factors_within_the_original_context_and_long_ones_past_it",)),
    Mutant("swapped arguments", "Phi's fused gate_up_proj is read up first, gate second",
           "nbtune/models/decoder.py",
           "        gate, up = self.gate_up_proj(x).chunk(2, dim=-1) if self.fused",
           "        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)[::-1] if self.fused",
           (T + "models/test_families.py::test_logits_match_reference_fp32",)),
    Mutant("dropped condition", "a checkpointed MoE layer's recompute in backward records its routing (and keeps its graph)",
           "nbtune/models/decoder.py",
           "        if self.recording:",
           "        if True:",
           (T + "models/test_qwen3_moe.py::test_a_checkpointed_layers_recompute_keeps_no_routing_graph",)),
    Mutant("dropped statement", "the load-balancing loss is reported but not trained on",
           "nbtune/step.py",
           "            loss = loss + balance * (coef / len(passes) / (1 if parallel is None else parallel.world))",
           "            pass",
           (T + "models/test_qwen3_moe.py::test_a_step_adds_the_balancing_loss_as_transformers_does",)),
    Mutant("wrong scaling", "the routing weights are not renormalised over the chosen experts (norm_topk_prob)",
           "nbtune/models/decoder.py",
           "            weights = weights / weights.sum(dim=-1, keepdim=True)",
           "            weights = weights",
           (T + "models/test_families.py::test_logits_match_reference_fp32",)),
    Mutant("wrong condition", "QLoRA leaves a mixture of experts' unadapted experts dense",
           "nbtune/peft.py",
           "            if isinstance(m, nn.Linear) and target_of(name) == \"experts\":",
           "            if False:",
           (T + "models/test_qwen3_moe.py::test_experts_are_a_lora_target_off_by_default_and_nf4_under_qlora",)),
    Mutant("wrong index", "transformers 5's fused gate_up_proj read with gate and up swapped",
           "nbtune/models/hf.py",
           "            for e in range(experts) for i, part in enumerate((\"gate_proj\", \"up_proj\"))]",
           "            for e in range(experts) for i, part in enumerate((\"up_proj\", \"gate_proj\"))]",
           (T + "models/test_qwen3_moe.py::test_transformers_5s_fused_experts_read_as_the_hubs",)),
    Mutant("wrong condition", "a sliding layer's KV cache keeps every key, growing with the text",
           "nbtune/models/decoder.py",
           "        if window is None:\n            self.keys[layer], self.values[layer] = k, v",
           "        if True:\n            self.keys[layer], self.values[layer] = k, v",
           (T + "models/test_families.py::test_a_sliding_layers_cache_keeps_only_its_window",)),
    Mutant("wrong scaling", "on ranks the balancing term is scaled by the ranks with the cross-entropy",
           "nbtune/step.py",
           "            loss = loss + balance * (coef / len(passes) / (1 if parallel is None else parallel.world))",
           "            loss = loss + balance * (coef / len(passes))",
           (T + "models/test_qwen3_moe.py::test_on_ranks_the_balancing_term_is_each_ranks_own_averaged",)),
    Mutant("wrong value", "Gemma 3's norms written to GGUF as the weight, not 1 + weight as llama.cpp multiplies",
           "nbtune/models/gguf.py",
           "                tensor = tensor.float() + shift",
           "                tensor = tensor.float()",
           (T + "models/test_gguf_families.py::test_gemma3_norms_are_stored_as_llama_cpp_multiplies_by_them",
            T + "models/test_gguf_families.py::test_each_family_exports_under_llama_cpps_names_and_reads_back")),
    Mutant("wrong index", "a GGUF expert stack written in reverse expert order",
           "nbtune/models/gguf_arch.py",
           "    return [(name, [part[e] for e in sorted(part)] if isinstance(part, dict) else part)",
           "    return [(name, [part[e] for e in sorted(part, reverse=True)] if isinstance(part, dict) else part)",
           (T + "models/test_gguf_families.py::test_moe_experts_are_stacked_in_expert_order_and_quantized_as_one",)),
    Mutant("wrong value", "Phi-3's rotated dimensions written to GGUF as the whole head",
           "nbtune/models/gguf.py",
           "    writer.add_rope_dimension_count(config.rotary_dim)",
           "    writer.add_rope_dimension_count(config.head_dim)",
           (T + "models/test_gguf_families.py::test_each_family_exports_under_llama_cpps_names_and_reads_back",)),
    Mutant("wrong condition", "a Gemma 3 whose query scale llama.cpp would not use is written anyway",
           "nbtune/models/gguf_arch.py",
           "        if config.query_pre_attn_scalar != gemma3_query_scalar(config.num_layers, config.hidden_size,",
           "        if False and config.query_pre_attn_scalar != gemma3_query_scalar(config.num_layers, config.hidden_size,",
           (T + "models/test_gguf_families.py::test_a_model_llama_cpp_would_run_differently_is_refused_before_any_file",)),
    Mutant("wrong condition", "a sliding window's mask left boolean, so SDPA keeps a bias for every layer",
           "nbtune/models/decoder.py",
           "        shared = torch.is_grad_enabled() and not all(layer.checkpointed for layer in self.model.layers)",
           "        shared = False",
           (T + "models/test_families.py::test_a_windows_mask_is_kept_once_for_backward_not_once_a_layer",)),
    Mutant("wrong condition", "a fused gate_up adapter trained in PEFT split into gate and up halves anyway",
           "nbtune/peft_experts.py",
           "                if block[:width, r:].any() or block[width:, :r].any():",
           "                if False:",
           (T + "models/test_qwen3_moe.py::test_a_fused_expert_adapter_trained_in_peft_is_refused_by_name",)),
    Mutant("wrong index", "the experts' fused down_proj B written expert-major, not as PEFT reshapes it",
           "nbtune/peft_experts.py",
           "        return torch.cat(parts) if part == \"lora_A\" else torch.stack(parts, -1).flatten(1)",
           "        return torch.cat(parts) if part == \"lora_A\" else torch.stack(parts, 1).flatten(1)",
           (T + "models/test_qwen3_moe.py::test_an_adapter_on_attention_and_experts_loads_in_peft_and_back",)),
    Mutant("wrong condition", "a queued change is taken as checked even on techniques it was not checked on",
           "nbtune/run/runner.py",
           "            same = queued.checked_on is not None and queued.checked_on == self.trainer.techniques",
           "            same = True",
           (T + "run/test_runner.py::test_after_a_refusal_at_the_boundary_the_rest_of_the_queue_is_checked_again",)),
    Mutant("wrong value", "a queued change checked again at the boundary on the techniques it was checked on",
           "nbtune/run/runner.py",
           "            changed = self.trainer.set(new, checked=checked is not None)",
           "            changed = self.trainer.set(new, checked=False)",
           (T + "run/test_runner.py::test_a_queued_change_is_checked_once_and_the_plan_is_kept_not_replayed",)),
    Mutant("wrong condition", "untrained adapters folded into the base when the targets change, marking it changed",
           "nbtune/plan.py",
           "        if reshape and adapters_untrained(model) and not any(is_nf4(p) for p in model.parameters()):",
           "        if False:",
           (T + "models/test_adapters.py::test_targets_chosen_before_any_training_leave_the_base_as_loaded_and_the_adapter_saveable",)),
    Mutant("wrong condition", "untrained adapters dropped on an NF4 base, leaving 4-bit weights under LoRA or full",
           "nbtune/plan.py",
           "        if reshape and adapters_untrained(model) and not any(is_nf4(p) for p in model.parameters()):",
           "        if reshape and adapters_untrained(model):",
           (T + "models/test_adapters.py::test_untrained_adapters_on_an_nf4_base_are_still_merged_so_no_nf4_weight_is_left",)),
    Mutant("dropped lock", "two threads queueing a change at once chain both off the same base (one lost from the plan)",
           "nbtune/run/runner.py",
           "            with self._queueing:\n                base = self.planned",
           "            if True:\n                base = self.planned",
           (T + "run/test_runner.py::test_two_threads_queueing_at_once_chain_their_changes",)),
    Mutant("wrong scaling", "IPO's chosen log-ratio not averaged over its completion's tokens",
           "nbtune/objectives/preference.py",
           "            delta = (chosen_ratio / chosen.tokens.clamp(min=1)",
           "            delta = (chosen_ratio",
           (T + "objectives/test_preference.py::test_dpo_and_ipo_equal_trls_loss_and_rewards[ipo]",)),
    Mutant("dropped term", "a completion's log-probs taken from the logits without the log-softmax's normaliser",
           "nbtune/objectives/preference.py",
           "    return (taken - torch.logsumexp(logits, dim=-1)) * keep",
           "    return taken * keep",
           (T + "objectives/test_preference.py::test_completion_log_probs_equal_trls_batch_log_probs",)),
    Mutant("dropped term", "SimPO's target margin gamma left out",
           "nbtune/objectives/preference.py",
           "            losses = -F.logsigmoid(beta * (chosen_mean - rejected_mean) - gamma)",
           "            losses = -F.logsigmoid(beta * (chosen_mean - rejected_mean))",
           (T + "objectives/test_preference.py::test_simpo_equals_trls_cpo_loss_with_its_simpo_type",)),
    Mutant("wrong sign", "ORPO's odds-ratio term added to the SFT loss instead of subtracted",
           "nbtune/objectives/preference.py",
           "            losses = -beta * F.logsigmoid(log_odds)",
           "            losses = beta * F.logsigmoid(log_odds)",
           (T + "objectives/test_preference.py::test_orpo_equals_trls_odds_ratio_loss_with_its_sft_term",)),
    Mutant("dropped call", "the reference run with the adapters still on (the policy compared with itself)",
           "nbtune/peft.py",
           "        layer.off = True",
           "        layer.off = False",
           (T + "objectives/test_preference_training.py::test_a_dpo_step_updates_the_adapters_as_trls_loss_does[0]",)),
    Mutant("wrong scaling", "each micro-batch's pair losses averaged over its own pairs, not the step's",
           "nbtune/objectives/preference.py",
           "    loss = losses.sum() / pairs_total",
           "    loss = losses.mean()",
           (T + "objectives/test_preference_training.py::test_two_accumulated_micro_batches_of_pairs_equal_one_batch_of_them[dpo]",)),
    Mutant("wrong scaling", "ORPO's cross-entropy over the micro-batch's chosen tokens, not the step's",
           "nbtune/objectives/preference.py",
           "        loss = loss - chosen.logps.sum() / chosen_tokens_total",
           "        loss = loss - chosen.logps.sum() / chosen.tokens.sum()",
           (T + "objectives/test_preference_training.py::test_two_accumulated_micro_batches_of_pairs_equal_one_batch_of_them[orpo]",)),
    Mutant("wrong condition", "ranks split a pair batch by rows, one rank all chosen, the other all rejected",
           "nbtune/distributed.py",
           "        if pairs:",
           "        if False:",
           (T + "objectives/test_preference_training.py::test_each_rank_takes_its_chosen_rows_and_the_rejected_rows_of_the_same_pairs",)),
    Mutant("dropped argument", "a pair's prompt's own assistant turns scored with its completion",
           "nbtune/data/batches.py",
           "        spans = spans[-1:] if last_only else spans",
           "        spans = spans",
           (T + "objectives/test_preference_training.py::test_a_text_pair_and_a_message_pair_score_only_their_completions",)),
    Mutant("wrong value", "sft on pairs trains the rejected completions",
           "nbtune/data/__init__.py",
           "        rows = [pair.chosen for pair in self.train] if self.pairs else self.train",
           "        rows = [pair.rejected for pair in self.train] if self.pairs else self.train",
           (T + "objectives/test_preference_training.py::test_an_objective_needs_pairs_and_sft_on_pairs_trains_the_chosen_completions",)),
    Mutant("wrong shape", "the estimate of a pair batch with batch_size rows, not twice as many (GRPO's: not G times)",
           "nbtune/predict/estimator.py",
           "    rows = 2 if t.paired else t.generations if t.objective == \"grpo\" else 1",
           "    rows = 1",
           (T + "objectives/test_preference_training.py::test_the_estimate_equals_the_measured_step_of_pairs",
            GRPO + "::test_the_estimate_of_both_phases_equals_the_measured_ones")),
    Mutant("dropped branch", "a precomputed reference ignored: the step runs the reference forward anyway",
           "nbtune/objectives/preference.py",
           "    if \"reference_logps\" in batch:  # precomputed before training (``reference_logps``)",
           "    if False:",
           (T + "objectives/test_preference_training.py::test_full_finetuning_dpo_scores_against_the_weights_it_started_from_computed_once",)),
    Mutant("wrong order", "a batch's precomputed reference interleaved (chosen, rejected per pair), not in its rows' order",
           "nbtune/data/batches.py",
           "            batch[\"reference_logps\"] = torch.cat([chosen_rejected[:, 0], chosen_rejected[:, 1]])",
           "            batch[\"reference_logps\"] = chosen_rejected.flatten()",
           (T + "properties/test_every_field.py::test_field_set_at_build_time_takes_effect[reference]",)),
    Mutant("dropped statement", "a checkpoint's precomputed reference not restored (the session's own kept)",
           "nbtune/objectives/reference.py",
           "    stream.reference_logps = values.float()",
           "    return",
           (T + "objectives/test_preference_training.py::test_a_precomputed_reference_is_saved_with_the_checkpoint_and_resumes_exactly",)),
    Mutant("wrong condition", "under full finetuning a seq_len change recomputes the reference from the trained weights",
           "nbtune/objectives/reference.py",
           "    if cached is not None and trained_against and not base:",
           "    if False:",
           (T + "objectives/test_preference_training.py::test_full_finetuning_dpo_scores_against_the_weights_it_started_from_computed_once",)),
    Mutant("dropped check", "after sft steps dpo compares with the base (adapters off), not the model it starts from",
           "nbtune/plan.py",
           "    if new.reference_kind != \"adapters_off\" or same or not has_lora(model) or adapters_untrained(model):",
           "    if True:",
           (T + "objectives/test_preference_training.py::test_after_sft_the_reference_is_the_model_as_dpo_starts_not_the_base",)),
    Mutant("dropped argument", "switched to a precomputed reference mid-run, the pairs scored with the adapters on (another reference)",
           "nbtune/objectives/reference.py",
           "                             max(t.chunked_loss, 1), base=base)",
           "                             max(t.chunked_loss, 1), base=False)",
           (T + "properties/test_every_field.py::test_field_set_on_a_live_session_takes_effect[reference]",)),
    Mutant("wrong shape", "the out-of-memory advice asked for GRPO's rows, G times the prompts the batch holds",
           "nbtune/run/trainer.py",
           "                    shape = (shape[0] // t.generations, t.seq_len)",
           "                    shape = (shape[0], t.seq_len)",
           (GRPO + "::test_out_of_memory_names_the_phase_and_asks_advice_for_batch_size_prompts",)),
    Mutant("wrong shape", "the out-of-memory advice asked for twice the pairs the batch holds",
           "nbtune/run/trainer.py",
           "                    shape = (shape[0] // 2, shape[1])",
           "                    shape = (shape[0], shape[1])",
           (T + "objectives/test_preference_training.py::test_out_of_memory_advice_and_per_rank_estimates_take_pairs_as_batch_size",)),
    # ---- GRPO (objectives/grpo.py and its callers) ----
    Mutant("wrong scaling", "the advantages divided by the group's std plus 1 (not TRL's 1e-4)",
           "nbtune/objectives/grpo.py",
           "        centred = centred / (grouped.std(1, keepdim=True) + 1e-4)",
           "        centred = centred / (grouped.std(1, keepdim=True) + 1.0)",
           (GRPO + "::test_advantages_are_trls_group_normalisation",)),
    Mutant("wrong sign", "the KL estimate's ratio taken the wrong way round",
           "nbtune/objectives/grpo.py",
           "    divergence = torch.exp(reference - logps) - (reference - logps) - 1",
           "    divergence = torch.exp(logps - reference) - (reference - logps) - 1",
           (GRPO + "::test_the_loss_and_its_gradient_are_trls",)),
    Mutant("wrong normalisation", "grpo_loss='grpo' sums every token instead of averaging each completion first",
           "nbtune/objectives/grpo.py",
           "        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / completions",
           "        return masked.sum() / completions",
           (GRPO + "::test_the_loss_and_its_gradient_are_trls",)),
    Mutant("wrong index", "a completion's seed counts its prompt within the micro-batch, not the step",
           "nbtune/run/trainer.py",
           "completion_seed(t.seed, number, first + k, j)",
           "completion_seed(t.seed, number, k, j)",
           (GRPO + "::test_two_accumulated_micro_batches_equal_one_batch_of_their_prompts",)),
    Mutant("dropped argument", "the update scores the completions at temperature 1, not the one they were sampled at",
           "nbtune/objectives/grpo.py",
           "            logps = token_logps(model.lm_head, hidden, labels, 1, options.rollout_temperature)",
           "            logps = token_logps(model.lm_head, hidden, labels, 1, 1.0)",
           (GRPO + "::test_a_step_is_the_loss_computed_here_from_the_models_logits",)),
    Mutant("dropped check", "a reward of NaN is taken as a number",
           "nbtune/objectives/grpo.py",
           "                and math.isfinite(float(v))",
           "                and True",
           (GRPO + "::test_a_misbehaving_reward_is_named_and_the_session_goes_on_as_its_twin",)),
    Mutant("dropped moment", "the estimate of the writing leaves out the last token's forward (a full KV cache)",
           "nbtune/predict/estimator.py",
           "            lasts = (False, True) if t.max_completion > 1 else (False,)  # (one token: no forward after)",
           "            lasts = (False, False)",
           (GRPO + "::test_the_estimate_of_both_phases_equals_the_measured_ones",)),
    Mutant("off by one", "a prompt is kept when its completion has one token less room than max_completion",
           "nbtune/data/batches.py",
           "    room = seq_len + 1 - completion  # a row of prompt + completion reads all but its last token",
           "    room = seq_len + 2 - completion",
           (GRPO + "::test_a_prompt_that_leaves_no_room_for_max_completion_is_skipped_and_said",)),
    Mutant("dropped argument", "a run file's reward weights ignored (every reward weighs 1)",
           "nbtune/runfile.py",
           "            loaded.append((_load_reward(self.reward_file(spec), spec, f\"rewards[{i}]\"), weight))",
           "            loaded.append((_load_reward(self.reward_file(spec), spec, f\"rewards[{i}]\"), 1.0))",
           (GRPO + "::test_a_grpo_session_saved_as_a_run_file_trains_the_same_under_nbtune_train",)),
    Mutant("wrong condition", "the writing measured on the first step only, before the optimizer holds its state",
           "nbtune/run/trainer.py",
           "        key = (t, self._new_optimizer)  # (before the first update the optimizer holds no state)",
           "        key = t",
           (GRPO + "::test_the_estimate_of_both_phases_equals_the_measured_ones",)),
    Mutant("wrong index", "on ranks, a completion's seed leaves out its rank's place in the global batch",
           "nbtune/run/trainer.py",
           "            first = (i * world + rank) * len(prompts[\"rows\"])",
           "            first = i * world * len(prompts[\"rows\"])",
           (GRPO + "::test_two_ranks_write_and_train_as_one_process_does",)),
    Mutant("dropped collective", "on ranks, a reward's failure raised on its rank alone (the others wait for it)",
           "nbtune/run/trainer.py",
           "                if self.parallel is None:\n                    raise",
           "                raise",
           (GRPO + "::test_a_reward_failing_on_one_rank_is_said_by_every_rank_and_none_waits",)),
    Mutant("dropped check", "a completion does not end at its stop token",
           "nbtune/objectives/grpo.py",
           "                    done[i] = token in stop_ids",
           "                    done[i] = False",
           (GRPO + "::test_a_group_written_together_equals_each_written_alone",)),
    Mutant("dropped weight", "GRPO's held-out reward sums the reward functions without their weights",
           "nbtune/run/factory.py",
           "        values = score(rewards, rows, texts) @ torch.tensor([r.weight for r in rewards])",
           "        values = score(rewards, rows, texts).sum(1)",
           (GRPO + "::test_evaluate_under_grpo_is_the_mean_reward_of_greedy_completions_of_the_held_out_prompts",)),
    Mutant("stale state", "a reference copy moved to the host is copied again from the trained weights",
           "nbtune/objectives/reference.py",
           "    if weights is None and held is not None:\n        return held.placed(host, dtype)",
           "    if weights is None and held is not None and not host:\n        return held.placed(host, dtype)",
           (COPY + "::test_a_copy_is_saved_with_the_checkpoint_and_resumes_exactly",)),
    Mutant("dropped state", "a checkpoint leaves out the reference copy",
           "nbtune/checkpoint.py",
           "        if state.get(\"reference_copy\") is not None else []",
           "        if False else []",
           (COPY + "::test_a_copy_is_saved_with_the_checkpoint_and_resumes_exactly",)),
    Mutant("wrong placement", "the estimate counts a host copy on the device",
           "nbtune/predict/estimator.py",
           "                                 store=\"meta\" if host and target == \"cuda\" else \"cpu\")",
           "                                 store=\"cpu\")",
           (COPY + "::test_the_estimate_counts_the_copy_on_the_device_or_on_the_host",)),
    Mutant("dropped check", "a copy is made of weights trained against a precomputed reference",
           "nbtune/objectives/reference.py",
           "    if weights is None and previous is not None and previous.reference_kind == \"precomputed\" and trained:",
           "    if False:",
           (COPY + "::test_a_reference_changes_form_mid_run_only_where_the_weights_it_started_from_are_kept",)),
    Mutant("wrong scaling", "split_pairs counts the batch's loss in both halves",
           "nbtune/objectives/preference.py",
           "    return weighted - weighted.detach() + (scored.loss if half == 0 else 0)",
           "    return weighted - weighted.detach() + scored.loss",
           (PREF_TRAIN + "::test_split_pairs_trains_as_one_batch_does_holding_less",)),
    Mutant("wrong index", "split_pairs weighs the rejected rows with the chosen rows' weights",
           "nbtune/objectives/preference.py",
           "    weighted = (logps.float() * scored.weights[rows]).sum()",
           "    weighted = (logps.float() * scored.weights[:size]).sum()",
           (PREF_TRAIN + "::test_a_split_pair_step_updates_the_adapters_as_the_dpo_loss_computed_here_does",)),
    Mutant("wrong scaling", "the 8-bit KV cache's scale has half its range",
           "nbtune/models/decoder.py",
           "            scale = new.detach().abs().amax(-1, keepdim=True).float() / 127",
           "            scale = new.detach().abs().amax(-1, keepdim=True).float() / 63",
           (GRPO + "::test_an_int8_kv_cache_holds_about_a_quarter_of_fp32s_and_attends_as_the_model_does_within_its_rounding",)),
    Mutant("stale state", "recovered to step 0, a precomputed reference of the weights dpo started from is kept",
           "nbtune/run/trainer.py",
           "            self._reference = None  # (scored again too)",
           "            pass",
           (COPY + "::test_recovering_to_step_0_scores_against_the_base_again",)),
    Mutant("stale state", "a loaded precomputed reference is swapped for the session's own at the next data change",
           "nbtune/run/trainer.py",
           "            if state.get(\"reference_logps\") is not None:  # the loaded reference is the one kept",
           "            if False:",
           (COPY + "::test_a_loaded_precomputed_reference_is_the_one_kept_when_the_batches_change",)),
    # issue 56: what a user on a rented box trips on
    Mutant("dropped option", "fit on several cards never offers to shard the embedding and head apart",
           "nbtune/predict/space.py",
           '"shard_embeddings": [start.shard_embeddings] + ([] if tied else [not start.shard_embeddings]),',
           '"shard_embeddings": [start.shard_embeddings],',
           (T + "predict/test_ranks.py::test_fit_on_two_cards_searches_fsdps_settings_and_says_which_it_chose",)),
    Mutant("unsound bound", "fit takes FSDP2's settings to free only the weights, not the gathered ones",
           "nbtune/predict/search.py",
           '        extra += sum(v for k, v in held.items() if k != "activations") + memory.outside',
           '        extra += held.get("parameters", 0) + memory.outside',
           (T + "predict/test_ranks.py::test_fit_on_two_cards_searches_fsdps_settings_and_says_which_it_chose",
            T + "predict/test_fit.py::test_fsdps_settings_bound_all_but_the_activations_held_at_a_failed_peak")),
    Mutant("wrong count", "the status line counts this run's steps as the session's",
           "nbtune/ui/status.py", "    now = before + done", "    now = done",
           (T + "ui/test_panel.py::test_run_status_line_counts_time_left_and_cost",)),
    Mutant("inverted check", "a busy machine is never said",
           "nbtune/hardware.py", "    if others is None or others < max(BUSY_CORES, 0.1 * (os.cpu_count() or 1)):",
           "    if others is None or others >= 0:",
           (T + "ui/test_panel.py::test_run_status_line_counts_time_left_and_cost",
            T + "test_session.py::test_a_run_on_a_busy_machine_says_so_and_a_quiet_one_does_not")),
    Mutant("dropped term", "the CPU chart's every-step line keeps the runtime in",
           "nbtune/memory/usage.py", "        return max(0, self.peak - self.runtime)", "        return self.peak",
           (T + "ui/test_charts.py::test_a_session_meters_every_step_and_a_bare_trainer_does_not",)),
    Mutant("dropped argument", "a reloaded adapter falls back to the default techniques",
           "nbtune/adapters.py", '    t = as_techniques(given, trained or Techniques(method="lora"))',
           '    t = as_techniques(given, Techniques(method="lora"))',
           (T + "models/test_adapters.py::test_a_reloaded_adapter_trains_on_with_the_settings_it_was_trained_with",)),
    Mutant("dropped argument", "Try it ignores the task's input beside the prompt",
           "nbtune/ui/panel.py", "                prompt, input=given, stream=show, max_new_tokens=PROMPT_TOKENS, raw=self._raw)",
           "                prompt, stream=show, max_new_tokens=PROMPT_TOKENS, raw=self._raw)",
           (T + "ui/test_panel.py::test_a_prompt_tried_in_the_panel_streams_its_reply_there_during_a_run",)),
    Mutant("missing check", "a session without rows draws its bar before it says so",
           "nbtune/run/runner.py", "        self.trainer.data.check_rows()\n", "",
           (T + "ui/test_panel.py::test_a_session_without_rows_says_so_before_a_bar_is_drawn",)),
    # ---- data where it lives, trackers, lm-eval (issue 57)
    Mutant("dropped argument", "a column mapping is ignored: the data's own names are read",
           "nbtune/data/sources.py", "    if not columns:\n        return row\n", "    return row\n",
           (T + "test_sources.py::test_parquet_csv_and_json_list_give_the_jsonl_rows",)),
    Mutant("off by one", "raw text's pieces skip a token between them",
           "nbtune/data/batches.py", "for start in range(0, len(ids) - 1, seq_len)]",
           "for start in range(0, len(ids) - 1, seq_len + 1)]",
           (T + "test_sources.py::test_raw_text_trains_every_token_once_in_seq_len_pieces",)),
    Mutant("wrong mapping", "ShareGPT's gpt turns are read as the user's",
           "nbtune/data/rows.py", '"gpt": "assistant", "assistant": "assistant"', '"gpt": "user", "assistant": "assistant"',
           (T + "test_sources.py::test_sharegpt_conversations_are_chat_rows",)),
    Mutant("missing check", "a Parquet file whose repeated values unpack past the budget is read whole",
           "nbtune/data/sources.py", "                    if read > cap:", "                    if False:",
           (T + "test_sources.py::test_parquet_and_csv_are_bounded_before_rows_are_read",)),
    Mutant("off by one", "a toggle changed mid-run is logged at the step before it applied",
           "nbtune/trackers.py", "event.techniques.as_dict()), self.last_step + 1)",
           "event.techniques.as_dict()), self.last_step)",
           (T + "test_trackers.py::test_every_tracker_holds_every_step_the_config_a_change_and_the_estimate",)),
    Mutant("wrong value", "the trackers get the every-step figure as the step's peak",
           "nbtune/trackers.py", '           "memory/peak_bytes": memory.peak}',
           '           "memory/peak_bytes": report.usage.peak if report.usage else memory.peak}',
           (T + "test_trackers.py::test_every_tracker_holds_every_step_the_config_a_change_and_the_estimate",)),
    Mutant("off by one", "lm-eval's continuation is scored one position late",
           "nbtune/benchmark.py", "at = torch.arange(len(seq) - n, len(seq), device=self.device_)",
           "at = torch.arange(len(seq) - n + 1, len(seq) + 1, device=self.device_)",
           (T + "test_benchmark.py::test_loglikelihoods_equal_nbtunes_own_scoring_with_the_adapters_on",)),
    Mutant("missing step", "a context's trailing whitespace stays in the context for lm-eval",
           "nbtune/benchmark.py", "        if spaces:\n            context, continuation = context[:-spaces], context[-spaces:] + continuation\n",
           "",
           (T + "test_benchmark.py::test_loglikelihoods_equal_nbtunes_own_scoring_with_the_adapters_on",)),
]


# ---- running --------------------------------------------------------------------------------

GUARD_STATUS = 99  # the guard's exit status: not a test failure, the whole run is invalid
GUARD = """\
import os, sys
GUARD_STATUS = @STATUS@
root = os.path.realpath(os.environ["NBTUNE_MUTATION_ROOT"])
import nbtune
where = os.path.realpath(nbtune.__file__)
if not where.startswith(root + os.sep):
    print(f"mutation guard: nbtune was imported from {where}, not from the copy {root}",
          file=sys.stderr)
    sys.exit(GUARD_STATUS)
import pytest
sys.exit(pytest.main(sys.argv[1:]))
""".replace("@STATUS@", str(GUARD_STATUS))


def check_mutants(root: Path, mutants: list[Mutant]) -> None:
    """Every mutant's old text occurs exactly once in its file (loudly, all problems at once)."""
    problems = []
    for number, m in enumerate(mutants, 1):
        path = root / m.file
        if not m.file.startswith("nbtune/"):
            problems.append(f"mutant {number} ({m.bug}): {m.file} is not under nbtune/")
            continue
        if not path.is_file():
            problems.append(f"mutant {number} ({m.bug}): {m.file} does not exist")
            continue
        count = path.read_text().count(m.old)
        if count != 1:
            problems.append(f"mutant {number} ({m.bug}): its old text occurs {count} times in "
                            f"{m.file} (must be exactly once):\n    {m.old!r}")
        if m.old == m.new:
            problems.append(f"mutant {number} ({m.bug}): old and new text are the same")
        for test in m.tests:
            if not (root / test.split("::")[0]).is_file():
                problems.append(f"mutant {number} ({m.bug}): no test file {test.split('::')[0]}")
    if problems:
        sys.exit("Mutants that no longer fit the code (update them):\n" + "\n".join(problems))


def copy_checkout(target: Path) -> Path:
    """The checkout's tracked and untracked (not ignored) files, copied to ``target``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # deleted but still tracked files are skipped
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def run_pytest(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int | str, str, float]:
    """(exit status or "timeout", the output, seconds) of pytest on ``tests`` in ``copy``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               NBTUNE_MUTATION_ROOT=str(copy), PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-c", GUARD, "-n", "0", "-x", "-q", "-p", "no:cacheprovider", *tests]  # (-n 0: in the guarded process)
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return "timeout", out, time.perf_counter() - started
    if done.returncode == GUARD_STATUS:
        print(done.stderr[-2000:], file=sys.stderr)
        os._exit(GUARD_STATUS)  # nothing measured here would be about the copy: stop everything
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - started


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0]
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", action="append", default=[],
                        help="run only mutant N (1-based, as --list numbers them); repeat or "
                             "give a comma-separated list")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at once (a copy each)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unmutated run of the tests (not recommended)")
    args = parser.parse_args()

    numbered = list(enumerate(MUTANTS, 1))
    if args.list:
        for number, m in numbered:
            print(f"{number:3d}  {m.kind:22s} {m.file:26s} {m.bug}")
        return 0
    check_mutants(ROOT, MUTANTS)
    if args.only:
        wanted = {int(x) for item in args.only for x in item.split(",") if x.strip()}
        unknown = sorted(wanted - {n for n, _ in numbered})
        if unknown:
            sys.exit(f"--only: no mutant {unknown} (there are {len(MUTANTS)}; see --list)")
        numbered = [(n, m) for n, m in numbered if n in wanted]

    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="nbtune-mutation-"))
    try:
        copies: queue.Queue[Path] = queue.Queue()
        for i in range(max(1, args.jobs)):
            copies.put(copy_checkout(workdir / f"copy{i}"))
        print(f"{len(numbered)} mutants, {args.jobs} at a time, copies in {workdir}", flush=True)

        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for _, m in numbered for t in m.tests))
            copy = copies.get()
            status, output, seconds = run_pytest(copy, tests, args.timeout * 2)
            copies.put(copy)
            if status != 0:
                print(output[-4000:])
                sys.exit(f"Baseline: the mutants' tests fail on the unmutated code (status "
                         f"{status}); fix them first, or every mutant would look caught.")
            print(f"baseline: {len(tests)} test selections pass unmutated ({seconds:.0f} s)", flush=True)

        results: dict[int, tuple[str, float, str]] = {}
        lock = threading.Lock()

        def one(number: int, m: Mutant) -> None:
            copy = copies.get()
            path = copy / m.file
            original = path.read_text()
            try:
                path.write_text(original.replace(m.old, m.new, 1))
                status, output, seconds = run_pytest(copy, m.tests, args.timeout)
            finally:
                path.write_text(original)
                copies.put(copy)
            if status == 1:
                verdict, detail = "caught", first_failure(output)
            elif status == "timeout":
                verdict, detail = "caught", f"timeout after {args.timeout:.0f} s"
            elif status == 0:
                verdict, detail = "MISSED", "every test passed"
            else:  # 2-5: interrupted, internal or usage error, nothing collected; guard exit
                verdict, detail = "ERROR", f"pytest status {status}: {output.strip().splitlines()[-1:]}"
            with lock:
                results[number] = (verdict, seconds, detail)
                print(f"[{number:2d}] {verdict:6s} {seconds:6.1f} s  {m.file}: {m.bug}"
                      f"{'  <- ' + detail if detail else ''}", flush=True)

        threads: list[threading.Thread] = []
        pending = list(numbered)
        while pending or threads:
            while pending and len(threads) < max(1, args.jobs):
                thread = threading.Thread(target=one, args=pending.pop(0))
                thread.start()
                threads.append(thread)
            threads[0].join()
            threads = [t for t in threads if t.is_alive()]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    caught = sum(v == "caught" for v, _, _ in results.values())
    missed = [n for n, (v, _, _) in sorted(results.items()) if v == "MISSED"]
    errors = [n for n, (v, _, _) in sorted(results.items()) if v == "ERROR"]
    wall = time.perf_counter() - started
    print(f"\nscore: {caught}/{len(results)} mutants caught ({100 * caught / max(len(results), 1):.0f}%)"
          f" in {wall / 60:.1f} min" + (f"; missed: {missed}" if missed else "")
          + (f"; errors: {errors}" if errors else ""))
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
