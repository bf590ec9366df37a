"""The runtime kit every chatmesh service is built with: how it is configured (``config``), serves and drains
(``serving``), reports (``telemetry``), is started and supervised (``launcher``), and how Envoy, its front
door, is configured (``envoy``). Depends on the contracts in ``chatmesh``, never on a service."""
