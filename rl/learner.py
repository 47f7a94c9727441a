"""The learner: train state, optimizer, one jitted train step, log-prob evaluation.

One `train_step(state, batch)` call is one RL iteration over a packed batch: its
rows are split into `num_minibatches` mini-batches (one optimizer update each),
each split into `num_microbatches` micro-batches whose gradients are accumulated
in a `lax.scan`. Row i belongs to micro-batch i % (M*K) and mini-batch
(i % (M*K)) // K: the packer emits rows longest-first, so striding balances the
mini-batches, and every device keeps its own rows (no resharding).

Log-probs are `log_softmax(logits / temperature)` of each token given the earlier
tokens of its segment, computed from the model's hidden states by
kernels.logprob.token_logprobs without materialising [N, V] logits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kernels.kl import api as kl_api
from kernels.logprob.api import token_logprobs
from models import sharding
from rl import loss as losses
from rl.batch import Batch, pack_arrays, unpack


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The `learner.optim` section, one field per key (configs.common.learner_defaults
    documents each)."""

    lr: float
    warmup_steps: int
    schedule: str
    decay_steps: int
    end_lr_frac: float
    b1: float
    b2: float
    eps: float
    weight_decay: float
    max_grad_norm: float


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """The `learner` section, one field per key (configs.common.learner_defaults documents
    each); `optim` and `loss` are its subsections' owners."""

    num_minibatches: int
    num_microbatches: int
    rows_multiple: int
    temperature: float
    logprob_impl: str | None
    seed: int
    row_buckets: tuple[int, ...]
    optim: OptimConfig
    loss: losses.LossConfig

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> LearnerConfig:
        """The owner of a `learner` section and its two subsections."""
        return cls(**{**section, "row_buckets": tuple(section["row_buckets"]),
                      "optim": OptimConfig(**section["optim"]),
                      "loss": losses.LossConfig(**section["loss"])})


@flax.struct.dataclass
class TrainState:
    """params: pure dict of parameter arrays (nnx.merge(graphdef, params) is the model);
    opt_state: optax state; step: int32 train_step calls so far."""

    params: Any
    opt_state: Any
    step: jax.Array


# --------------------------------------------------------------------------- optimizer


def make_schedule(optim: OptimConfig) -> optax.Schedule:
    """Learning rate per optimizer update: linear warmup 0 -> lr, then constant or cosine."""
    if optim.schedule == "constant":
        main = optax.constant_schedule(optim.lr)
    elif optim.schedule == "cosine":
        if optim.decay_steps <= 0:
            raise ValueError("optim.decay_steps must be > 0 for the cosine schedule")
        main = optax.cosine_decay_schedule(optim.lr, optim.decay_steps, alpha=optim.end_lr_frac)
    else:
        raise ValueError(f"optim.schedule must be 'constant' or 'cosine', got {optim.schedule!r}")
    if not optim.warmup_steps:
        return main
    warmup = optax.linear_schedule(0.0, optim.lr, optim.warmup_steps)
    return optax.join_schedules([warmup, main], [optim.warmup_steps])


def make_optimizer(cfg: LearnerConfig) -> optax.GradientTransformation:
    """AdamW on the schedule, after global-norm gradient clipping."""
    optim = cfg.optim
    adamw = optax.adamw(make_schedule(optim), b1=optim.b1, b2=optim.b2, eps=optim.eps,
                        weight_decay=optim.weight_decay)
    if not optim.max_grad_norm:
        return adamw
    return optax.chain(optax.clip_by_global_norm(optim.max_grad_norm), adamw)


# --------------------------------------------------------------------------- state


def _init_state(params, optimizer) -> TrainState:
    return TrainState(params=params, opt_state=optimizer.init(params),
                      step=jnp.zeros((), jnp.int32))


def state_shardings(abstract_state: TrainState, cfg: LearnerConfig, mesh: Mesh) -> TrainState:
    """NamedShardings of a TrainState: parameters and their optimizer moments per
    models.sharding rules, everything else replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    params = sharding.param_shardings(abstract_state.params, mesh)
    opt_state = optax.tree_map_params(
        make_optimizer(cfg), lambda _, s: s, abstract_state.opt_state, params,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding))
    return TrainState(params=params, opt_state=opt_state, step=replicated)


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, pure dict of parameters) of an NNX model (concrete or abstract)."""
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(params)


