"""Prefix Sampling, seed 000 recipe for Qwen3-32B: adaptive prefix length.

As configs/ps_qwen3_14b_swe.py with Qwen3-32B and the adaptive controller: an EMA
(alpha 0.05) of each kind's prefix-task pass rate moves its ratio by 0.05 when it
leaves [0.47, 0.53], with a 5-step cooldown; 100 RL steps (the seed's 32B run goes
to step ~410: raise `total_steps` to match).

    python train.py --config configs/ps_qwen3_32b_swe.py:model_path=/models/Qwen3-32B \\
        --workdir /ckpt/ps_32b
"""

from configs import grpo_swe

OPTIONS = {**grpo_swe.OPTIONS, "model": "qwen3-32b", "model_path": "/models/Qwen3-32B",
           "tp": 4, "servers": 1}


def get_config(arg=None):
    c = grpo_swe.get_config(arg, OPTIONS)
    c.total_steps = 100
    c.ps.enabled = True
    c.ps.adaptive = True
    c.ps.ema_alpha, c.ps.cooldown, c.ps.step_size = 0.05, 5, 0.05
    return c
