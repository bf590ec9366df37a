"""Command-line flags whose defaults come from environment variables.

Every service reads its configuration the same way: ``--flag`` beats ``CHATMESH_<SERVICE>_<FLAG>`` beats
the built-in default. Helm sets the variables; people and tests pass flags.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any


class ServiceArgs:
    """An argparse parser whose flags default to ``CHATMESH_<SERVICE>_<FLAG>`` environment variables."""

    def __init__(self, service: str, description: str) -> None:
        self.service = service
        self.parser = argparse.ArgumentParser(
            prog=f"python -m {service}",
            description=description,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )

    def env_name(self, flag: str) -> str:
        return f"CHATMESH_{self.service}_{flag}".upper().replace("-", "_")

    def add(self, flag: str, default: Any, help: str, type: Callable[[str], Any] | None = None) -> None:
        env = self.env_name(flag)
        convert = type or (default.__class__ if default is not None else str)
        if convert is bool:
            convert = _parse_bool
        raw = os.environ.get(env)
        value = convert(raw) if raw is not None else default
        self.parser.add_argument(f"--{flag}", default=value, type=convert, help=f"{help} [env {env}]")

    def add_list(self, flag: str, default: list[str], help: str) -> None:
        """A repeatable flag; the environment variable holds a comma-separated list."""
        env = self.env_name(flag)
        raw = os.environ.get(env)
        value = [item.strip() for item in raw.split(",") if item.strip()] if raw else default
        self.parser.add_argument(f"--{flag}", action="append", default=None, help=f"{help} [env {env}]")
        self.parser.set_defaults(**{f"_{flag}_default".replace("-", "_"): value})

    def add_server_flags(self, port: int) -> None:
        """The flags every gRPC service has: where to listen, where to expose metrics, how long to drain."""
        self.add("host", "127.0.0.1", "address to listen on")
        self.add("port", port, "gRPC port")
        self.add("metrics-port", 0, "Prometheus /metrics port (0: disabled)")
        self.add("drain-grace-s", 10.0, "seconds in-flight streams get to finish after SIGTERM")

    def parse(self, argv: list[str] | None = None) -> argparse.Namespace:
        args = self.parser.parse_args(argv)
        for name in list(vars(args)):
            if name.startswith("_") and name.endswith("_default"):
                flag = name[1 : -len("_default")]
                if getattr(args, flag) is None:
                    setattr(args, flag, getattr(args, name))
                delattr(args, name)
        return args


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {raw!r}")
