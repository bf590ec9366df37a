"""The driver seam: one Cassandra session, prepared statements, and an awaitable ``execute``.

The DataStax driver is not asyncio-native. ``execute`` starts ``Session.execute_async`` and resolves an
asyncio future from the driver's callbacks via ``loop.call_soon_threadsafe``, so servers stay async all
the way down. The connection class is libev (bundled in the driver's wheel; it needs neither asyncore,
removed in Python 3.12, nor a thread per connection).

Every statement runs at LOCAL_QUORUM (LWTs at LOCAL_SERIAL) with a request timeout. Statements say
whether they are idempotent, and only idempotent ones are ever retried by the driver (its default
policy would retry any statement after a connection error). Timeouts and unavailable replicas
surface as ``errors.Unavailable``; a conditional write on a contended key is run again here
(``execute_contended``). Statements name their bind markers (``:chat_id``), and the store binds
values by those names: a ``Write`` is a statement's name and a dict of its values, every marker given.
Each request is a client span and an observation of the ``db_client_operation_duration_seconds``
histogram (OpenTelemetry's db.client.operation.duration).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cassandra import (
    AuthenticationFailed,
    ConsistencyLevel,
    OperationTimedOut,
    ReadTimeout,
    WriteTimeout,
)
from cassandra import Unavailable as CassandraUnavailable
from cassandra.cluster import (
    EXEC_PROFILE_DEFAULT,
    Cluster,
    ExecutionProfile,
    NoHostAvailable,
    Session,
)
from cassandra.io.libevreactor import LibevConnection
from cassandra.policies import (
    DCAwareRoundRobinPolicy,
    ExponentialReconnectionPolicy,
    HostDistance,
    RetryPolicy,
    TokenAwarePolicy,
    WriteType,
)
from cassandra.pool import Host
from cassandra.query import (
    BatchStatement,
    BatchType,
    BoundStatement,
    PreparedStatement,
    SimpleStatement,
    Statement,
    dict_factory,
)
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import Histogram

from memory_store.errors import Unavailable
from memory_store.security import CassandraSecurity

log = logging.getLogger(__name__)

Row = dict[str, Any]
# A prepared statement's values: by marker name (what the store binds), or in marker order.
Values = dict[str, Any] | Sequence[Any]
# A named prepared statement and its values.
Write = tuple[str, Values]

# OpenTelemetry's db.client.operation.duration, labelled by statement name and error type.
OPERATION_SECONDS = Histogram(
    "db_client_operation_duration_seconds",
    "Duration of Cassandra requests made by memory_store",
    ["db_system_name", "db_operation_name", "error_type"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
_tracer = trace.get_tracer("memory_store")


@dataclass(frozen=True)
class Cql:
    """A statement to prepare, and whether running it twice leaves the same state as running it once.
    ``traced=False``: its requests make no span (its duration metric is kept), for writes made on a
    timer that would crowd a request's trace (a running answer's checkpoint, once a second)."""

    text: str
    idempotent: bool
    traced: bool = True


class IdempotentOnlyRetryPolicy(RetryPolicy):
    """The driver's default policy, except that non-idempotent statements are never retried."""

    def on_write_timeout(
        self, query, consistency, write_type, required_responses, received_responses, retry_num
    ):
        # A CAS timeout leaves the outcome unknown: the caller decides (a claim re-runs its insert). A
        # batchlog timeout would likely pick the same dead member again: the caller writes otherwise.
        retried = write_type not in (WriteType.CAS, WriteType.BATCH_LOG)
        if query is not None and query.is_idempotent and retry_num == 0 and retried:
            return self.RETRY, consistency
        return self.RETHROW, None

    def on_request_error(self, query, consistency, error, retry_num):
        if query is not None and query.is_idempotent and retry_num == 0:
            return self.RETRY_NEXT_HOST, None
        return self.RETHROW, None


_UNAVAILABLE = (CassandraUnavailable, ReadTimeout, WriteTimeout, OperationTimedOut, NoHostAvailable)
# What Cassandra counts for a cell beyond its value (a batch's size is its cells' data: the value, a
# collection element's path, the 8-byte write timestamp, a TTL's 8 bytes): a bound.
_CELL_OVERHEAD_BYTES = 16
_COLLECTIONS = frozenset({"list", "set", "map"})
# Partitions one request of ``Db.write`` may carry (a message's writes take up to five).
_MAX_BATCH_PARTITIONS = 16
# How many times a conditional write on one key is tried while it times out (``Db.execute_contended``).
_CONTENDED_ATTEMPTS = 6


