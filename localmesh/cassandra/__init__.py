"""The local Apache Cassandra of development and tests: one node (``node``), a cluster of them on the
loopback addresses (``cluster``), and ``python -m localmesh.cassandra`` to run one by hand. The jars come
from Maven Central, pinned by ``pom.xml`` here (``scripts/provision.sh``)."""
