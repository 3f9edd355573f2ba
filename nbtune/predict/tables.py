"""The data prediction reads: each card's memory, the host memory rentals come with, what the
CUDA context and allocator keep back, and what each technique costs in speed, every figure
with its source. Logic lives in budgets.py and costs.py; change a number here, not there."""

MiB, GiB = 2**20, 2**30

# Memory of each card as the driver reports it (nvidia-smi's total, which is also
# torch.cuda.get_device_properties().total_memory), not the number on the box: ECC takes
# about 1/16 on T4 and L4 (on by default in clouds). Where drivers differ, the smaller.
CARDS: dict[str, int] = {
    "RTX 3090": 24576 * MiB,  # 24 GiB
    "RTX 4090": 24564 * MiB,  # 24 GiB less 12 MiB the driver keeps
    "A100 40GB": 40536 * MiB,  # newer drivers say 40960 MiB
    "A100 80GB": 81920 * MiB,
    "T4": 15360 * MiB,  # 16 GiB, 15 with ECC
    "L4": 23034 * MiB,  # 24 GiB, 22.5 with ECC
}
"""Each card's memory in bytes, as the driver reports it: the names ``fit`` and the budgets take."""

# Host memory the machines renting each card usually come with: a starting guess for the host
# check of ``fit`` and the panel's badge (say yours with ``host=`` or "RTX 3090 + 64 GB RAM").
HOST_RAM: dict[str, int] = {
    "RTX 3090": 32 * GiB,  # rough: common on RunPod / vast.ai listings (32 GB and up)
    "RTX 4090": 32 * GiB,  # rough: as for the 3090
    "A100 40GB": 79 * GiB,  # Google Cloud a2-highgpu-1g: 85 GB
    "A100 80GB": 158 * GiB,  # Google Cloud a2-ultragpu-1g: 170 GB
    "T4": 12 * GiB,  # Google Colab's free T4: 12.7 GB
    "L4": 15 * GiB,  # Google Cloud g2-standard-4: 16 GB
}
"""The host memory, in bytes, that machines renting each card usually come with: ``fit``'s
and the badge's guess where no ``host=`` is given."""

# Not all of a card holds tensors. The CUDA context (driver state, the module images of
# torch's kernels) takes about 0.3-0.5 GiB before the first tensor (rough; measured 1.0 GiB
# on an H200 with torch 2.11 and CUDA 13, benchmarks/results/gpu/NVIDIA-H200-rerun.json) and
# is outside what the estimate predicts: ``usable`` takes off 512 MiB for it. The
# caching allocator then holds more than the live tensors (rounding to blocks,
# fragmentation); the estimate predicts live tensors only, so a further share is kept
# free (rough: reserved is typically a few percent above the peak of live tensors).
CUDA_CONTEXT = 512 * MiB
ALLOCATOR_MARGIN = 0.05

# cuBLAS workspaces, inside torch's allocator for the life of the process: one for each thread
# that runs matrix products, the caller's and autograd's (backward runs on a thread of its
# own), which a fake step never allocates. Their size is torch's rule (CublasHandlePool.cpp):
# CUBLAS_WORKSPACE_CONFIG's ":KiB:count" pairs, else 32 MiB from compute capability 9.0 on and
# 8 MiB + 128 KiB before (a 3090 is 8.6). Measured on an H200 with torch 2.11
# (benchmarks/results/gpu/NVIDIA-H200-rerun.json): the first bf16 product of a fresh process
# left 32 MiB allocated, and six SmolLM2 steps and two 8B ones each held 65.2 MiB more than
# the fake step. Without a GPU to ask, the estimate takes the larger size.
CUBLAS_THREADS = 2
CUBLAS_WORKSPACE = {"9.0 and later": 32 * MiB, "before 9.0": 8 * MiB + 128 * 1024}

