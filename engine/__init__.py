"""Inference engine: paged KV cache, continuous-batching scheduler, model runners, EngineService."""
