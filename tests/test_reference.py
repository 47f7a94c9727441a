"""The KL anchor (rl.reference) with the real learner, for every learner.loss.kl mode: a
frozen copy of the starting parameters that the donating train step never touches,
reference log-probs through the logprob kernel equal to a full softmax's, KL 0 at the
first update and > 0 once the policy moved, and a save / load round trip."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.qwen3 import Qwen3, Qwen3Config
from rl import learner
from rl.batch import pack_arrays
from rl.loss import KL_KINDS
from rl.reference import Reference
from tests.owners import learner_config

TINY = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                   num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=10_000.0,
                   max_position_embeddings=128)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(6):
        n = int(rng.integers(8, 30))
        mask = (rng.random(n) < 0.6).astype(np.int32)
        mask[:3] = 0
        logp = np.where(mask, -rng.uniform(2.0, 6.0, n), 0.0).astype(np.float32)
        seqs.append((rng.integers(0, TINY.vocab_size, n).astype(np.int32), mask, logp))
    return pack_arrays(seqs, rng.normal(0, 1, len(seqs)), buckets=[32])[0]


def test_reference_anchors_every_kl_mode(tmp_path):
    batch = _batch()
    compute_logprobs = None  # one jitted scorer for all modes (the loss does not enter it)
    for kl in [k for k in KL_KINDS if k != "none"]:
        cfg = learner_config(optim={"lr": 1e-2}, loss=dict(kl=kl, kl_coef=0.1),
                             temperature=0.7)
        graphdef, state = learner.init_train_state(Qwen3(TINY, rngs=nnx.Rngs(0)), cfg)
        start = jax.device_get(state.params)
        compute_logprobs = compute_logprobs or learner.make_compute_logprobs(graphdef, cfg)
        reference = Reference(state.params, kl, compute_logprobs)
        train_step = learner.make_train_step(graphdef, cfg)
        first, ref_params = reference.train_inputs(batch)
        assert (ref_params is None) == (kl != "exact"), kl
        if kl == "k3":  # the reference's log-probs of the batch's tokens, as a full softmax
            model = nnx.merge(graphdef, reference.params)
            hidden = model(batch.tokens, batch.positions, batch.segment_ids)
            logp = jax.nn.log_softmax(hidden[:, :-1] @ model.lm_head() / cfg.temperature, -1)
            want = jnp.take_along_axis(logp, batch.tokens[:, 1:, None], -1)[..., 0]
            mask = batch.loss_mask[:, 1:] > 0
            np.testing.assert_allclose(np.asarray(first.ref_logprobs)[:, 1:][mask],
                                       np.asarray(want)[mask], rtol=1e-5, atol=1e-5)
        state, m1 = train_step(state, first, ref_params)
        second, ref_params = reference.train_inputs(batch)
        state, m2 = train_step(state, second, ref_params)
        m1, m2 = float(m1["kl_ref"]), float(m2["kl_ref"])
        assert abs(m1) < 1e-5, (kl, m1)                   # the policy starts at the reference
        assert np.isfinite(m2) and abs(m2) > 1e-4, (kl, m2)  # ...and has moved away from it
        for a, b in zip(jax.tree.leaves(start),
                        jax.tree.leaves(jax.device_get(reference.params)), strict=True):
            np.testing.assert_array_equal(a, b)           # frozen through two donating steps
    reference.save(str(tmp_path / "reference"))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), state.params)
    loaded = Reference.load_params(str(tmp_path / "reference"), abstract)
    for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(jax.device_get(loaded)),
                    strict=True):
        np.testing.assert_array_equal(a, b)
