"""The project's SGLang-protocol server (inference.server) on an engine, in-process."""

import contextlib

from aiohttp import web

from inference.launcher import free_port
from inference.server import Server


@contextlib.asynccontextmanager
async def served(engine):
    """The project's server on `engine`, in this event loop; yields its URL."""
    runner = web.AppRunner(Server(engine).app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
