"""What a run trains the model for: next-token cross-entropy (``sft``, in ``loss.py``) or a
preference between two completions (``preference``); GRPO next (issue 55)."""
