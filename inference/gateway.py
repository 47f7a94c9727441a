"""SGLang's gateway (`smg`, Shepherd Model Gateway) in front of a run's servers.

    gateway = Gateway(["http://10.0.0.1:30000", "http://10.0.0.2:30000"]).start()
    ...  # POST gateway.url + "/generate", header x-smg-routing-key: <episode id>
    gateway.close()

It runs `smg launch --worker-urls ... --policy consistent_hashing`: every request
carrying the same `x-smg-routing-key` reaches the same server (its prefix cache), and a
server that stops answering is left out (its keys move to the others). smg registers a
server only once it answers `/server_info`; `start` returns when every server is
registered. Only generation goes through it: pauses, reloads and version checks go to
each server directly (inference.sglang.SGLangClient).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from inference.launcher import free_port


def smg_binary() -> str:
    """The `smg` command beside this interpreter (pip install smg), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "smg")
    found = beside if os.path.exists(beside) else shutil.which("smg")
    if not found:
        raise FileNotFoundError("engine.sglang.router='start' needs SGLang's gateway: "
                                "pip install smg")
    return found


class Gateway:
    """An `smg` process of its own (process group) on `host`:`port` (0: a free one) over
    `workers`; logs to `log_path` (default a temporary file)."""

    def __init__(self, workers: Sequence[str], host: str = "127.0.0.1", port: int = 0,
                 log_path: str = "", startup_s: float = 120.0):
        if not workers:
            raise ValueError("a gateway needs at least one server URL")
        self.workers = [w.rstrip("/") for w in workers]
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path or tempfile.mkstemp(prefix="smg_", suffix=".log")[1]
        self.startup_s = startup_s
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        # Its Prometheus exporter on a free port of `host` (by default 0.0.0.0:29000: one
        # gateway per machine).
        return [smg_binary(), "launch", "--host", self.host, "--port", str(self.port),
                "--prometheus-host", self.host, "--prometheus-port", str(free_port(self.host)),
                "--policy", "consistent_hashing", "--worker-urls", *self.workers]

    def start(self) -> Gateway:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.startup_s
        while len(self.registered()) < len(self.workers):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"smg at {self.url} did not register {self.workers} within "
                                   f"{self.startup_s:.0f}s; log {self.log_path}:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.2)
        return self

    def registered(self) -> list[str]:
        """The server URLs the gateway lists as workers ([] while it does not answer)."""
        try:
            with urllib.request.urlopen(self.url + "/workers", timeout=5) as r:
                listing = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return []
        workers = listing.get("workers", listing) if isinstance(listing, dict) else listing
        return [w.get("url", "") for w in workers if isinstance(w, dict)]

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
