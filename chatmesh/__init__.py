"""Contracts shared by chatmesh's services, and nothing else.

- ``chatmesh.{chat,router,engine}.v1``: Python generated from ``protos/`` (``make protos``).
- ``block_hash``: the chained KV block hash engines publish and routers index.
- ``identity``: the metadata Envoy sets after verifying a JWT.
- ``errors``: gRPC statuses with retry hints.
- ``serving``, ``telemetry``, ``config``: how every service starts, drains and reports.
- ``launcher``, ``mesh``: the local process supervisor behind ``make run`` and the test fixtures.
"""
