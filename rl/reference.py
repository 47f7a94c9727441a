"""The KL anchor: a frozen copy of the policy the RL run starts from (the SFT warm start,
or the loaded base checkpoint), sharded like the policy.

`learner.loss.kl` picks how the learner uses it: the estimators k1 / k2 / k3 / k3plus
read the reference's log-probs of the batch's tokens (computed here through the
logprob kernel), "exact" passes its parameters to the train step (kernels/kl). The
copy is saved once in the workdir, so a resumed run anchors to the same policy.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from rl import learner
from rl.batch import Batch

log = logging.getLogger(__name__)


class Reference:
    """Frozen reference parameters and how the train step receives them."""

    def __init__(self, params, kl: str, compute_logprobs, mesh: Mesh | None = None):
        if kl == "none":
            raise ValueError("a reference policy is for learner.loss.kl != 'none'")
        # A copy: train_step donates (and overwrites) the policy's own buffers.
        self.params = jax.tree.map(jnp.copy, params)
        self.kl, self.compute_logprobs, self.mesh = kl, compute_logprobs, mesh

    def train_inputs(self, batch: Batch):
        """(batch, ref_params) for train_step: reference log-probs in the batch for the
        estimators, the parameters themselves for the exact KL."""
        if self.kl == "exact":
            return batch, self.params
        return learner.with_ref_logprobs(batch, self.compute_logprobs, self.params,
                                         self.mesh), None

    def save(self, directory: str) -> None:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(os.path.abspath(directory), self.params, force=True)
        checkpointer.wait_until_finished()

    @staticmethod
    def load_params(directory: str, abstract_params):
        """Parameters saved by save(), laid out like `abstract_params` (ShapeDtypeStructs
        with shardings)."""
        return ocp.StandardCheckpointer().restore(os.path.abspath(directory), abstract_params)
