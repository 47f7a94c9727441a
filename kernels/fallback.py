"""Choosing a Pallas kernel: it runs where it compiles, and a fallback is never silent.

`implementation=None` in a kernel's api picks the Pallas kernel on accelerators when it
compiles for the call's shapes, and otherwise the XLA path, logging which kernel fell
back and the compiler's reason (once per kernel and shape). An explicit "pallas" is a
requirement: a kernel that does not compile is then an error naming it and the reason.
"""

import functools
import logging

import jax

log = logging.getLogger("kernels")


class KernelUnavailable(RuntimeError):
    """A required Pallas kernel does not compile for these shapes on this backend."""


def signature(*arrays) -> tuple:
    """Hashable shapes and dtypes of arrays (None stays None)."""
    return tuple(None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays)


@functools.lru_cache(maxsize=128)
def compile_error(fn, args: tuple) -> str | None:
    """None when jit(fn) lowers and compiles for abstract `args`, else the error text.
    `fn` must be hashable and stable (a module-level function or a partial of one)."""
    try:
        jax.jit(fn).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - any lowering/compile failure is reported
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}"
    return None


def use_pallas(kernel: str, fn, args: tuple, required: bool) -> bool:
    """Whether to run the Pallas `kernel`: compiles -> True; else raise if `required`,
    or log the fallback and its reason and return False."""
    error = compile_error(fn, args)
    if error is None:
        return True
    if required:
        raise KernelUnavailable(f"Pallas kernel {kernel} was required but does not compile "
                                f"on {jax.default_backend()}: {error}")
    _log_fallback(kernel, error)
    return False


@functools.lru_cache(maxsize=128)
def _log_fallback(kernel: str, error: str) -> None:
    log.warning("Pallas kernel %s does not compile on %s, falling back to XLA: %s",
                kernel, jax.default_backend(), error)