@dataclass(frozen=True)
class _Bound:
    """A write bound to its prepared statement, with an upper estimate of the size Cassandra counts for
    it in a batch: each value serialized as a cell, and each element of a collection that is not frozen
    (whose elements are cells of their own) a cell more. From the serialized values, so a checkpoint's
    token ids are not walked a second time to size it."""

    name: str
    statement: BoundStatement
    size: int


class Db:
    """A connected session plus the prepared statements of the store."""

    serial = ConsistencyLevel.LOCAL_SERIAL

    def __init__(self, cluster: Cluster, session: Session, request_timeout_s: float) -> None:
        self.cluster = cluster
        self.session = session
        self.request_timeout_s = request_timeout_s
        self.keyspace = ""
        self.q: dict[str, PreparedStatement] = {}
        # Per statement, the names of its bind markers (every one is bound: ``_bound``).
        self._markers: dict[str, frozenset[str]] = {}
        self._untraced: set[str] = set()
        # Per statement, its bind markers whose column is a collection that is not frozen (``_Bound``).
        self._element_cells: dict[str, tuple[int, ...]] = {}

    @classmethod
    async def connect(
        cls,
        contact_points: Sequence[str],
        port: int,
        local_dc: str,
        request_timeout_s: float,
        security: CassandraSecurity,
    ) -> Db:
        profile = ExecutionProfile(
            load_balancing_policy=TokenAwarePolicy(DCAwareRoundRobinPolicy(local_dc=local_dc)),
            retry_policy=IdempotentOnlyRetryPolicy(),
            consistency_level=ConsistencyLevel.LOCAL_QUORUM,
            serial_consistency_level=ConsistencyLevel.LOCAL_SERIAL,
            request_timeout=request_timeout_s,
            row_factory=dict_factory,
        )
        cluster = Cluster(
            contact_points=list(contact_points),
            port=port,
            protocol_version=5,
            connection_class=LibevConnection,
            execution_profiles={EXEC_PROFILE_DEFAULT: profile},
            connect_timeout=request_timeout_s,
            # Pick a restarted node back up within seconds (the default backs off to 10 minutes).
            reconnection_policy=ExponentialReconnectionPolicy(base_delay=0.5, max_delay=10.0),
            control_connection_timeout=request_timeout_s,
            auth_provider=security.auth_provider(),
            ssl_context=security.ssl_context(),
        )
        try:
            session = await asyncio.to_thread(cluster.connect)
        except NoHostAvailable as exc:
            await asyncio.to_thread(cluster.shutdown)
            where = f"Cassandra at {', '.join(contact_points)}:{port}"
            if any(isinstance(error, AuthenticationFailed) for error in exc.errors.values()):
                raise Unavailable(
                    f"{where} refused the credentials of role {security.username or '(none given)'}: "
                    "check --cassandra-username and --cassandra-password-file"
                ) from exc
            raise Unavailable(
                f"cannot reach {where} ({exc}); is the node running, and do --cassandra-tls-* match "
                "its client encryption? (`python -m localmesh.cassandra status` for the local one)"
            ) from exc
        return cls(cluster, session, request_timeout_s)

    async def use_keyspace(self, keyspace: str) -> None:
        await asyncio.to_thread(self.session.set_keyspace, keyspace)
        self.keyspace = keyspace

    async def prepare(self, statements: Mapping[str, Cql]) -> None:
        """Prepares statements (in threads: the driver's prepare is blocking) and keeps them by name."""

        def prepare_one(cql: Cql) -> PreparedStatement:
            prepared = self.session.prepare(cql.text)
            prepared.is_idempotent = cql.idempotent
            return prepared

        names = list(statements)
        prepared = await asyncio.gather(*(asyncio.to_thread(prepare_one, statements[n]) for n in names))
        self.q.update(zip(names, prepared, strict=True))
        self._markers.update(
            (name, frozenset(c.name for c in self.q[name].column_metadata)) for name in names
        )
        self._untraced.update(name for name in names if not statements[name].traced)
        self._element_cells.update((name, self._collection_markers(self.q[name])) for name in names)

    def _collection_markers(self, prepared: PreparedStatement) -> tuple[int, ...]:
        """The bind markers of ``prepared`` whose column is a collection that is not frozen, as the schema
        says (the protocol does not tell frozen from not); every collection when the schema is not known."""
        markers = []
        for i, column in enumerate(prepared.column_metadata):
            if column.type.typename not in _COLLECTIONS:
                continue
            keyspace = self.cluster.metadata.keyspaces.get(column.keyspace_name)
            table = keyspace.tables.get(column.table_name) if keyspace else None
            declared = table.columns.get(column.name) if table else None
            if declared is None or not declared.cql_type.startswith("frozen<"):
                markers.append(i)
        return tuple(markers)

    def _bound(self, name: str, values: Values) -> BoundStatement:
        """``name``'s prepared statement bound to ``values``. The driver would leave a marker missing from
        a dict unset (a column silently not written): here every marker must be named."""
        if isinstance(values, dict) and values.keys() != self._markers[name]:
            raise KeyError(f"{name} binds {sorted(self._markers[name])}, not {sorted(values)}")
        return self.q[name].bind(values)

    def _bind(self, write: Write) -> _Bound:
        name, values = write
        statement = self._bound(name, values)
        size = sum(
            len(value) + _CELL_OVERHEAD_BYTES for value in statement.values if isinstance(value, bytes)
        )
        for i in self._element_cells[name]:
            value = statement.values[i]
            if isinstance(value, bytes):  # a serialized collection opens with its element count
                size += int.from_bytes(value[:4], "big") * _CELL_OVERHEAD_BYTES
        return _Bound(name, statement, size)

    async def write(
        self, groups: Sequence[Sequence[Write]], max_batch_bytes: int, then: Sequence[Sequence[Write]] = ()
    ) -> None:
        """Applies the groups, each to one partition and each at once (its writes land as one mutation),
        in as few requests as Cassandra takes well (``_write_groups``); raises the first failure (every
        write the store makes is idempotent: the caller retries them all).

        ``then``: groups that mark ``groups`` done, so must not be acknowledged without them: in the same
        request when everything goes in one (acknowledged together; a request that fails may have
        landed any part, for the caller's retry to complete), otherwise sent once every request of
        ``groups`` succeeded."""
        bound = [self._bind_group(group) for group in (*groups, *then)]
        batches = self._batches(bound, max_batch_bytes, _MAX_BATCH_PARTITIONS)
        if not then or len(batches) == 1:
            _raise_first(await self._apply(bound, batches))
            return
        for step in (bound[: len(groups)], bound[len(groups) :]):
            _raise_first(await self._apply(step, self._batches(step, max_batch_bytes, _MAX_BATCH_PARTITIONS)))

    async def write_in_order(
        self, first: Sequence[Sequence[Write]], then: Sequence[Sequence[Write]], max_batch_bytes: int
    ) -> None:
        """Writes ``first``, then ``then``, which must never be stored without it.

        When their values come to at most ``max_batch_bytes``, all of it goes as one logged batch
        across partitions: one round trip, and Cassandra applies every part (the coordinator first
        stores the batch in the batchlog of other nodes, which replay it if the coordinator fails
        midway). Larger ones take two round trips, ``first`` then ``then``: Cassandra refuses batches
        over its ``batch_size_fail_threshold`` (50 KiB by default)."""
        together = [self._bind(write) for group in (*first, *then) for write in group]
        if sum(write.size for write in together) <= max_batch_bytes:
            try:
                await self._execute_logged([(write.name, write.statement) for write in together])
                return
            except Unavailable:
                # Seconds after a member dies, a coordinator that does not know it yet may still pick it
                # for the batchlog, whose write then times out (it needs two of its two picks). The
                # batch may also land later, replayed from a batchlog entry that was written: every
                # write the store batches carries fixed values and timestamps, so the writes below
                # and a late replay leave the same rows.
                pass
        await self.write(first, max_batch_bytes)
        await self.write(then, max_batch_bytes)

    async def execute_batch(self, statements: Sequence[Write]) -> list[Row]:
        """Runs named prepared statements as one logged batch. Every batch the store runs is idempotent
        (fixed values and write timestamps, or a condition)."""
        return await self._execute_logged([(name, self._bound(name, values)) for name, values in statements])

    async def _execute_logged(self, statements: Sequence[tuple[str, BoundStatement]]) -> list[Row]:
        batch = BatchStatement(batch_type=BatchType.LOGGED)
        for _, statement in statements:
            batch.add(statement)
        batch.is_idempotent = True
        return await self.execute(batch, operation="+".join(name for name, _ in statements))

    async def write_unlogged(
        self, writes: Sequence[Write], max_batch_bytes: int, max_partitions: int
    ) -> list[bool]:
        """Applies independent writes, each idempotent and each to a partition of its own, in as few
        requests as Cassandra takes well (``_write_groups``, at most ``max_partitions`` a request).
        Returns whether each write was applied (a failed batch's were not, or not surely: retry them)."""
        errors = await self._write_groups([[write] for write in writes], max_batch_bytes, max_partitions)
        for error in {error for error in errors if error is not None}:  # one warning a failed request
            log.warning("%d writes failed: %s", errors.count(error), error)
        return [error is None for error in errors]

    async def _write_groups(
        self, groups: Sequence[Sequence[Write]], max_batch_bytes: int, max_partitions: int
    ) -> list[BaseException | None]:
        """Applies groups of idempotent writes, each group to one partition, all at once: the groups
        whose partitions the same nodes hold go as unlogged batches (the coordinator, one of those nodes,
        applies each partition's writes as one mutation, as a request of their own would, with no
        batchlog), at most ``max_partitions`` groups and ``max_batch_bytes`` a request, a group never
        split between two. Returns each group's failure (None: applied).

        One request instead of one per group: the driver's cost per request (a future, a query plan, a
        frame, a callback) is most of a small write's CPU in the writing process, and Cassandra's own
        per request is a share of a small write's there."""
        bound = [self._bind_group(group) for group in groups]
        return await self._apply(bound, self._batches(bound, max_batch_bytes, max_partitions))

    def _bind_group(self, group: Sequence[Write]) -> list[_Bound]:
        return [self._bind(write) for write in group]

    def _batches(
        self, bound: Sequence[list[_Bound]], max_batch_bytes: int, max_partitions: int
    ) -> list[list[int]]:
        """Which groups go in which request (``_write_groups``), as lists of their indexes."""
        by_replicas: dict[frozenset[Host], list[int]] = {}
        for i, group in enumerate(bound):
            routing_key = group[0].statement.routing_key
            replicas = frozenset(self.cluster.metadata.get_replicas(self.keyspace, routing_key))
            by_replicas.setdefault(replicas, []).append(i)
        batches: list[list[int]] = []
        for members in by_replicas.values():
            batch: list[int] = []
            size = 0
            for i in members:
                group_bytes = sum(write.size for write in bound[i])
                if batch and (len(batch) == max_partitions or size + group_bytes > max_batch_bytes):
                    batches.append(batch)
                    batch, size = [], 0
                batch.append(i)
                size += group_bytes
            batches.append(batch)
        return batches

    async def _apply(
        self, bound: Sequence[list[_Bound]], batches: list[list[int]]
    ) -> list[BaseException | None]:
        """Sends each of ``batches`` (``_batches``) as a request, all at once; each group's failure."""

        async def apply(members: list[int]) -> BaseException | None:
            writes = [write for i in members for write in bound[i]]
            names = {write.name for write in writes}
            statement: Statement = writes[0].statement
            operation = writes[0].name
            if len(writes) > 1:
                operation = f"{'+'.join(sorted(names))} (unlogged batch)"
                statement = BatchStatement(batch_type=BatchType.UNLOGGED)
                for write in writes:
                    statement.add(write.statement)
                statement.is_idempotent = True
            try:
                await self.execute(statement, operation=operation, traced=not names <= self._untraced)
            except Exception as exc:  # its writes stay the caller's to retry
                return exc
            return None

        errors: list[BaseException | None] = [None] * len(bound)
        outcomes = await asyncio.gather(*(apply(members) for members in batches))
        for members, error in zip(batches, outcomes, strict=True):
            for i in members:
                errors[i] = error
        return errors

    async def execute_contended(self, name: str, values: Values) -> Row:
        """A conditional write on one key, run again while it times out (contention on the key, or a
        slow node): its outcome is then unknown, so each statement run this way must recognise its own
        write in the row a later attempt gets back."""
        for attempt in range(_CONTENDED_ATTEMPTS - 1):
            try:
                return (await self.execute(name, values))[0]
            except Unavailable:
                await asyncio.sleep(random.uniform(0.01, 0.05) * 2**attempt)
        return (await self.execute(name, values))[0]

    async def execute(
        self,
        statement: str | Statement,
        params: Values = (),
        *,
        operation: str | None = None,
        timeout_s: float | None = None,
        consistency: int | None = None,
        traced: bool = True,
    ) -> list[Row]:
        """Runs a named prepared statement (or a given statement) and returns its rows.

        ``operation`` names it in metrics and traces (default: the prepared statement's name);
        ``traced=False``: no span (neither is there for a statement prepared with ``Cql.traced=False``).
        """
        if isinstance(statement, str):
            name, query, params = operation or statement, self._bound(statement, params), ()
        else:
            name, query = operation or "cql", statement
        if consistency is not None:
            query.consistency_level = consistency
        started = time.perf_counter()
        error = ""
        with self._span(name, traced and name not in self._untraced):
            try:
                return await self._execute(query, params, timeout_s or self.request_timeout_s)
            except BaseException as exc:
                error = type(exc).__name__
                raise
            finally:
                OPERATION_SECONDS.labels("cassandra", name, error).observe(time.perf_counter() - started)

    def _span(self, name: str, traced: bool) -> contextlib.AbstractContextManager[object]:
        if not traced:
            return contextlib.nullcontext()
        attributes = {"db.system.name": "cassandra", "db.operation.name": name, "db.namespace": self.keyspace}
        return _tracer.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes)

    async def _execute(
        self, query: Statement, params: Values, timeout_s: float, host: Host | None = None
    ) -> list[Row]:
        """Bridges the driver's callbacks (on its event loop thread) to an asyncio future."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[Row]] = loop.create_future()

        def settle(rows: Any, error: BaseException | None) -> None:
            if done.done():  # the awaiting task was cancelled meanwhile
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(list(rows or ()))

        try:
            response = self.session.execute_async(query, params or None, timeout=timeout_s, host=host)
            response.add_callbacks(
                lambda rows: loop.call_soon_threadsafe(settle, rows, None),
                lambda exc: loop.call_soon_threadsafe(settle, None, exc),
            )
            return await done
        except _UNAVAILABLE as exc:
            raise Unavailable(f"Cassandra did not answer in time; retry with backoff ({exc})") from exc

    async def await_schema_agreement(self, timeout_s: float) -> None:
        """Returns once every node reports the same schema version: each node the driver knows, asked
        for its own (``system.local``) and for what gossip last heard from every peer (``system.peers``).

        The driver's own wait after a schema change reads the versions gossip reports to one node, for
        the nodes it believes up, for at most ``max_schema_agreement_wait`` (10 s), then goes on
        regardless. On a cluster that just started, that let a read reach a member that did not have
        the new table yet (INCOMPATIBLE_SCHEMA). Asking only the members the driver knows is not enough
        either: it skips a peer whose row in ``system.peers`` is not complete yet, and that member still
        holds replicas. Migrations wait here instead; a node that does not answer, or a peer whose
        version gossip has not reported, counts as not agreeing. Only the local data centre's nodes are
        asked (the driver keeps no connection to the others); the other data centres' members count
        through what the local nodes' gossip reports for them.
        """
        own_version = SimpleStatement("SELECT schema_version FROM system.local", is_idempotent=True)
        peer_versions = SimpleStatement("SELECT peer, schema_version FROM system.peers", is_idempotent=True)
        for statement in (own_version, peer_versions):
            statement.consistency_level = ConsistencyLevel.ONE
        deadline = time.monotonic() + timeout_s
        while True:
            # Who reports which version: each node its own, and its peers' as its gossip has them.
            reports: dict[str, object] = {}
            for host in self.cluster.metadata.all_hosts():
                if self.cluster.profile_manager.distance(host) == HostDistance.IGNORED:
                    continue
                try:
                    for row in await self._execute(own_version, (), self.request_timeout_s, host=host):
                        reports[str(host.address)] = row["schema_version"]
                    for row in await self._execute(peer_versions, (), self.request_timeout_s, host=host):
                        reports[f"{row['peer']} (as {host.address} hears it)"] = row["schema_version"]
                except Exception:  # down, unreachable, or still starting: not agreeing yet
                    reports[str(host.address)] = None
            versions = set(reports.values())
            if len(versions) == 1 and None not in versions:
                return
            if time.monotonic() > deadline:
                seen = ", ".join(f"{who}: {version or 'unknown'}" for who, version in sorted(reports.items()))
                raise Unavailable(
                    f"the Cassandra nodes did not agree on the schema within {timeout_s:.0f}s ({seen})"
                )
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        await asyncio.to_thread(self.cluster.shutdown)


def _raise_first(errors: Sequence[BaseException | None]) -> None:
    """Raises the first of the groups' failures (``Db._apply``), if any."""
    for error in errors:
        if error is not None:
            raise error
