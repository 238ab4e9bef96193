"""OpenAI-compatible server and the `infer` command line."""

from infer.server._version import INTERFACE_VERSION, __version__

__all__ = [
    "INTERFACE_VERSION",
    "BackgroundServer",
    "DrainingServer",
    "EngineLoop",
    "__version__",
    "build_server",
    "create_app",
]

# The server's names load on first use: `infer models ...` goes through this package and should
# not pay for importing FastAPI, uvicorn and torch.
_LAZY = {
    "create_app": "infer.server.app",
    "build_server": "infer.server.serve",
    "DrainingServer": "infer.server.serve",
    "BackgroundServer": "infer.server.serve",
    "EngineLoop": "infer.server.engine_loop",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'infer.server' has no attribute {name!r}")
