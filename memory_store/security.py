"""How a service proves itself to Cassandra and protects the connection: PasswordAuthenticator
credentials and client TLS, as flags (``--cassandra-username``, ``--cassandra-password-file``,
``--cassandra-tls-ca-file``, ``--cassandra-tls-cert-file``, ``--cassandra-tls-key-file``).

Secrets come from files, never from a flag's value (flags show in ``ps``): in Kubernetes, a mounted
Secret. Everything empty (the default): no authentication, plain CQL, as a local dev node expects.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from cassandra.auth import PlainTextAuthProvider

from meshkit.config import setting


@dataclass(frozen=True)
class CassandraSecurity:
    username: str = setting(
        "", "Cassandra role to log in as (PasswordAuthenticator)", flag="cassandra-username"
    )
    password_file: str = setting(
        "", "file holding the Cassandra role's password", flag="cassandra-password-file"
    )
    # Any of the TLS files turns TLS on; the CA is what proves the nodes are the cluster's.
    tls_ca_file: str = setting(
        "",
        "PEM CA bundle that signed the nodes' certificates (set: TLS to Cassandra)",
        flag="cassandra-tls-ca-file",
    )
    tls_cert_file: str = setting(
        "", "PEM client certificate, for clusters that require one", flag="cassandra-tls-cert-file"
    )
    tls_key_file: str = setting("", "PEM key of the client certificate", flag="cassandra-tls-key-file")

    def __post_init__(self) -> None:
        if bool(self.username) != bool(self.password_file):
            raise ValueError("--cassandra-username and --cassandra-password-file go together")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("--cassandra-tls-cert-file and --cassandra-tls-key-file go together")
        if self.tls_cert_file and not self.tls_ca_file:
            raise ValueError("a client certificate needs --cassandra-tls-ca-file to verify the nodes")

    def auth_provider(self) -> PlainTextAuthProvider | None:
        """The driver's login, or None without credentials (read now: a rotated Secret applies at the
        next connect)."""
        if not self.username:
            return None
        password = Path(self.password_file).read_text().rstrip("\r\n")
        if not password:
            raise ValueError(f"--cassandra-password-file {self.password_file} is empty")
        return PlainTextAuthProvider(username=self.username, password=password)

    def ssl_context(self) -> ssl.SSLContext | None:
        """TLS that verifies the nodes' certificates (and their names) against the CA, or None."""
        if not self.tls_ca_file:
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca_file)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.tls_cert_file:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return context
