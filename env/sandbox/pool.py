"""A bounded, leak-proof set of live sandboxes for asyncio rollouts.

    pool = SandboxPool(SandboxFactory("docker", image="swe-sandbox:test"), max_concurrent=8)
    async with pool:
        async with pool.acquire({"repo_files": files}) as sb:
            result = await pool.call(sb.run, "python3 -m unittest", 60)

`acquire` waits for a free slot, creates the sandbox in a worker thread (retrying
`SandboxError`, e.g. a busy engine, with exponential backoff) and closes it on exit
from the block, whatever ends it. Every live sandbox is tracked; `close()` closes them
all and closes the factory (for docker: removes any container of the factory, covering
one whose creation was cut short). All pools are also closed at
interpreter exit and on SIGTERM (then the process exits with 128 + 15, or the previous
handler runs); Ctrl-C cancels `asyncio.run`'s tasks, whose `acquire` blocks close
their sandboxes. A signal the process started with ignored stays ignored: under
`nohup cmd &` from a script SIGINT is ignored (Python raises no KeyboardInterrupt), so
stop such a process with SIGTERM.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import signal
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from env.sandbox.base import Sandbox, SandboxError
from env.sandbox.factory import SandboxFactory


class SandboxPool:
    """Creates sandboxes with `factory(spec)`, at most `max_concurrent` alive at once;
    closing the pool closes the factory.

    Attributes:
      id: unique id of this pool.
      peak: the largest number of sandboxes that were alive at the same time.
    """

    def __init__(self, factory: SandboxFactory, max_concurrent: int, *,
                 retries: int = 3, backoff_s: float = 0.5):
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.id = uuid.uuid4().hex[:12]
        self.factory = factory
        self.max_concurrent = max_concurrent
        self.peak = 0
        self._retries = retries
        self._backoff_s = backoff_s
        self._slots = asyncio.Semaphore(max_concurrent)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=2 * max_concurrent, thread_name_prefix=f"sandbox-{self.id}")
        self._lock = threading.Lock()
        self._live: dict[int, Sandbox] = {}
        self._closed = False
        _register(self)

    @property
    def live(self) -> int:
        return len(self._live)

    # -- sandboxes --------------------------------------------------------------------

    def _create(self, spec: Any) -> Sandbox:
        for attempt in range(self._retries + 1):
            if self._closed:
                raise SandboxError("the sandbox pool is closed")
            try:
                sandbox = self.factory(spec)
                break
            except SandboxError:
                if attempt == self._retries:
                    raise
                time.sleep(self._backoff_s * 2**attempt)
        with self._lock:
            self._live[id(sandbox)] = sandbox
            self.peak = max(self.peak, len(self._live))
            closed = self._closed
        if closed:  # the pool closed while this one was being made
            self._discard(sandbox)
            raise SandboxError("the sandbox pool is closed")
        return sandbox

    def _discard(self, sandbox: Sandbox) -> None:
        try:
            sandbox.close()
        finally:
            with self._lock:
                self._live.pop(id(sandbox), None)

    @contextlib.asynccontextmanager
    async def acquire(self, spec: Any = None) -> AsyncIterator[Sandbox]:
        """Yields a fresh sandbox for `spec`; closes it when the block ends.

        The slot stays taken until the sandbox is closed, also when the task is cancelled
        while the sandbox is being made or closed (it is then closed in the background):
        never more than `max_concurrent` sandboxes are alive.
        """
        await self._slots.acquire()
        loop = asyncio.get_running_loop()
        try:
            if self._closed:
                raise SandboxError("the sandbox pool is closed")
            created = self._executor.submit(self._create, spec)
        except BaseException:
            self._slots.release()
            raise
        try:
            sandbox = await asyncio.wrap_future(created)
        except BaseException:  # cancelled, or the creation failed
            created.add_done_callback(
                functools.partial(self._free_slot, loop, self._discard_result))
            raise
        try:
            yield sandbox
        finally:
            if not self._closed:  # (close() closed every sandbox and stopped the workers)
                closing = self._executor.submit(self._discard, sandbox)
                try:
                    await asyncio.shield(asyncio.wrap_future(closing))
                except BaseException:  # cancelled again while closing: free the slot after
                    closing.add_done_callback(functools.partial(self._free_slot, loop, None))
                    raise
            self._slots.release()

    @contextlib.contextmanager
    def exchange(self, old: Sandbox, spec: Any = None) -> Iterator[Sandbox]:
        """In the slot of `old` (a sandbox of this pool, inside its `acquire` block):
        closes it, then yields a new sandbox for `spec`, closed when the block ends (a
        blocking call, for the pool's threads: fresh-sandbox grading). The number of
        live sandboxes stays within `max_concurrent`."""
        self._discard(old)
        sandbox = self._create(spec)
        try:
            yield sandbox
        finally:
            self._discard(sandbox)

    def grader(self, old: Sandbox):
        """Fresh grading's opener in the slot of `old` (exchange); where the factory
        grades near its sandboxes (RayFactory.grade_patch), one that closes `old` and
        has the factory grade (env.grading.grade_patch)."""
        if hasattr(self.factory, "grade_patch"):
            return _GradeInSlot(self, old)
        return functools.partial(self.exchange, old)

    def _free_slot(self, loop: asyncio.AbstractEventLoop,
                   cleanup: Callable[[concurrent.futures.Future], None] | None,
                   done: concurrent.futures.Future) -> None:
        """Done-callback (any thread): runs `cleanup(done)`, then releases a slot."""
        try:
            if cleanup is not None:
                cleanup(done)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is closed: no one waits
                loop.call_soon_threadsafe(self._slots.release)

    def _discard_result(self, created: concurrent.futures.Future) -> None:
        if not created.cancelled() and created.exception() is None:
            self._discard(created.result())

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs a blocking sandbox call (e.g. `sb.run`) in the pool's worker threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    # -- teardown ---------------------------------------------------------------------

    def close(self) -> None:
        """Closes every live sandbox, then the factory. Idempotent and thread-safe."""
        with self._lock:
            self._closed = True
            live = list(self._live.values())
        errors = []
        for sandbox in live:
            try:
                self._discard(sandbox)
            except Exception as e:  # noqa: BLE001 - close the others, then report
                errors.append(e)
        self.factory.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if errors:
            raise SandboxError(f"{len(errors)} sandbox(es) failed to close: {errors[0]}")

    async def __aenter__(self) -> SandboxPool:
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)


# -- process-wide cleanup -------------------------------------------------------------

_POOLS: weakref.WeakSet[SandboxPool] = weakref.WeakSet()
_HOOKS: dict[str, Any] = {}  # "atexit": True once registered; "sigterm": the previous handler


def close_all_pools() -> None:
    """Closes every pool of this process (atexit and SIGTERM run this)."""
    for pool in list(_POOLS):
        with contextlib.suppress(Exception):
            pool.close()


def _on_sigterm(signum, frame) -> None:
    # The handler runs in the main thread wherever it was interrupted, possibly holding a
    # lock that closing needs (ThreadPoolExecutor.submit holds its shutdown lock while it
    # starts a worker): closing here could deadlock. A thread closes the pools as soon as
    # such locks are free, while the main thread unwinds; the interpreter waits for it.
    threading.Thread(target=close_all_pools, name="sandbox-pools-close").start()
    previous = _HOOKS["sigterm"]
    if callable(previous):
        previous(signum, frame)
    else:
        raise SystemExit(128 + signum)


def _register(pool: SandboxPool) -> None:
    if "atexit" not in _HOOKS:
        atexit.register(close_all_pools)
        _HOOKS["atexit"] = True
    # Signal handlers can only be installed from the main thread; an ignored SIGTERM stays so.
    if ("sigterm" not in _HOOKS and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN):
        _HOOKS["sigterm"] = signal.signal(signal.SIGTERM, _on_sigterm)
    _POOLS.add(pool)


class _GradeInSlot:
    """SandboxPool.grader's opener for a factory that grades near its sandboxes."""

    def __init__(self, pool: SandboxPool, old: Sandbox):
        self.pool, self.old = pool, old

    def grade_patch(self, task, patch: str, timeout: float):
        self.pool._discard(self.old)
        return self.pool.factory.grade_patch(task, patch, timeout)
