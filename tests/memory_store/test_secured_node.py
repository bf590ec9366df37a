"""memory_store against a real Cassandra node that demands what a production cluster does: a login
(PasswordAuthenticator) and TLS on the CQL port, with certificates from a CA made here. A node of its
own, started for this module only (the session's shared node stays open and fast)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from localmesh.cassandra.node import CassandraNode, NodeConfig, NodeSetupError
from memory_store.config import StoreConfig
from memory_store.errors import Unavailable
from memory_store.security import CassandraSecurity
from memory_store.store import MemoryStore
from meshkit.launcher import Launcher, free_port

KEYSPACE = "chatmesh_secured"
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Pki:
    ca_pem: Path
    node_keystore_pem: Path


def make_pki(directory: Path, name: str) -> Pki:
    """A CA, and a node certificate for 127.0.0.1 signed by it (key and chain in one PEM, as
    Cassandra's PEMBasedSslContextFactory reads them)."""
    directory.mkdir(parents=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    node_key = ec.generate_private_key(ec.SECP256R1())
    node = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cassandra-node")]))
        .issuer_name(ca_name)
        .public_key(node_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    ca_path, keystore = directory / "ca.pem", directory / "node.pem"
    ca_path.write_bytes(ca.public_bytes(pem))
    keystore.write_bytes(
        node_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        + node.public_bytes(pem)
        + ca.public_bytes(pem)
    )
    return Pki(ca_path, keystore)


@dataclass(frozen=True)
class SecuredNode:
    config: StoreConfig
    pki: Pki
    password_file: Path


@pytest.fixture(scope="module")
def secured_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredNode]:
    base = tmp_path_factory.mktemp("secured-cassandra")
    pki = make_pki(base / "pki", "cluster")
    password_file = base / "password"
    password_file.write_text("cassandra\n")  # the default superuser's; a trailing newline is ignored
    node_config = NodeConfig(
        data_dir=base / "data",
        cql_port=free_port(),
        storage_port=free_port(),
        jmx_port=free_port(),
        password_auth=True,
        tls_keystore_pem=pki.node_keystore_pem,
    )
    with Launcher(base / "run") as launcher:
        node = CassandraNode(node_config, launcher, name="cassandra-secured")
        try:
            node.start()
        except NodeSetupError as exc:
            pytest.fail(str(exc), pytrace=False)
        security = CassandraSecurity(
            username="cassandra", password_file=str(password_file), tls_ca_file=str(pki.ca_pem)
        )
        yield SecuredNode(
            StoreConfig(port=node_config.cql_port, keyspace=KEYSPACE, security=security), pki, password_file
        )
        node.stop()


async def test_the_store_logs_in_over_tls_and_works(secured_node: SecuredNode):
    store = await MemoryStore.connect(secured_node.config)
    try:
        chat = await store.create_chat("alice", "over TLS")
        assert (await store.get_chat("alice", chat.chat_id)).title == "over TLS"
    finally:
        await store.close()


async def test_wrong_or_missing_credentials_are_refused_saying_so(secured_node: SecuredNode, tmp_path: Path):
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password")
    security = secured_node.config.security
    for refused in (
        replace(security, password_file=str(wrong)),
        replace(security, username="", password_file=""),
    ):
        with pytest.raises(Unavailable, match="refused the credentials"):
            await MemoryStore.connect(replace(secured_node.config, security=refused))


async def test_plain_cql_or_an_untrusted_certificate_is_refused(secured_node: SecuredNode, tmp_path: Path):
    stranger = make_pki(tmp_path / "other", "other")
    security = secured_node.config.security
    for refused in (replace(security, tls_ca_file=""), replace(security, tls_ca_file=str(stranger.ca_pem))):
        with pytest.raises(Unavailable, match="cannot reach"):
            await MemoryStore.connect(replace(secured_node.config, security=refused, request_timeout_s=3.0))


def test_the_schema_command_takes_the_same_credentials_from_its_environment(secured_node: SecuredNode):
    config = secured_node.config
    env = {
        **os.environ,
        "CHATMESH_MEMORY_STORE_CASSANDRA_USERNAME": "cassandra",
        "CHATMESH_MEMORY_STORE_CASSANDRA_PASSWORD_FILE": str(secured_node.password_file),
        "CHATMESH_MEMORY_STORE_CASSANDRA_TLS_CA_FILE": str(secured_node.pki.ca_pem),
    }
    argv = [
        sys.executable,
        "-m",
        "memory_store",
        "schema",
        "--cql-port",
        str(config.port),
        "--keyspace",
        KEYSPACE,
    ]
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    del env["CHATMESH_MEMORY_STORE_CASSANDRA_PASSWORD_FILE"]
    refused = subprocess.run(
        argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert refused.returncode == 1
    assert "--cassandra-username and --cassandra-password-file go together" in refused.stderr
