"""SPO, seed 002 recipe: one response per prompt, Beta-tracker baseline, no group.

Qwen3-8B, 8 tool turns, clip 0.2 / 0.28, lr 1e-6, no KL; the tracker discounts
old evidence by rho = clip(2^(-D/0.06), 0.875, 0.96) where D is the policy drift on
the prompt's last response; prompts are drawn with weight sqrt(v(1-v)) + 0.05 and
collected as a single stream (first B finished are trained, the rest carry over).

    python train.py --config configs/spo_qwen3_8b.py:model_path=/models/Qwen3-8B \\
        --workdir /ckpt/spo_8b
"""

from configs import grpo_swe

OPTIONS = {**grpo_swe.OPTIONS, "model": "qwen3-8b", "model_path": "/models/Qwen3-8B",
           "tp": 1, "servers": 4}


def get_config(arg=None):
    c = grpo_swe.get_config(arg, OPTIONS)
    c.algo = "spo"
    c.group_size = 1
    c.batch_tasks = 256
    c.spo.in_flight = 384
    c.spo.init_samples = 8
    c.rollout.max_steps = 8
    c.rollout.max_context = 32768
    c.rollout.max_response_tokens = 16384
    c.engine.max_len = 32768
    c.learner.row_buckets = (8192, 16384, 32768)
    c.learner.loss.agg = "token-mean"
    c.learner.loss.eps_low, c.learner.loss.eps_high = 0.2, 0.28
    c.learner.optim.lr = 1e-6
    c.learner.loss.kl = "none"
    return c
