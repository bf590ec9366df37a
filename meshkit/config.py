"""One configuration pattern for every service: a dataclass field, declared once, is its flag.

A field declared with ``setting(default, help)`` (or, where meshkit cannot be imported, with
``metadata={"help": ...}``) is the flag ``--<field-name>`` and the environment variable
``CHATMESH_<SERVICE>_<FLAG>``: ``--flag`` beats the variable beats the field's default. Helm sets the
variables; people and tests pass flags. A ``nested(Config)`` field contributes that dataclass's flags. ``ServiceArgs.config(Config)`` parses and builds the config, and the dataclasses'
``__post_init__`` are the one place values are validated (a ValueError is a usage error, exit code 2)::

    @dataclass(frozen=True)
    class RouterConfig:
        max_attempts: int = setting(3, "placements per request: the first one plus failovers")

    args = ServiceArgs("router", "...")
    args.add_config(RouterConfig)
    ns, config = args.config(RouterConfig, argv)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# New calls gRPC holds for a server until the service's event loop takes them: a burst of new streams
# arrives faster than Python accepts them. gRPC's own default (1,000, then shedding at random up to a
# hard 3,000) answered a few percent of a 2,000-stream burst CANCELLED before any handler ran. A call
# held longer than DEFAULT_MAX_PENDING_S (gRPC's own 30 s) is shed CANCELLED too: by then its caller
# has waited far past any first-token objective.
DEFAULT_MAX_PENDING_CALLS = 20_000
DEFAULT_MAX_PENDING_S = 30


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    flag: str | None = None,
    parse: Callable[[Any], Any] | None = None,
    flag_default: Any = dataclasses.MISSING,
    repeat: bool = False,
    per: tuple[str, ...] = (),
) -> Any:
    """A config field that is a flag.

    ``flag``: its name when it is not the field's (with dashes); a field with ``flag`` and no ``help``
    reads a flag another field declares. ``parse``: the flag's value to the field's (``flag_default``
    is then the flag's default). ``repeat``: a repeatable flag, a comma-separated variable. ``per``: a
    dict field with one flag per key, ``flag`` and ``help`` holding ``{key}``.
    """
    metadata = {"help": help, "flag": flag, "parse": parse, "repeat": repeat, "per": per}
    if flag_default is not dataclasses.MISSING:
        metadata["flag_default"] = flag_default
    if not help:
        del metadata["help"]
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def nested(config: type) -> Any:
    """A config field holding another config dataclass, whose settings are flags too."""
    return dataclasses.field(default_factory=config, metadata={"nested": True})


def _flag_name(item: dataclasses.Field) -> str:
    return item.metadata.get("flag") or item.name.replace("_", "-")


def _default(item: dataclasses.Field) -> Any:
    if "flag_default" in item.metadata:
        return item.metadata["flag_default"]
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return item.default


def _nested(item: dataclasses.Field) -> type | None:
    """The config dataclass a ``nested`` field holds, or None."""
    return item.default_factory if item.metadata.get("nested") else None  # type: ignore[return-value]


class ServiceArgs:
    """An argparse parser whose flags default to ``CHATMESH_<SERVICE>_<FLAG>`` environment variables."""

    def __init__(self, service: str, description: str, parser: argparse.ArgumentParser | None = None) -> None:
        """``parser``: add the flags to this one (a subcommand's) instead of a new parser."""
        self.service = service
        self.parser = parser or argparse.ArgumentParser(
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

    def add_config(self, config: type) -> None:
        """A flag for every setting of ``config`` and of the config dataclasses it holds."""
        for item in dataclasses.fields(config):
            if (nested := _nested(item)) is not None:
                self.add_config(nested)
                continue
            if "help" not in item.metadata:
                continue
            name, help, default = _flag_name(item), item.metadata["help"], _default(item)
            if item.metadata.get("per"):
                for key in item.metadata["per"]:
                    self.add(name.format(key=key), default[key], help.format(key=key))
            elif item.metadata.get("repeat"):
                self.add_list(name, list(default), help)
            else:
                self.add(name, default, help)

    def config(self, config: type[T], argv: list[str] | None = None) -> tuple[argparse.Namespace, T]:
        """The parsed flags, and ``config`` built from them; an invalid value exits with a usage error."""
        ns = self.parse(argv)
        try:
            return ns, from_flags(config, ns)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            self.parser.error(str(exc))

    def add_server_flags(self, port: int) -> None:
        """The flags every gRPC service has: where to listen, where to expose metrics, how long to drain."""
        self.add("host", "127.0.0.1", "address to listen on")
        self.add("port", port, "gRPC port")
        self.add("metrics-port", 0, "Prometheus /metrics port (0: disabled)")
        self.add("drain-grace-s", 10.0, "seconds in-flight streams get to finish after SIGTERM")
        self.add(
            "max-pending-calls",
            DEFAULT_MAX_PENDING_CALLS,
            "new calls gRPC holds until the service takes them (a burst of streams); beyond, it sheds them",
        )
        self.add(
            "max-pending-s", DEFAULT_MAX_PENDING_S, "seconds a new call may wait for the service to take it"
        )

    def parse(self, argv: list[str] | None = None) -> argparse.Namespace:
        args = self.parser.parse_args(argv)
        for name in list(vars(args)):
            if name.startswith("_") and name.endswith("_default"):
                flag = name[1 : -len("_default")]
                if getattr(args, flag) is None:
                    setattr(args, flag, getattr(args, name))
                delattr(args, name)
        return args


def from_flags(config: type[T], ns: argparse.Namespace) -> T:
    """``config`` built from parsed flags (its ``__post_init__`` validates; ValueError if invalid)."""
    values: dict[str, Any] = {}
    for item in dataclasses.fields(config):  # type: ignore[arg-type]  # T is a dataclass by contract
        if (nested := _nested(item)) is not None:
            values[item.name] = from_flags(nested, ns)
            continue
        if "help" not in item.metadata and "flag" not in item.metadata:
            continue
        name = _flag_name(item).replace("-", "_")
        if item.metadata.get("per"):
            value: Any = {key: getattr(ns, name.format(key=key)) for key in item.metadata["per"]}
        else:
            value = getattr(ns, name)
        values[item.name] = item.metadata["parse"](value) if item.metadata.get("parse") else value
    return config(**values)


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {raw!r}")
