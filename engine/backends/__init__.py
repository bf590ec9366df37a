"""Hosted engine backends: engines with their own scheduler and KV cache (TensorRT-LLM, Triton) behind our
EngineService. Importing this package needs neither tensorrt_llm nor tritonclient."""