# What each technique costs in speed, as a fraction of a plain step (one micro-batch,
# nothing recomputed or moved), with where the number comes from. "measured" values are
# the torchtune README's rows quoted in DESIGN.md (Llama 3.2 3B, A100, each row adding one
# flag: packed 7075 tokens/s, +compile 8998, +chunked CE 9174, +checkpointing 7210,
# +optimizer in backward 7309, +activation offloading 7301, +8-bit AdamW 6960; LoRA 8210;
# Llama 3.1 8B on a 4090: LoRA 3083, QLoRA 2413). "rough" values are reasoned, not measured.
COSTS: dict[str, tuple[float, str]] = {
    "checkpointing": (0.27, "measured +27% with every layer (9174 -> 7210 tokens/s); forward is about "
                            "1/3 of forward+backward, and the CPU peers' FLOP count gives +25%; scaled "
                            "by the fraction of layers checkpointed"),
    "offload_checkpointed": (0.01, "measured ~0.1% on top of checkpointing (7309 -> 7301): only layer "
                                   "inputs move, on a side stream"),
    "offload_saved": (0.30, "rough: without checkpointing every saved activation crosses PCIe and back, "
                            "more than compute can hide (DESIGN.md: pays off with checkpointing on)"),
    "cpu_offload_full": (0.50, "rough: every gradient to the CPU and every weight back each step, and "
                               "AdamW on CPU cores"),
    "cpu_offload_adapters": (0.03, "rough: LoRA adapters are about 1% of the weights, little to move"),
    "chunked_loss": (0.01, "measured 2% faster compiled (8998 -> 9174); eager it adds a few launches: "
                           "nearly free where each chunk makes its gradients in forward; where that "
                           "would raise the peak each chunk's head runs again in backward "
                           "(7-9 % of a 125M step on a CPU, benchmarks/head_profile.py), not "
                           "counted here"),
    "tiling": (0.1, "rough: each tile's norm + MLP runs its forward once more in backward; the MLP is "
                    "about 2/3 of a layer's forward at short sequences and less as attention grows "
                    "with the sequence (measured by benchmarks/long_context.py)"),
    "optimizer_in_backward": (0.0, "measured 1% faster (7210 -> 7309): the same updates, made earlier"),
    "optimizer_8bit": (0.05, "measured +5% (7301 -> 6960 with 8-bit AdamW)"),
    "optimizer_4bit": (0.07, "rough: as 8-bit, with more unpacking"),
    "paged_optimizer": (0.02, "rough: free until memory runs short, then pages cross PCIe"),
    "micro_batch": (256.0, "rough: each micro-batch pays fixed work worth this many tokens "
                           "(launches, small matmuls under-using the GPU): micro-batches of T tokens "
                           "in an effective batch of E add 256/T - 256/E"),
    "fsdp_cpu_offload": (0.30, "rough: FSDP2 CPU offload brings every layer's shard to the card in "
                               "forward and again in backward and steps the optimizer on CPU cores: "
                               "PCIe traffic a step of the frozen weights (NF4 under QLoRA) twice"),
    "fsdp_reshard": (0.05, "rough: resharding after forward gathers each layer's weights again in "
                           "backward, a second all-gather that overlaps compute only in part"),
    "fsdp_shard_embeddings": (0.01, "rough: two more units to gather, the embedding and the head"),
    "compile": (-0.21, "measured 21% less time per step (7075 -> 8998); the first step compiles"),
}

# Factors of the maths-changing choices, for ranking fallbacks against the start.
METHOD_FACTOR = {"full": 1.0, "lora": 0.85, "qlora": 0.85 * 1.28}
METHOD_WHY = ("LoRA: measured 0.85 of full's step time (6960 vs 8210 tokens/s, 3B; base weights get "
              "no gradients); QLoRA: measured 1.28 of LoRA's (3083 vs 2413, 8B on a 4090; NF4 is "
              "dequantized at every matmul)")
BF16_FACTOR_CUDA = 0.5
BF16_WHY = ("rough: bf16 matmuls run on tensor cores at several times fp32's rate; on CPU not "
            "modelled (1.0): from 250x slower (AVX2 only) to faster (AMX), see DESIGN.md")

