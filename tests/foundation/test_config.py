from dataclasses import dataclass

import pytest

from meshkit.config import ServiceArgs, nested, setting


def make(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = ServiceArgs("router", "test")
    args.add_server_flags(port=50051)
    args.add_list("engine", ["127.0.0.1:1"], "engines")
    args.add("shed", True, "shed load")
    return args


def test_flag_beats_environment_beats_default(monkeypatch):
    args = make(monkeypatch, {"CHATMESH_ROUTER_PORT": "6000"})
    assert args.parse([]).port == 6000
    assert args.parse(["--port", "7000"]).port == 7000
    assert make(monkeypatch, {}).parse([]).metrics_port == 0


def test_list_flags_from_environment_and_repeated_flags(monkeypatch):
    args = make(monkeypatch, {"CHATMESH_ROUTER_ENGINE": "a:1, b:2"})
    assert args.parse([]).engine == ["a:1", "b:2"]
    assert args.parse(["--engine", "c:3", "--engine", "d:4"]).engine == ["c:3", "d:4"]


def test_booleans_parse_words(monkeypatch):
    monkeypatch.delenv("CHATMESH_ROUTER_SHED", raising=False)
    assert make(monkeypatch, {"CHATMESH_ROUTER_SHED": "false"}).parse([]).shed is False


@dataclass(frozen=True)
class Weights:
    overlap: float = setting(1.0, "overlap weight", flag="overlap-weight")


@dataclass(frozen=True)
class Example:
    policy: str = setting("kv_aware", "placement policy")
    engines: tuple[str, ...] = setting((), "an engine (repeatable)", flag="engine", parse=tuple, repeat=True)
    runs: dict[str, int] = setting(
        default_factory=lambda: {"free": 1, "pro": 2},
        help="runs per {key} user",
        flag="runs-{key}",
        per=("free", "pro"),
    )
    weights: Weights = nested(Weights)
    internal: int = 7  # no help: not a flag

    def __post_init__(self) -> None:
        if self.policy not in ("kv_aware", "random"):
            raise ValueError(f"unknown policy {self.policy!r}")


def example_args() -> ServiceArgs:
    args = ServiceArgs("router", "test")
    args.add_config(Example)
    return args


def test_a_field_declared_once_is_its_flag_and_its_environment_variable(monkeypatch):
    monkeypatch.setenv("CHATMESH_ROUTER_RUNS_PRO", "5")
    monkeypatch.setenv("CHATMESH_ROUTER_ENGINE", "a:1,b:2")
    ns, config = example_args().config(Example, ["--overlap-weight", "0.5", "--policy", "random"])
    assert config == Example(
        policy="random", engines=("a:1", "b:2"), runs={"free": 1, "pro": 5}, weights=Weights(0.5)
    )
    assert not hasattr(ns, "internal")


def test_an_invalid_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        example_args().config(Example, ["--policy", "fastest"])
    assert exited.value.code == 2 and "unknown policy 'fastest'" in capsys.readouterr().err
