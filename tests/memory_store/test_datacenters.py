"""A local cluster of two data centres, one member each on loopback addresses: the snitch places each
member in its data centre, the keyspace replicates to both, a write acknowledged at EACH_QUORUM in one is
readable at LOCAL_ONE in the other at once, and the store's LOCAL_QUORUM writes reach the other data
centre asynchronously."""

import asyncio
import contextlib
import time
from collections.abc import Iterator

import pytest
import yaml
from cassandra import ConsistencyLevel
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile, Session
from cassandra.policies import DCAwareRoundRobinPolicy
from cassandra.query import SimpleStatement

from localmesh.cassandra.cluster import CassandraCluster, ClusterConfig
from localmesh.cassandra.node import cassandra_yaml, write_conf
from memory_store.config import StoreConfig, parse_replication
from memory_store.errors import NotFound
from memory_store.schema import replication_cql
from memory_store.store import MemoryStore
from tests.fixtures.cassandra import TEST_KEYSPACE, cluster_on_free_ports, started_on_free_ports
from tests.memory_store.builders import new_user

DATACENTERS = ("dc1", "dc2")


def test_members_split_into_data_centres_with_a_seed_and_a_ring_each(tmp_path):
    config = ClusterConfig(tmp_path, size=4, datacenters=DATACENTERS)
    nodes = config.node_configs()
    assert [node.datacenter for node in nodes] == ["dc1", "dc1", "dc2", "dc2"]
    assert config.addresses_in("dc2") == ["127.0.0.3", "127.0.0.4"]
    assert len({node.initial_token for node in nodes}) == 4
    settings = yaml.safe_load(cassandra_yaml(nodes[1]))
    assert settings["endpoint_snitch"] == "GossipingPropertyFileSnitch"
    assert settings["seed_provider"][0]["parameters"][0]["seeds"] == "127.0.0.1:7000,127.0.0.3:7000"
    write_conf(nodes[3])
    assert "dc=dc2\nrack=rack1\n" in nodes[3].rackdc_path.read_text()
    assert config.replication() == {"class": "NetworkTopologyStrategy", "dc1": 2, "dc2": 2}
    assert parse_replication(config.replication_flag()) == config.replication()


def test_a_single_data_centre_keeps_the_simple_snitch_and_strategy(tmp_path):
    config = ClusterConfig(tmp_path, size=3)
    assert all(node.datacenter is None for node in config.node_configs())
    assert "endpoint_snitch: SimpleSnitch\n" in cassandra_yaml(config.node_configs()[0])
    assert config.replication_flag() == "SimpleStrategy:3"


def test_a_lone_member_of_a_named_data_centre_is_placed_in_it(tmp_path):
    """Its keyspace replicates to that data centre, so the node must not fall back to SimpleSnitch's."""
    config = ClusterConfig(tmp_path, size=1, datacenters=("dc1",))
    assert [node.datacenter for node in config.node_configs()] == ["dc1"]
    assert config.replication() == {"class": "NetworkTopologyStrategy", "dc1": 1}


def test_members_that_do_not_split_evenly_are_refused(tmp_path):
    with pytest.raises(ValueError, match="split evenly"):
        ClusterConfig(tmp_path, size=3, datacenters=DATACENTERS)


@pytest.fixture(scope="module")
def two_datacenters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CassandraCluster]:
    config = cluster_on_free_ports(2, DATACENTERS)
    with started_on_free_ports(tmp_path_factory.mktemp("cassandra-dcs"), config) as cluster:
        yield cluster


def store_config(config: ClusterConfig, datacenter: str) -> StoreConfig:
    """How a region's services reach the cluster: their own data centre's members, named local."""
    return StoreConfig(
        contact_points=tuple(config.addresses_in(datacenter)),
        port=config.cql_port,
        keyspace=TEST_KEYSPACE,
        replication=config.replication(),
        local_dc=datacenter,
    )


@contextlib.contextmanager
def session_in(config: ClusterConfig, datacenter: str, consistency: int) -> Iterator[Session]:
    """A driver session that only the members of ``datacenter`` coordinate."""
    profile = ExecutionProfile(
        load_balancing_policy=DCAwareRoundRobinPolicy(local_dc=datacenter), consistency_level=consistency
    )
    cluster = Cluster(
        config.addresses_in(datacenter),
        port=config.cql_port,
        execution_profiles={EXEC_PROFILE_DEFAULT: profile},
    )
    try:
        yield cluster.connect()
    finally:
        cluster.shutdown()


def test_the_cluster_shows_two_data_centres(two_datacenters):
    config = two_datacenters.config
    with session_in(config, "dc1", ConsistencyLevel.LOCAL_ONE) as session:
        by_address = {host.address: host.datacenter for host in session.cluster.metadata.all_hosts()}
        peers = {
            row.peer: row.data_center for row in session.execute("SELECT peer, data_center FROM system.peers")
        }
    assert by_address == {"127.0.0.1": "dc1", "127.0.0.2": "dc2"}
    assert {str(peer): dc for peer, dc in peers.items()} == {"127.0.0.2": "dc2"}
    status = two_datacenters.nodes[1].nodetool("status")
    assert "Datacenter: dc1" in status and "Datacenter: dc2" in status


def test_a_write_acknowledged_at_each_quorum_is_read_at_local_one_in_the_other_data_centre(two_datacenters):
    config = two_datacenters.config
    with session_in(config, "dc1", ConsistencyLevel.EACH_QUORUM) as writer:
        writer.execute(
            f"CREATE KEYSPACE IF NOT EXISTS dcs_probe WITH replication = {replication_cql(config.replication())}"
        )
        writer.execute("CREATE TABLE IF NOT EXISTS dcs_probe.kv (k text PRIMARY KEY, v text)")
        for i in range(20):
            done = writer.execute("INSERT INTO dcs_probe.kv (k, v) VALUES (%s, %s)", (f"k{i}", f"v{i}"))
            assert str(done.response_future.coordinator_host).startswith("127.0.0.1")
    with session_in(config, "dc2", ConsistencyLevel.LOCAL_ONE) as reader:
        for i in range(20):
            found = reader.execute(SimpleStatement("SELECT v FROM dcs_probe.kv WHERE k = %s"), (f"k{i}",))
            assert str(found.response_future.coordinator_host).startswith("127.0.0.2")
            assert [row.v for row in found] == [f"v{i}"]


async def test_the_store_creates_its_keyspace_across_both_and_its_writes_reach_the_other(two_datacenters):
    """The store's writes are LOCAL_QUORUM: acknowledged by dc1 alone, they reach dc2 soon after."""
    config = two_datacenters.config
    west = await MemoryStore.connect(store_config(config, "dc1"))
    east = await MemoryStore.connect(store_config(config, "dc2"))
    try:
        with session_in(config, "dc2", ConsistencyLevel.LOCAL_ONE) as session:
            row = session.execute(
                "SELECT replication FROM system_schema.keyspaces WHERE keyspace_name = %s", (TEST_KEYSPACE,)
            ).one()
        assert dict(row.replication) == {
            "class": "org.apache.cassandra.locator.NetworkTopologyStrategy",
            "dc1": "1",
            "dc2": "1",
        }
        user = new_user()
        chat = await west.create_chat(user, "asked in dc1")
        deadline = time.monotonic() + 30.0
        while True:
            try:
                seen = await east.get_chat(user, chat.chat_id)
                break
            except NotFound:
                assert time.monotonic() < deadline, "a dc1 write did not reach dc2 in 30 s"
                await asyncio.sleep(0.2)
        assert seen.title == "asked in dc1"
    finally:
        await west.close()
        await east.close()
