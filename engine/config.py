"""Engine configuration: one dataclass whose settings are the ``python -m engine`` flags (meshkit.config)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from chatmesh.block_hash import BLOCK_HASH_SEED, DEFAULT_BLOCK_SIZE
from meshkit.config import setting

BACKENDS = ("cpu", "null", "cuda", "trtllm", "triton")
HOSTED_BACKENDS = ("trtllm", "triton")  # engines with their own scheduler and KV cache (engine.backends)
# Backends that shard a model over ranks themselves, and how each is launched (docs/gpu.md): cpu starts
# its own rank processes; cuda ranks are torchrun's (its world size); trtllm's LLM API spawns its MPI
# workers on one node, or joins the ranks `mpirun ... trtllm-llmapi-launch` started across nodes.
TENSOR_PARALLEL_BACKENDS = ("cpu", "cuda", "trtllm")
PIPELINE_PARALLEL_BACKENDS = ("trtllm",)


def _model_path(flag: str) -> Path | None:
    return Path(flag) if flag else None


@dataclass(frozen=True)
class EngineConfig:
    engine_id: str = setting("engine-0", "name of this replica in logs and metrics")
    backend: str = setting(
        "cpu",
        "cpu (the real model) | null (no compute: mesh load tests) | cuda | trtllm | triton (GPU: docs/gpu.md)",
    )
    model_path: Path | None = setting(
        None,
        "model path: a GGUF file or a Hugging Face directory; empty: the bundled SmolLM2-135M-Instruct",
        flag="model",
        flag_default="",
        parse=_model_path,
    )
    served_model_name: str = setting(
        "",
        "the model name this engine serves under (its pool at the router); empty: the weights' own name. "
        "Name a cheaper configuration of the same weights apart, e.g. SmolLM2-135M-Instruct-lite",
    )
    num_threads: int = setting(
        0, "compute threads of the cpu backend, per rank (0: its default)", flag="threads"
    )
    tensor_parallel_size: int = setting(
        1,
        "shard each layer over this many ranks: cpu (processes, at most the model's KV heads), cuda (torchrun's "
        "world size), trtllm (GPUs, TensorRT-LLM's tensor_parallel_size)",
    )
    pipeline_parallel_size: int = setting(
        1, "trtllm: split the layers over this many stages (TensorRT-LLM's pipeline_parallel_size)"
    )
    null_tokens_per_s: float = setting(50.0, "null backend: tokens per second per stream (0: unpaced)")
    # Scripts the null backend's output (a tool call, for tests of tool steps that must not depend on a
    # model choosing to call one); empty: its default text.
    null_text: str = setting("", "null backend: the text its output cycles through (default: a pangram)")
    gpu_memory_fraction: float = setting(0.9, "trtllm: share of free GPU memory for the KV cache")
    triton_url: str = setting("127.0.0.1:8001", "triton: the Triton server's gRPC host:port")
    triton_model: str = setting("tensorrt_llm", "triton: name of the decoupled TensorRT-LLM model")
    triton_timeout_s: float = setting(60.0, "triton: longest wait for the next streamed response")

    # KV cache
    block_size: int = setting(
        DEFAULT_BLOCK_SIZE, "tokens per KV block (the unit of prefix caching and block hashes)"
    )
    block_hash_seed: int = BLOCK_HASH_SEED
    num_kv_blocks: int = setting(0, "KV blocks in the pool (0: as many as --kv-memory-gib holds)")
    kv_memory_gib: float = setting(0.5, "memory for KV blocks when --num-kv-blocks is 0")
    enable_prefix_caching: bool = setting(True, "reuse cached KV blocks of equal prefixes")
    kv_events_buffer: int = 1024  # batches a KvEvents subscriber may lag before its stream is ended

    # Scheduler
    max_batched_tokens: int = setting(512, "token budget of one scheduler step (prefill chunks + decodes)")
    max_running_requests: int = setting(64, "requests decoded together at most")
    max_waiting_requests: int = setting(256, "queue bound; beyond it RESOURCE_EXHAUSTED")
    priority_aging_s: float = setting(10.0, "waiting this long counts as one priority level")

    # Speculative decoding (engine.speculation)
    speculative_tokens: int = setting(
        0,
        "prompt-lookup speculative decoding: draft tokens a request verifies per step at most, taken from "
        "what followed the latest match of its last tokens in its prompt and output (0: off)",
    )
    speculative_max_batch: int = setting(
        4,
        "speculate only while at most this many requests run or wait (bigger batches are compute-bound)",
    )

    def __post_init__(self) -> None:
        problems = []
        if self.backend not in BACKENDS:
            problems.append(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        problems += _parallelism_problems(
            self.backend, self.tensor_parallel_size, self.pipeline_parallel_size
        )
        if self.block_size <= 0:
            problems.append("block size must be positive")
        if self.num_kv_blocks < 0 or self.kv_memory_gib <= 0:
            problems.append("num KV blocks must be >= 0 and the KV memory budget > 0")
        if self.max_running_requests <= 0 or self.max_waiting_requests <= 0:
            problems.append("max running and max waiting requests must be > 0")
        # Every running request must be able to decode in every step, or the last ones in line starve.
        if self.max_batched_tokens < self.max_running_requests:
            problems.append(
                f"max batched tokens ({self.max_batched_tokens}) must be >= max running requests "
                f"({self.max_running_requests})"
            )
        if not 0 < self.gpu_memory_fraction <= 1 or self.triton_timeout_s <= 0:
            problems.append("gpu memory fraction must be in (0, 1] and the Triton timeout positive")
        if self.priority_aging_s <= 0 or self.null_tokens_per_s < 0 or self.kv_events_buffer <= 0:
            problems.append("priority aging, null token rate and KV event buffer must be positive")
        if self.speculative_tokens < 0 or self.speculative_max_batch < 1:
            problems.append("speculative tokens must be >= 0 and the speculative max batch >= 1")
        if self.speculative_tokens and self.backend in HOSTED_BACKENDS:
            problems.append(
                f"--speculative-tokens needs the engine's own scheduler; --backend {self.backend} has its own"
            )
        if problems:
            raise ValueError("invalid engine configuration: " + "; ".join(problems))


def _parallelism_problems(backend: str, tp: int, pp: int) -> list[str]:
    if tp < 1 or pp < 1:
        return [f"tensor and pipeline parallel sizes must be >= 1, got {tp} and {pp}"]
    problems = []
    if tp > 1 and backend not in TENSOR_PARALLEL_BACKENDS:
        why = (
            "the Triton server shards the model (launch_triton_server.py --world_size); this engine is its client"
            if backend == "triton"
            else "it computes no model"
        )
        problems.append(
            f"--backend {backend} runs no tensor parallelism ({why}), got tensor parallel size {tp}"
        )
    if pp > 1 and backend not in PIPELINE_PARALLEL_BACKENDS:
        problems.append(f"pipeline parallelism is trtllm's only, got {pp} on --backend {backend}")
    return problems
