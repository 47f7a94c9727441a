"""Memory-lean kernels for the learner: token log-probs and KL without [N, V] logits."""
