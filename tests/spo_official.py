"""A plain-Python port of the SPO tracker logic of the official trainer
(verl-recipe, recipe/spo/spo_ray_trainer.py: the offline values, `fit`'s per-step
advantage and alpha/beta update, `_get_spo_rho`), written from reading it, for
differential tests of rl.tracker and rl.algos.spo.

What it keeps of the official data flow, step by step:
- prompts start from offline values: with offline_N = 0 at Beta(0.5, 0.5), else
  alpha = N_init (s + 0.5) / (offline_N + 1), beta = N_init (offline_N - s + 0.5) /
  (offline_N + 1), N_init = 1 / (1 - clip_lower); a prompt without offline values has
  sampling weight 0 (never drawn);
- alpha, beta and p_hat of every sample are read before the step (duplicates see the
  same pre-step value); advantage r - p_hat, normalised by the mean and torch's
  unbiased std + 1e-8;
- after the actor update: each sample's past response (the prompt's stored one, or its
  own if the prompt has none) is scored by the updated actor; old log-probs are the
  stored ones (or those fresh scores), D = masked_mean(|old - cur|, response mask) with
  verl's masked_mean (sum / (mask sum + masked_mean_eps), 1e-8 there);
  rho = clamp(2^(-D / 0.06), clip_lower, 0.96); this step's responses are scored by
  the updated actor and stored, the last sample of a prompt winning;
- alpha <- rho alpha + r, beta <- rho beta + (1 - r) per sample from the pre-step
  values, written in batch order (the last write wins).
The official code holds alpha and beta in float32 tensors between reading and writing
(`torch.tensor(..., dtype=torch.float)`); the port keeps float64 throughout, since the
tests compare the logic, not torch's rounding.
"""

from __future__ import annotations

import math


class OfficialSPO:
    def __init__(self, offline_scores: dict[str, list[int]], offline_n: int,
                 clip_lower: float = 0.875, masked_mean_eps: float = 1e-8):
        self.clip_lower, self.masked_mean_eps = clip_lower, masked_mean_eps
        if offline_n == 0:
            self.alpha = {k: 0.5 for k in offline_scores}
            self.beta = {k: 0.5 for k in offline_scores}
        else:
            n_init = 1 / (1 - clip_lower)
            self.alpha = {k: n_init * (sum(v) + 0.5) / (offline_n + 1)
                          for k, v in offline_scores.items()}
            self.beta = {k: n_init * (offline_n - sum(v) + 0.5) / (offline_n + 1)
                         for k, v in offline_scores.items()}
        self.stored_response: dict[str, tuple[list[int], list[int]]] = {}
        self.stored_logp: dict[str, list[float]] = {}

    def weight(self, prompt: str) -> float:
        if prompt not in self.alpha:
            return 0.0
        p = self.alpha[prompt] / (self.alpha[prompt] + self.beta[prompt])
        return math.sqrt(p * (1 - p)) + 0.05

    def advantages(self, prompts: list[str], rewards: list[float]) -> list[float]:
        p_hat = [self.alpha[p] / (self.alpha[p] + self.beta[p]) for p in prompts]
        adv = [r - v for r, v in zip(rewards, p_hat, strict=True)]
        mean = sum(adv) / len(adv)
        std = math.sqrt(sum((a - mean) ** 2 for a in adv) / (len(adv) - 1))
        return [(a - mean) / (std + 1e-8) for a in adv]

    def after_update(self, prompts, rewards, responses, score) -> tuple[list[float], list[float]]:
        """responses[i] = (ids, mask) of sample i; score(ids, mask) -> log-probs under the
        updated actor. Returns (D, rho) per sample."""
        alpha = [self.alpha[p] for p in prompts]
        beta = [self.beta[p] for p in prompts]
        past = [self.stored_response.get(p, responses[i]) for i, p in enumerate(prompts)]
        cur = [score(*x) for x in past]
        old = [self.stored_logp.get(p, cur[i]) for i, p in enumerate(prompts)]
        D = []
        for o, c, (_, mask) in zip(old, cur, past, strict=True):
            num = sum(abs(a - b) * m for a, b, m in zip(o, c, mask, strict=True))
            D.append(num / (sum(mask) + self.masked_mean_eps))
        rho = [min(max(2.0 ** (-d / 0.06), self.clip_lower), 0.96) for d in D]
        new = [score(*x) for x in responses]
        for i, p in enumerate(prompts):
            self.stored_response[p] = responses[i]
            self.stored_logp[p] = new[i]
        for i, p in enumerate(prompts):
            self.alpha[p] = rho[i] * alpha[i] + rewards[i]
            self.beta[p] = rho[i] * beta[i] + (1 - rewards[i])
        return D, rho
