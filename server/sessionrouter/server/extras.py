"""The ``[server]`` extra, checked before the server's modules are imported.

``pip install sessionrouter`` gives trainers the client and the stubs only; ``sessionrouter
serve`` also needs what ``pip install "sessionrouter[server]"`` adds. Without this check the
command would die on an ImportError traceback deep inside the app; with it, it prints one line
naming the extra and exits 2, as every other configuration error does.
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["SERVER_MODULES", "missing_server_modules", "require_server_extra"]

SERVER_MODULES: dict[str, str] = {
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "grpc_status": "grpcio-status",
    "prometheus_client": "prometheus-client",
}
"""Top-level modules the server imports beyond the client's, with the package of each."""


def missing_server_modules() -> list[str]:
    """Distributions of the ``[server]`` extra whose module cannot be found, sorted."""
    return sorted(
        package
        for module, package in SERVER_MODULES.items()
        if importlib.util.find_spec(module) is None  # looks the module up, imports nothing
    )


def require_server_extra(prog: str = "sessionrouter") -> None:
    """Exits 2 with one line on stderr when the ``[server]`` extra is not installed."""
    missing = missing_server_modules()
    if missing:
        print(
            f"{prog}: error: the server needs the [server] extra (missing: {', '.join(missing)});"
            ' install it with: pip install "sessionrouter[server]"',
            file=sys.stderr,
        )
        raise SystemExit(2)
