"""The local node's configuration and tooling: durable commitlog, Java 17 flags, clear setup errors."""

import socket
from pathlib import Path

import pytest
import yaml

from localmesh.cassandra.cluster import ClusterConfig
from localmesh.cassandra.node import (
    CqlAnswers,
    NodeConfig,
    NodeSetupError,
    cassandra_yaml,
    check_prerequisites,
    jvm_argv,
    parse_schema_versions,
)
from meshkit.launcher import free_port
from tests.fixtures.cassandra import started_on_free_ports


def test_yaml_binds_loopback_with_a_durable_commitlog(tmp_path):
    config = NodeConfig(data_dir=tmp_path, cql_port=19042, storage_port=17000, jmx_port=17199)
    settings = yaml.safe_load(cassandra_yaml(config))
    assert settings["commitlog_sync"] == "batch"
    assert settings["listen_address"] == settings["rpc_address"] == "127.0.0.1"
    assert settings["native_transport_port"] == 19042 and settings["storage_port"] == 17000
    assert settings["seed_provider"][0]["parameters"][0]["seeds"] == "127.0.0.1:17000"
    assert settings["data_file_directories"] == [f"{tmp_path}/data"]
    assert settings["commitlog_directory"] == f"{tmp_path}/commitlog"


def test_jvm_runs_the_daemon_with_java17_module_flags_and_its_own_ports(tmp_path):
    config = NodeConfig(data_dir=tmp_path, jmx_port=17199, heap_max="1g")
    argv = jvm_argv(config)
    assert argv[-1] == "org.apache.cassandra.service.CassandraDaemon"
    assert "-Xmx1g" in argv and "-Dcassandra.jmx.local.port=17199" in argv
    assert "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED" in argv
    assert "-Djdk.attach.allowAttachSelf=true" in argv
    assert f"-Dcassandra.config=file://{tmp_path}/conf/cassandra.yaml" in argv


def test_missing_jars_say_how_to_fetch_them(tmp_path):
    with pytest.raises(NodeSetupError, match="make setup"):
        check_prerequisites(NodeConfig(data_dir=tmp_path, lib_dir=tmp_path / "nothing-here"))


def test_missing_java_says_how_to_install_it(tmp_path):
    with pytest.raises(NodeSetupError, match="Java 17"):
        check_prerequisites(NodeConfig(data_dir=tmp_path, java=str(Path(tmp_path) / "no-java")))


DESCRIBECLUSTER = """Cluster Information:
\tName: chatmesh
\tSchema versions:
\t\td03783d7-b468-3c1a-82f1-8e30b2edde8b: [127.0.0.1, 127.0.0.2]
\t\tUNREACHABLE: [127.0.0.3]

Database versions:
\t5.0.8: [127.0.0.1:55697, 127.0.0.2:55697]
"""


def test_schema_versions_are_read_from_describecluster_block_alone():
    assert parse_schema_versions(DESCRIBECLUSTER) == {
        "d03783d7-b468-3c1a-82f1-8e30b2edde8b": ["127.0.0.1", "127.0.0.2"],
        "UNREACHABLE": ["127.0.0.3"],
    }


def test_cql_check_is_false_for_a_port_that_does_not_speak_cql():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert not CqlAnswers(port)()


def test_running_node_answers_cql_and_nodetool(cassandra_node):
    assert CqlAnswers(cassandra_node.node.config.cql_port)()
    status = cassandra_node.node.nodetool("status")
    assert "UN  127.0.0.1" in status


def test_a_node_whose_port_is_taken_starts_again_on_other_ports(tmp_path, capsys):
    """The test fixtures' start: a port picked free but taken before the node binds it costs one more
    start on fresh ports, not the test session."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    held = taken.getsockname()[1]
    data_dirs: list[Path] = []

    def config(data_dir: Path) -> ClusterConfig:
        data_dirs.append(data_dir)
        cql_port = held if len(data_dirs) == 1 else free_port()
        return ClusterConfig(
            data_dir=data_dir, cql_port=cql_port, storage_port=free_port(), first_jmx_port=free_port()
        )

    try:
        with started_on_free_ports(tmp_path, config) as cluster:
            node = cluster.nodes[0]
            assert len(data_dirs) == 2 and node.config.cql_port != held
            assert CqlAnswers(node.config.cql_port)()
    finally:
        taken.close()
    assert f"port {held}" in capsys.readouterr().err
