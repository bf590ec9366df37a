"""The TensorRT-LLM backend's translation code, against recorded shapes from TensorRT-LLM's documentation.

TensorRT-LLM itself is not installed here (no GPU; NVIDIA's index only): these tests prove what we do
with what it returns — KV cache event dicts (``KVCacheEventSerializer``), streamed ``RequestOutput``s,
``get_stats`` records — and what we ask of it (``SamplingParams`` keywords). They do not prove that
TensorRT-LLM behaves as documented; docs/gpu.md lists what was never run.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from types import ModuleType, SimpleNamespace

import pytest

from chatmesh.block_hash import BLOCK_HASH_SEED, block_hashes
from chatmesh.model_files import bundled_model_path
from chatmesh.tokenizer import load_tokenizer
from engine.__main__ import parse_args
from engine.backends.hosted import KvUsage
from engine.backends.loading import load_hosted_engine
from engine.backends.trtllm import (
    KvEventTranslator,
    delta_from_output,
    import_tensorrt_llm,
    kv_usage_from_stats,
    sampling_kwargs,
)
from engine.kv_events import BlocksRemoved, BlocksStored, KvEventLog
from engine.model.convert_gguf_to_hf import hf_config
from engine.model.gguf_loader import load_gguf
from engine.request import SamplingParams
from tests.engine.core_helpers import prompt
from tests.engine.test_backend_hosted import trtllm_stored_event

EOS = (2, 0)


def published(events: list[dict], translator: KvEventTranslator | None = None) -> list:
    """What the translator records for ``events``, as our KV events of one batch."""
    log = KvEventLog()
    (translator or KvEventTranslator(16, BLOCK_HASH_SEED)).apply(events, log)
    batch = log.flush()
    return [] if batch is None else list(batch.events)


# -- KV cache events ---------------------------------------------------------------------------------


def test_stored_blocks_are_published_under_our_chained_hashes():
    tokens = prompt(50)  # 3 full blocks
    created = {
        "event_id": 0,
        "window_size": 8192,
        "data": {"type": "created", "num_blocks_per_cache_level": [2231, 0]},
    }
    [stored] = published([created, trtllm_stored_event(1, tokens, None, 9622824665191806685)])
    assert stored == BlocksStored(tuple(block_hashes(tokens)), None)


def test_a_continued_chain_hashes_on_from_its_parent():
    tokens = prompt(64)
    translator = KvEventTranslator(16, BLOCK_HASH_SEED)
    first = trtllm_stored_event(0, tokens[:32], None, 100)  # TensorRT-LLM hashes 100, 101
    second = trtllm_stored_event(1, tokens[32:], 101, 200)  # children of block 101
    events = published([first, second], translator)
    expected = block_hashes(tokens)
    assert events == [
        BlocksStored(tuple(expected[:2]), None),
        BlocksStored(tuple(expected[2:]), expected[1]),
    ]


def test_removed_blocks_are_translated_and_unknown_ones_ignored():
    tokens = prompt(48)
    translator = KvEventTranslator(16, BLOCK_HASH_SEED)
    published([trtllm_stored_event(0, tokens, None, 100)], translator)
    removed = {"event_id": 1, "data": {"type": "removed", "block_hashes": [102, 101, 555]}}
    expected = block_hashes(tokens)
    assert published([removed], translator) == [BlocksRemoved((expected[2], expected[1]))]
    # A removed block's child chain can no longer be followed from it.
    assert published([trtllm_stored_event(2, prompt(16, salt=1), 102, 300)], translator) == []
    assert translator.stats.skipped == 1


def test_updated_events_change_nothing_the_router_sees():
    translator = KvEventTranslator(16, BLOCK_HASH_SEED)
    published([trtllm_stored_event(0, prompt(16), None, 100)], translator)
    updated = {
        "event_id": 1,
        "data": {
            "type": "updated",
            "block_hash": 100,
            "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
            "priority": {"type": "event_diff", "new_value": 35, "old_value": 35},
        },
    }
    assert published([updated], translator) == []


def test_partial_blocks_and_extra_token_ids_are_not_published():
    tokens = prompt(32)
    event = trtllm_stored_event(0, tokens, None, 100)
    event["data"]["blocks"][1]["tokens"][0]["token_extra_id"] = 7  # a multimodal / LoRA extra id
    partial = trtllm_stored_event(1, prompt(32, salt=2), None, 200)
    partial["data"]["blocks"][0]["tokens"] = partial["data"]["blocks"][0]["tokens"][:10]
    translator = KvEventTranslator(16, BLOCK_HASH_SEED)
    assert published([event, partial], translator) == [BlocksStored((block_hashes(tokens)[0],), None)]
    assert translator.stats.skipped == 3


def test_lost_events_clear_everything_published():
    # An event-id gap: TensorRT-LLM's buffer overflowed. The router must not keep blocks that may be gone.
    translator = KvEventTranslator(16, BLOCK_HASH_SEED)
    tokens = prompt(32)
    published([trtllm_stored_event(0, tokens, None, 100)], translator)
    events = published([trtllm_stored_event(5, prompt(16, salt=3), None, 300)], translator)
    assert events == [
        BlocksRemoved(tuple(block_hashes(tokens))),
        BlocksStored(tuple(block_hashes(prompt(16, salt=3))), None),
    ]
    assert translator.stats.resyncs == 1


# -- requests and streamed outputs -------------------------------------------------------------------


def test_greedy_requests_ask_for_top_k_one_without_detokenizing():
    kwargs = sampling_kwargs(SamplingParams(temperature=0.0, seed=7, stop_token_ids=frozenset({5})), EOS, 30)
    assert kwargs == {
        "max_tokens": 30,
        "temperature": None,
        "top_k": 1,
        "top_p": None,
        "seed": 7,
        "end_id": 0,
        "pad_id": 0,
        "stop_token_ids": [0, 2, 5],
        "ignore_eos": False,
        "detokenize": False,
        "return_perf_metrics": True,
    }


def test_sampled_requests_pass_temperature_top_p_top_k_and_may_ignore_eos():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=1, ignore_eos=True)
    kwargs = sampling_kwargs(params, EOS, 8)
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (0.7, 0.9, 40)
    assert (kwargs["stop_token_ids"], kwargs["ignore_eos"]) == (None, True)


def request_output(
    token_ids: list[int], finished: bool, finish_reason: str | None, reused: int | None = None
):
    """A streamed ``RequestOutput`` as the LLM API documents it: cumulative ``outputs[0].token_ids``."""
    perf = (
        None
        if reused is None
        else SimpleNamespace(kv_cache_metrics=SimpleNamespace(num_reused_blocks=reused))
    )
    completion = SimpleNamespace(
        index=0, token_ids=token_ids, finish_reason=finish_reason, request_perf_metrics=perf
    )
    return SimpleNamespace(request_id=1, prompt_token_ids=[1, 2, 3], outputs=[completion], finished=finished)


def test_streamed_outputs_become_deltas_of_new_tokens():
    first = delta_from_output(request_output([11, 12], False, None, reused=2), 0, 16, 40)
    assert (list(first.token_ids), first.finish_reason, first.cached_prompt_tokens) == ([11, 12], None, 32)
    last = delta_from_output(request_output([11, 12, 13], True, "length", reused=2), 2, 16, 40)
    assert (list(last.token_ids), last.finish_reason) == ([13], "length")
    capped = delta_from_output(request_output([11], True, "stop", reused=5), 0, 16, 40)
    assert capped.cached_prompt_tokens == 40  # reuse counts whole blocks; never more than the context
    assert delta_from_output(request_output([11], False, None), 0, 16, 40).cached_prompt_tokens is None


def test_kv_usage_comes_from_the_newest_iteration_stats():
    stats = [
        {
            "iter": 4,
            "kvCacheStats": {
                "maxNumBlocks": 2231,
                "freeNumBlocks": 2200,
                "usedNumBlocks": 31,
                "tokensPerBlock": 16,
            },
        },
        {
            "iter": 5,
            "kvCacheStats": {
                "maxNumBlocks": 2231,
                "freeNumBlocks": 2190,
                "usedNumBlocks": 41,
                "tokensPerBlock": 16,
            },
        },
    ]
    assert kv_usage_from_stats(stats) == KvUsage(41, 2231)
    assert kv_usage_from_stats([{"iter": 6}]) is None


# -- without TensorRT-LLM ----------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed")
def test_without_tensorrt_llm_the_backend_says_how_to_get_it():
    with pytest.raises(RuntimeError, match=r"pypi\.nvidia\.com"):
        import_tensorrt_llm()


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed")
def test_engine_process_with_trtllm_but_no_tensorrt_llm_exits_with_instructions(tmp_path):
    # config.json and tokenizer files only (TensorRT-LLM would read the weights): the engine must fail
    # on the missing library, with instructions, not earlier.
    tok = load_tokenizer()
    (tmp_path / "config.json").write_text(
        json.dumps(hf_config(load_gguf(bundled_model_path()), tok, "float32"))
    )
    tok.save_hf_files(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "engine", "--backend", "trtllm", "--model", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "TensorRT-LLM" in done.stderr and "docs/gpu.md" in done.stderr


# -- what reaches TensorRT-LLM's LLM() -----------------------------------------------------------------


class _StubLLM:
    """Stands in for ``tensorrt_llm.LLM`` (not installable here): records its keyword arguments and
    answers the calls the backend makes while it starts and stops."""

    created: list[dict] = []

    def __init__(self, **kwargs) -> None:
        self.created.append(kwargs)
        self.args = SimpleNamespace(max_seq_len=4096)
        self._closed = threading.Event()

    def get_kv_cache_events(self, timeout):
        self._closed.wait(timeout)
        return []

    def get_stats(self, timeout):
        return []

    def shutdown(self) -> None:
        self._closed.set()


@pytest.fixture
def stub_tensorrt_llm(monkeypatch):
    """A ``tensorrt_llm`` module whose ``LLM`` records what it was given; ``KvCacheConfig`` keeps its kwargs."""
    package, llmapi = ModuleType("tensorrt_llm"), ModuleType("tensorrt_llm.llmapi")
    package.LLM = _StubLLM
    llmapi.KvCacheConfig = lambda **kwargs: SimpleNamespace(**kwargs)
    package.llmapi = llmapi
    monkeypatch.setitem(sys.modules, "tensorrt_llm", package)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    _StubLLM.created = []
    return _StubLLM.created


def _hf_dir(path, **overrides):
    """config.json (SmolLM2's shape, with ``overrides``) and the bundled tokenizer's files."""
    tok = load_tokenizer()
    config = {**hf_config(load_gguf(bundled_model_path()), tok, "float32"), **overrides}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    tok.save_hf_files(path)
    return path


def test_tensor_and_pipeline_parallel_sizes_reach_llm_and_the_architecture_is_tensorrt_llms(
    tmp_path, stub_tensorrt_llm
):
    """A model our CPU loader refuses (another architecture, RoPE scaling) starts on trtllm: TensorRT-LLM
    validates its own model. What the flags say reaches LLM() as TensorRT-LLM's keywords."""
    model = _hf_dir(
        tmp_path / "qwen-like",
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=32768,
        hidden_act="gelu",
    )
    _, config = parse_args(
        ["--backend", "trtllm", "--model", str(model), "--tensor-parallel-size", "4",
         "--pipeline-parallel-size", "2", "--block-size", "32", "--gpu-memory-fraction", "0.85"]
    )  # fmt: skip
    engine = load_hosted_engine(config, model, load_tokenizer(str(model)))  # build_engine's hosted path
    try:
        [kwargs] = stub_tensorrt_llm
        assert kwargs["model"] == str(model)
        assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (4, 2)
        assert kwargs["skip_tokenizer_init"] is True
        kv = kwargs["kv_cache_config"]
        assert (kv.tokens_per_block, kv.free_gpu_memory_fraction, kv.enable_block_reuse) == (32, 0.85, True)
        # What our side keeps: the served name and context window from config.json, TP as reported.
        assert engine.tensor_parallel_size == 4
        assert engine.spec.context_length == 32768
        assert engine.spec.name == load_tokenizer(str(model)).model_name
    finally:
        engine.stop()
        engine.close()


def test_a_model_directory_without_a_context_window_is_refused_naming_the_field(tmp_path, stub_tensorrt_llm):
    config = json.loads(json.dumps(hf_config(load_gguf(bundled_model_path()), load_tokenizer(), "float32")))
    del config["max_position_embeddings"]
    model = _hf_dir(tmp_path / "m")
    (model / "config.json").write_text(json.dumps(config))
    _, engine_config = parse_args(["--backend", "trtllm", "--model", str(model)])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load_hosted_engine(engine_config, model, load_tokenizer(str(model)))
    assert stub_tensorrt_llm == []
