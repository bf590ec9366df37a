"""A real ``python -m engine --backend cpu --model <tiny family GGUF>`` process per family over real gRPC: the
engine starts on Llama 3, Qwen2, Qwen3 and Mistral files (tests/fixtures/family_ggufs.py) and its first
greedy token is llama.cpp's likeliest (tests/data/family_llamacpp.json), or one within twice the logits'
tolerance of it (test_model_families.py; random weights make near-ties: Q8_0 qwen2's widest gap is 0.37)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.tokenizer import ChatTokenizer
from tests.engine.service_client import TIMEOUT_S, Stream, engine_stub, start_frame
from tests.engine.test_model_families import FIXTURE, tolerance
from tests.fixtures.family_ggufs import FAMILIES, write_family_gguf


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_the_engine_serves_the_family_and_greedy_starts_with_llama_cpps_token(
    tmp_path: Path, start_engines, family: str
) -> None:
    path = write_family_gguf(FAMILIES[family], tmp_path / f"{family}.gguf")
    cases = json.loads(FIXTURE.read_text())["families"][family]["cases"]
    case = max(cases, key=lambda c: c["top_logits"][0] - c["top_logits"][1])  # the least tied
    [engine] = start_engines(1, "cpu", model=path)
    async with engine_stub(engine.address) as stub:
        info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT_S)
        assert info.model == ChatTokenizer.from_gguf(path).model_name
        outcome = await Stream.start(stub, start_frame(family, case["prompt_token_ids"], max_tokens=3)).rest()
    theirs = dict(zip(case["top_token_ids"], case["top_logits"], strict=True))
    assert theirs.get(outcome.token_ids[0], -1e9) >= case["top_logits"][0] - 2 * tolerance(family)
    assert len(outcome.token_ids) == 3
