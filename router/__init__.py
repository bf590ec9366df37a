"""KV-cache-aware router: engine registry, block-hash index, placement policy, RouterService."""