def abstract_train_state(model: nnx.Module, cfg: LearnerConfig, mesh: Mesh | None = None):
    """(graphdef, TrainState of jax.ShapeDtypeStruct with shardings); `model` may be
    abstract (nnx.eval_shape), so nothing is allocated. For Checkpointer.restore."""
    graphdef, params = split_params(model)
    optimizer = make_optimizer(cfg)
    shapes = jax.eval_shape(lambda p: _init_state(p, optimizer), params)
    if mesh is None:
        return graphdef, shapes
    shardings = state_shardings(shapes, cfg, mesh)
    return graphdef, jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def init_train_state(model: nnx.Module, cfg: LearnerConfig, mesh: Mesh | None = None):
    """(graphdef, TrainState) with the model's parameters, sharded over `mesh` if given."""
    graphdef, params = split_params(model)
    optimizer = make_optimizer(cfg)
    init = functools.partial(_init_state, optimizer=optimizer)
    if mesh is None:
        return graphdef, jax.jit(init)(params)
    shardings = state_shardings(jax.eval_shape(init, params), cfg, mesh)
    params = jax.device_put(params, shardings.params)
    return graphdef, jax.jit(init, out_shardings=shardings)(params)


# --------------------------------------------------------------------------- batches


def row_multiple(cfg: LearnerConfig, mesh: Mesh | None = None) -> int:
    """Rows of a packed batch are a multiple of this: of mini x micro x data shards
    (required) and of cfg.rows_multiple (fewer batch shapes to compile)."""
    shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    return math.lcm(cfg.num_minibatches * cfg.num_microbatches * shards,
                    cfg.rows_multiple)


def check_rows(batch: Batch, cfg: LearnerConfig, mesh: Mesh | None = None) -> None:
    """Raises ValueError unless the batch's rows split evenly into micro-batches and shards."""
    multiple = row_multiple(cfg, mesh)
    if batch.tokens.shape[0] % multiple:
        raise ValueError(
            f"batch has {batch.tokens.shape[0]} rows, not a multiple of {multiple} "
            f"(mini-batches {cfg.num_minibatches} x micro-batches {cfg.num_microbatches} x "
            "data-parallel shards, and rows_multiple); pack with "
            "row_multiple=rl.learner.row_multiple(cfg, mesh)")


def shard_batch(batch: Batch, mesh: Mesh | None = None) -> Batch:
    """Host batch -> device arrays, rows split over data x fsdp."""
    if mesh is None:
        return jax.device_put(batch)
    return jax.device_put(batch, sharding.data_sharding(mesh))


