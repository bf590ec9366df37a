"""The contracts chatmesh's services share, and nothing else: what two services must agree on lives here,
once, and every service imports it.

- ``chatmesh.{chat,router,engine}.v1``: Python generated from ``protos/`` (``make protos``).
- ``block_hash``: the chained KV block hash engines publish and routers index.
- ``tokenizer``, ``gguf_header``, ``model_files``: the model's tokenizer and chat template, read from the
  model file both the orchestrator and the engine load.
- ``identity``: the metadata Envoy sets after verifying a JWT.
- ``errors``: gRPC statuses with retry hints.
- ``finish``: how a generation ended and what it cost (``FinishReason``, ``Usage``), as the engine reports
  them and the memory store keeps them.
- ``streams``: helpers for the bidi streaming calls between services.

How a service runs (serving, telemetry, config, the process launcher, Envoy's config) is ``meshkit``;
the local mesh behind ``make run`` and its dev JWTs are ``localmesh``.
"""
