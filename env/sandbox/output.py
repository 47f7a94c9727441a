"""Bounded collection of a command's output.

A command may print without end (`yes`, a runaway test loop). The collector keeps
the first and the last `cap // 2` bytes, counts what it drops, and keeps accepting
data so the command is never blocked on a full pipe.
"""

from __future__ import annotations


class CappedOutput:
    """Accumulates byte chunks, keeping at most `cap` bytes (head and tail halves)."""

    def __init__(self, cap: int):
        if cap < 2:
            raise ValueError(f"output cap must be at least 2 bytes, got {cap}")
        self._head_cap = cap // 2
        self._tail_cap = cap - self._head_cap
        self._head = bytearray()
        self._tail = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if not chunk:
            return
        self._tail += chunk
        excess = len(self._tail) - self._tail_cap
        if excess > 0:
            del self._tail[:excess]
            self.dropped += excess

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def text(self) -> str:
        """Head, a marker naming the dropped byte count, tail; decoded with errors="replace"."""
        if not self.truncated:
            return (self._head + self._tail).decode("utf-8", errors="replace")
        marker = f"\n[... {self.dropped} bytes of output truncated ...]\n"
        return (
            self._head.decode("utf-8", errors="replace")
            + marker
            + self._tail.decode("utf-8", errors="replace")
        )