def split_batch(batch: Batch, num_chunks: int, mesh: Mesh | None) -> Batch:
    """[R, L] arrays -> [num_chunks, R / num_chunks, L]; chunk c holds rows i with
    i % num_chunks == c, which keeps each device's rows on that device."""
    rows = batch.tokens.shape[0]

    def split(x):
        x = jnp.swapaxes(x.reshape(rows // num_chunks, num_chunks, *x.shape[1:]), 0, 1)
        if mesh is not None:
            spec = PartitionSpec(None, ("data", "fsdp"), *([None] * (x.ndim - 2)))
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
        return x

    return jax.tree.map(split, batch)


# --------------------------------------------------------------------------- forward


def policy_logprobs(graphdef, params, batch: Batch, cfg):
    """(logp, entropy, hidden): [r, L] log-probs of each token given its segment's
    earlier tokens and the tempered entropy there (0 where loss_mask is 0 and at
    column 0), and the final hidden states [r, L, d]."""
    model = nnx.merge(graphdef, params)
    hidden = model(batch.tokens, batch.positions, batch.segment_ids)
    # Per row (vmapped), so rows split over devices stay split.
    logp, entropy = token_logprobs(
        hidden[:, :-1], model.lm_head(), batch.tokens[:, 1:], batch.loss_mask[:, 1:],
        temperature=cfg.temperature, implementation=cfg.logprob_impl)
    pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
    return pad(logp), pad(entropy), hidden


def exact_kl_tokens(graphdef, params, ref_params, hidden, batch: Batch, cfg):
    """[r, L] KL(policy || reference) over the full vocabulary at each loss token
    (0 elsewhere); hidden: the policy's [r, L, d]. The reference is a constant."""
    ref_model = nnx.merge(graphdef, jax.lax.stop_gradient(ref_params))
    ref_hidden = ref_model(batch.tokens, batch.positions, batch.segment_ids)
    rows, length, dim = hidden.shape
    kl = kl_api.exact_kl(
        hidden[:, :-1].reshape(-1, dim), nnx.merge(graphdef, params).lm_head(),
        ref_hidden[:, :-1].reshape(rows * (length - 1), -1), ref_model.lm_head(),
        batch.loss_mask[:, 1:].reshape(-1), temperature=cfg.temperature)
    return jnp.pad(kl.reshape(rows, length - 1), ((0, 0), (1, 0)))


def mesh_context(mesh: Mesh | None):
    """`jax.set_mesh(mesh)` (the model keeps activations split by rows under it), or
    nothing without a mesh."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def make_compute_logprobs(graphdef, cfg: LearnerConfig, mesh: Mesh | None = None):
    """Jitted `compute_logprobs(params, batch) -> logp [R, L]` (no gradient), evaluated
    in mini x micro-batch chunks like the train step. For reference and learner-side
    old log-probs."""
    num_chunks = cfg.num_minibatches * cfg.num_microbatches

    @jax.jit
    def compute_logprobs(params, batch: Batch):
        chunks = split_batch(batch, num_chunks, mesh)
        logp = jax.lax.map(lambda mb: policy_logprobs(graphdef, params, mb, cfg)[0], chunks)
        rows = batch.tokens.shape[0]
        return jnp.swapaxes(logp, 0, 1).reshape(rows, -1)

    def run(params, batch: Batch):
        check_rows(batch, cfg, mesh)
        if isinstance(batch.tokens, np.ndarray):
            batch = shard_batch(batch, mesh)
        with mesh_context(mesh):
            return compute_logprobs(params, batch)

    return run


def make_score(compute_logprobs, *, buckets, row_multiple: int = 1, pad_id: int = 0):
    """`score(params, [(ids[T], mask[T]), ...]) -> [logp[T'], ...]`: each token stream
    scored whole and in its context (positions from 0) by `compute_logprobs`, packed like
    a training batch; logp is 0 where mask is 0, T' = min(T, max(buckets))."""

    def score(params, seqs) -> list[np.ndarray]:
        if not seqs:
            return []
        batch, info = pack_arrays([(ids, mask, np.zeros(len(ids), np.float32))
                                   for ids, mask in seqs], np.zeros(len(seqs)),
                                  buckets=buckets, row_multiple=row_multiple, pad_id=pad_id)
        return unpack(host_array(compute_logprobs(params, batch)), info)

    return score


def host_array(x: jax.Array) -> np.ndarray:
    """A device array as host NumPy; rows on several processes' devices are gathered
    (a collective: every process calls it with its part of the same array)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def with_ref_logprobs(batch: Batch, compute_logprobs, ref_params, mesh: Mesh | None = None
                      ) -> Batch:
    """The batch on the mesh with `ref_logprobs` [R, L]: the reference policy's log-probs
    of its tokens (through the logprob kernel; 0 off the loss mask)."""
    if isinstance(batch.tokens, np.ndarray):
        batch = shard_batch(batch, mesh)
    return batch.replace(ref_logprobs=compute_logprobs(ref_params, batch))


# --------------------------------------------------------------------------- train step


# How each metric combines over a mini-batch's micro-batches, then over the step's
# mini-batches: "sum" metrics add up to the mini-batch value and are averaged over
# mini-batches; "max" and "min" metrics are extremes over both.
METRIC_REDUCTIONS = {**losses.METRIC_REDUCTIONS, "grad_norm": "sum"}
_REDUCE = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}
_START = {"sum": 0.0, "max": -jnp.inf, "min": jnp.inf}


def _reduction(name: str) -> str:
    if name not in METRIC_REDUCTIONS:
        raise KeyError(f"metric {name!r} has no entry in rl.learner.METRIC_REDUCTIONS")
    return METRIC_REDUCTIONS[name]


def _micro_loss(params, micro, ref_params, graphdef, cfg):
    """(loss, metrics) of one micro-batch; micro: (batch, weights, token_weights, old_logp)."""
    mb, weights, token_weights, old_logp = micro
    logp, entropy, hidden = policy_logprobs(graphdef, params, mb, cfg)
    kl_tok = None
    if cfg.loss.kl == "exact":
        kl_tok = exact_kl_tokens(graphdef, params, ref_params, hidden, mb, cfg)
    return losses.policy_loss(cfg.loss, logp, entropy, mb, weights, token_weights,
                              old_logp=old_logp, kl_tok=kl_tok)


def _accumulate(grad_fn, params, micros, ref_params):
    """(gradients summed, metrics reduced) over the micro-batches [K, ...] of one
    mini-batch, one after another in a lax.scan."""
    first = jax.tree.map(lambda x: x[0], micros)
    shapes = jax.eval_shape(lambda: grad_fn(params, first, ref_params)[0][1])
    start = {k: jnp.full((), _START[_reduction(k)], v.dtype) for k, v in shapes.items()}

    def add(acc, micro):
        (_, metrics), grads = grad_fn(params, micro, ref_params)
        acc_grads, acc_metrics = acc
        acc_grads = jax.tree.map(jnp.add, acc_grads, grads)
        acc_metrics = {k: _REDUCE[_reduction(k)](jnp.stack([acc_metrics[k], v]), axis=0)
                       for k, v in metrics.items()}
        return (acc_grads, acc_metrics), None

    (grads, metrics), _ = jax.lax.scan(add, (jax.tree.map(jnp.zeros_like, params), start),
                                       micros)
    return grads, metrics


def _update(carry, xs, ref_params, graphdef, cfg):
    """One mini-batch, one optimizer update: carry (params, opt_state), xs (batch,
    old_logp) of [K, r, L] micro-batches. -> (carry, metrics)."""
    params, opt_state = carry
    mb, old_logp = xs
    weights = losses.AGGREGATIONS[cfg.loss.agg](mb.loss_mask, mb.seq_num_tokens)
    token_weights = losses.token_mean_weights(mb.loss_mask, None)
    grad_fn = jax.value_and_grad(functools.partial(_micro_loss, graphdef=graphdef, cfg=cfg),
                                 has_aux=True)
    grads, metrics = _accumulate(grad_fn, params, (mb, weights, token_weights, old_logp),
                                 ref_params)
    metrics["grad_norm"] = optax.tree.norm(grads)
    updates, opt_state = make_optimizer(cfg).update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), metrics


def _old_logprobs(state: TrainState, chunks: Batch, graphdef, cfg):
    """[M*K, r, L] the ratio's denominator: the sampler's, or the learner's at the start
    of the step (cfg.loss.old_logprobs)."""
    if cfg.loss.old_logprobs != "learner":
        return chunks.old_logprobs
    old = jax.lax.map(lambda mb: policy_logprobs(graphdef, state.params, mb, cfg)[0], chunks)
    return jax.lax.stop_gradient(old)


def _step(state: TrainState, batch: Batch, ref_params, graphdef, cfg, mesh):
    """The pure train step: (state, batch, ref_params) -> (state, metrics)."""
    num_mini, num_micro = cfg.num_minibatches, cfg.num_microbatches
    chunks = split_batch(batch, num_mini * num_micro, mesh)
    old = _old_logprobs(state, chunks, graphdef, cfg)
    to_mini = lambda x: x.reshape(num_mini, num_micro, *x.shape[1:])
    update = functools.partial(_update, ref_params=ref_params, graphdef=graphdef, cfg=cfg)
    (params, opt_state), metrics = jax.lax.scan(
        update, (state.params, state.opt_state), jax.tree.map(to_mini, (chunks, old)))
    finite = jnp.all(jnp.isfinite(metrics["loss"])) & jnp.all(
        jnp.isfinite(metrics["grad_norm"]))
    metrics = {k: _REDUCE[_reduction(k)](v, axis=0) / (1 if _reduction(k) != "sum" else num_mini)
               for k, v in metrics.items()}
    metrics.update(finite=finite, step=state.step,
                   lr=make_schedule(cfg.optim)(state.step * num_mini),
                   loss_tokens=jnp.sum(batch.loss_mask))
    new_state = TrainState(params=params, opt_state=opt_state, step=state.step + 1)
    if mesh is None:
        return new_state, metrics
    # Laid out as init_train_state and abstract_train_state lay out a state.
    replicated = NamedSharding(mesh, PartitionSpec())
    return (jax.lax.with_sharding_constraint(new_state, state_shardings(new_state, cfg, mesh)),
            jax.lax.with_sharding_constraint(metrics, replicated))


def make_train_step(graphdef, cfg: LearnerConfig, mesh: Mesh | None = None):
    """`train_step(state, batch, ref_params=None) -> (state, metrics)`.

    batch: a `Batch` (host NumPy is placed on the mesh) whose rows are a multiple of
    `row_multiple(cfg, mesh)`. ref_params: reference parameters, needed only for
    loss.kl == "exact". The state is donated. metrics: device scalars (means over
    mini-batches; grad_norm before clipping, lr of the first update). A non-finite
    loss or gradient norm raises FloatingPointError naming the train step.
    """
    step_fn = functools.partial(_step, graphdef=graphdef, cfg=cfg, mesh=mesh)
    jitted = jax.jit(step_fn, donate_argnums=0)

    def train_step(state: TrainState, batch: Batch, ref_params=None):
        if cfg.loss.kl == "exact" and ref_params is None:
            raise ValueError("loss.kl='exact' needs ref_params in train_step")
        if cfg.loss.kl not in ("none", "exact") and batch.ref_logprobs is None:
            raise ValueError(f"loss.kl={cfg.loss.kl!r} needs batch.ref_logprobs")
        check_rows(batch, cfg, mesh)
        if isinstance(batch.tokens, np.ndarray):
            batch = shard_batch(batch, mesh)
        with mesh_context(mesh):  # models.sharding.constrain_rows reads the mesh
            state, metrics = jitted(state, batch, ref_params)
        finite, step = jax.device_get((metrics["finite"], metrics["step"]))
        if not finite:
            raise FloatingPointError(f"non-finite loss or gradient norm at train step {int(step)}")
        return state, metrics

    train_step.step_fn = step_fn  # the pure step, for compile-only use (bench.scale)
    return train_step
