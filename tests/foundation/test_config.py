from chatmesh.identity import identity_from_metadata
from meshkit.config import ServiceArgs


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


def test_identity_comes_only_from_metadata_and_unknown_tiers_are_downgraded():
    assert identity_from_metadata([("x-chatmesh-user-id", "alice"), ("x-chatmesh-tier", "pro")]).tier == "pro"
    assert identity_from_metadata([("x-chatmesh-user-id", "bob"), ("x-chatmesh-tier", "root")]).tier == "free"
    assert identity_from_metadata([("x-chatmesh-tier", "pro")]) is None
    assert identity_from_metadata(None) is None
