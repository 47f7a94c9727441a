"""token_logprobs: picks an implementation; the Pallas kernels fall back to chunked XLA,
logged (kernels.fallback)."""

import dataclasses

import jax
import jax.numpy as jnp

from kernels import fallback
from kernels.logprob.chunked import token_logprobs_chunked
from kernels.logprob.pallas import PallasEngine
from kernels.logprob.reference import token_logprobs_reference
from kernels.logprob.xla import XlaEngine

IMPLEMENTATIONS = ("reference", "xla", "pallas")


def token_logprobs(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    *,
    temperature: float = 1.0,
    implementation: str | None = None,
    row_block: int | None = None,
    vocab_block: int | None = None,
    d_block: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (the kernel's API: the arrays, then the options)
    """Log-prob of each target token and entropy, without materialising [N, V] logits.

    With z = hidden @ lm_head / temperature and p = softmax(z):
      logp[n] = z[n, targets[n]] - logsumexp(z[n]),  entropy[n] = -sum_v p[n, v] log p[n, v].

    Args:
      hidden: [N, d] final hidden states (float32 or bfloat16), or [R, N, d]: R batch rows,
        each compacted on its own (vmapped) under a mesh (jax.set_mesh), so rows split
        over devices stay split; without one, as one [R N, d] call.
      lm_head: [d, V] output projection.
      targets: [N] (or [R, N]) int token ids in [0, V).
      mask: [N] (or [R, N]); positions where mask == 0 return 0, get zero gradient and
        cost no matmul FLOPs.
      temperature: sampling temperature (> 0), a static Python float.
      implementation: None (xla on CPU; pallas elsewhere, falling back to xla with a logged
        warning when the kernels do not compile for these shapes), "reference", "xla" or
        "pallas" (required: kernels that do not compile raise
        kernels.fallback.KernelUnavailable).
      row_block, vocab_block: tile sizes of the chosen engine; None keeps its defaults
        (xla 1024 x 4096 for CPU caches, pallas 64 x 128 for GPU tiles).
      d_block: pallas only: width of the chunks of d each logit tile is accumulated over;
        None takes the largest that fits the GPU's shared memory (kernels.logprob.pallas).
      interpret: run the Pallas kernels in interpret mode (CPU tests).

    Returns:
      (logp, entropy) shaped like targets, float32, differentiable with respect to hidden
      and lm_head (float32 accumulation whatever the input dtype).
    """
    if hidden.ndim == 3:
        return _batch_rows(lambda h, t, m: token_logprobs(
            h, lm_head, t, m, temperature=temperature, implementation=implementation,
            row_block=row_block, vocab_block=vocab_block, d_block=d_block,
            interpret=interpret), hidden, targets, mask)
    _check_inputs(hidden, lm_head, targets, mask, temperature)
    temperature = float(temperature)
    _check_implementation(implementation, interpret)
    if implementation == "reference":
        return token_logprobs_reference(hidden, lm_head, targets, mask, temperature)
    blocks = _block_sizes(row_block, vocab_block, d_block)
    engine = _engine(implementation, blocks, d_block, interpret, temperature,
                     (hidden, lm_head, targets, mask))
    return token_logprobs_chunked(hidden, lm_head, targets, mask, temperature, engine)


def _batch_rows(one_call, hidden, targets, mask):
    """`one_call` over [R, N, ...] rows: vmapped under a mesh, else one [R N, ...] call."""
    if not targets.shape == mask.shape == hidden.shape[:2]:
        raise ValueError(f"targets and mask must be [R, N]={hidden.shape[:2]}, got "
                         f"{targets.shape} and {mask.shape}")
    if not jax.sharding.get_abstract_mesh().empty:
        return jax.vmap(one_call)(hidden, targets, mask)
    # No mesh: the rows as one [R N, d] call, compacted together. Per-row calls
    # would cut the matmuls R-fold, give each row its own [d, V] gradient to sum, and
    # turn the loops' dynamic trip counts into selects over every carry.
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    logp, entropy = one_call(flat(hidden), flat(targets), flat(mask))
    return logp.reshape(targets.shape), entropy.reshape(targets.shape)


def _check_implementation(implementation, interpret):
    if implementation not in (*IMPLEMENTATIONS, None):
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, "
                         f"got {implementation!r}")
    if implementation == "pallas" and jax.default_backend() == "cpu" and not interpret:
        raise ValueError("implementation='pallas' on CPU needs interpret=True")


def _block_sizes(row_block, vocab_block, d_block) -> dict[str, int]:
    """The tile sizes given (None: the engine's default), checked."""
    blocks = {name: size for name, size in (("row_block", row_block),
                                            ("vocab_block", vocab_block)) if size is not None}
    if any(not isinstance(size, int) or size < 1 for size in (*blocks.values(), d_block)
           if size is not None):
        raise ValueError(f"block sizes must be positive integers, got "
                         f"{dict(blocks, d_block=d_block)}")
    return blocks


def _engine(implementation, blocks, d_block, interpret, temperature, arrays):
    """The chunked engine: XLA's, or the Pallas kernels' where chosen (None: off CPU)
    and, compiled, checked to compile for these `arrays` (else the XLA one, logged)."""
    engine = XlaEngine(**blocks)
    if implementation == "pallas" or (implementation is None and jax.default_backend() != "cpu"):
        pallas_engine = PallasEngine(**blocks, d_block=d_block, interpret=interpret)
        check = _ForwardBackward(pallas_engine, temperature)
        # Interpreted kernels always run; compiled ones are checked first.
        if interpret or fallback.use_pallas("logprob", check, fallback.signature(*arrays),
                                            required=implementation == "pallas"):
            engine = pallas_engine
    return engine


def _check_inputs(hidden, lm_head, targets, mask, temperature):
    if hidden.ndim != 2 or lm_head.ndim != 2:
        raise ValueError(f"hidden must be [N, d] and lm_head [d, V], got shapes "
                         f"{hidden.shape} and {lm_head.shape}")
    if hidden.shape[1] != lm_head.shape[0]:
        raise ValueError(f"hidden [N, d={hidden.shape[1]}] does not match "
                         f"lm_head [d={lm_head.shape[0]}, V]")
    num_rows = hidden.shape[0]
    if targets.shape != (num_rows,) or mask.shape != (num_rows,):
        raise ValueError(f"targets and mask must be [N={num_rows}], got {targets.shape} "
                         f"and {mask.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids, got dtype {targets.dtype}")
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


@dataclasses.dataclass(frozen=True)
class _ForwardBackward:
    """Forward and backward of one engine (hashable: compile checks are cached)."""

    engine: object
    temperature: float

    def __call__(self, hidden, lm_head, targets, mask):
        f = lambda h, w: token_logprobs_chunked(h, w, targets, mask, self.temperature,
                                                self.engine)
        outputs, vjp = jax.vjp(f, hidden, lm_head)
        return outputs, vjp(outputs)
