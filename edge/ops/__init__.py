"""The live operations page (``/ops``) and its API (``/v1/ops/...``), for the operator role only: what the
mesh's services export on their Prometheus endpoints, scraped here, and a run's trace from the span file."""
