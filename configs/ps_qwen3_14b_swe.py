"""Prefix Sampling, seed 000 recipe for Qwen3-14B: fixed ratios.

The GRPO baseline (configs/grpo_swe.py: 64 tasks x 8 rollouts, at most 50 steps)
plus Prefix Sampling: thresholds 0.3 / 0.7, remaining_ratio = prefix_ratio = 0.25,
queued prefix tasks up to half the batch, run in the step after their source.

    python train.py --config configs/ps_qwen3_14b_swe.py:model_path=/models/Qwen3-14B \\
        --workdir /ckpt/ps_14b
"""

from configs import grpo_swe

OPTIONS = grpo_swe.OPTIONS


def get_config(arg=None):
    c = grpo_swe.get_config(arg, OPTIONS)
    c.ps.enabled = True
    c.ps.low, c.ps.high = 0.3, 0.7
    c.ps.remaining_ratio, c.ps.prefix_ratio = 0.25, 0.25
    c.ps.adaptive = False
    return c
