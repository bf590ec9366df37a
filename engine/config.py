"""Engine configuration: one dataclass, filled from the ``python -m engine`` flags (see ``__main__``)."""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

from chatmesh.block_hash import BLOCK_HASH_SEED, DEFAULT_BLOCK_SIZE

BACKENDS = ("cpu", "null", "cuda", "trtllm", "triton")
HOSTED_BACKENDS = ("trtllm", "triton")  # engines with their own scheduler and KV cache (engine.backends)


@dataclass(frozen=True)
class EngineConfig:
    engine_id: str = "engine-0"
    backend: str = "cpu"
    model_path: Path | None = None  # None: the bundled SmolLM2 GGUF
    num_threads: int = 0  # compute threads of the cpu runner (per rank); 0: its own default
    tensor_parallel_size: int = 1  # cpu backend: ranks (processes) the model is sharded over
    null_tokens_per_s: float = 50.0  # null backend: decode steps (tokens per stream) per second; 0: unpaced
    gpu_memory_fraction: float = 0.9  # trtllm: share of free GPU memory its KV cache takes
    triton_url: str = "127.0.0.1:8001"  # triton: the server's gRPC endpoint
    triton_model: str = "tensorrt_llm"  # triton: the decoupled TensorRT-LLM model to call
    triton_timeout_s: float = 60.0  # triton: longest wait for the next streamed response

    # KV cache
    block_size: int = DEFAULT_BLOCK_SIZE
    block_hash_seed: int = BLOCK_HASH_SEED
    num_kv_blocks: int = 0  # 0: as many as kv_memory_gib holds
    kv_memory_gib: float = 0.5
    enable_prefix_caching: bool = True
    kv_events_buffer: int = 1024  # batches a KvEvents subscriber may lag before its stream is ended

    # Scheduler
    max_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    max_running_requests: int = 64
    max_waiting_requests: int = 256  # beyond it new requests get RESOURCE_EXHAUSTED
    priority_aging_s: float = 10.0  # a request outranks one priority level above it after this much waiting

    def __post_init__(self) -> None:
        problems = []
        if self.backend not in BACKENDS:
            problems.append(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.tensor_parallel_size < 1 or (self.tensor_parallel_size > 1 and self.backend != "cpu"):
            problems.append(
                f"tensor parallel size must be 1, or > 1 on the cpu backend, got {self.tensor_parallel_size}"
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
        if problems:
            raise ValueError("invalid engine configuration: " + "; ".join(problems))

    @classmethod
    def from_args(cls, args: Namespace) -> EngineConfig:
        return cls(
            engine_id=args.engine_id,
            backend=args.backend,
            model_path=Path(args.model) if args.model else None,
            num_threads=args.threads,
            tensor_parallel_size=args.tensor_parallel_size,
            null_tokens_per_s=args.null_tokens_per_s,
            gpu_memory_fraction=args.gpu_memory_fraction,
            triton_url=args.triton_url,
            triton_model=args.triton_model,
            triton_timeout_s=args.triton_timeout_s,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_memory_gib=args.kv_memory_gib,
            enable_prefix_caching=args.enable_prefix_caching,
            max_batched_tokens=args.max_batched_tokens,
            max_running_requests=args.max_running_requests,
            max_waiting_requests=args.max_waiting_requests,
            priority_aging_s=args.priority_aging_s,
        )
