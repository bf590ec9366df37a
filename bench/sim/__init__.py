"""A discrete-event simulation of the serving fleet around the real router code (``bench.sim``).

Simulated users (``workload``) send multi-turn chats; simulated engines (``engine``, costs in ``costs``)
batch them, cache their prefixes and publish KV events; the router's own ``PrefixIndex``, ``EngineState``
and ``Placer`` (``simulation``) ingest those events and make every placement, admission and failover
decision, timed with the real clock; ``report`` gathers the figures. The command is
``bench/bench_scale_sim.py``.
"""
