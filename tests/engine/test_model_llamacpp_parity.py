"""The runner's next-token logits against llama.cpp's on the same GGUF (tests/data/llamacpp_logits.json,
written by bench/make_llamacpp_fixture.py, so this test needs no llama.cpp).

llama.cpp multiplies Q4_1 weights by activations it first rounds to 8 bits, we keep activations in
float32: logits differ by up to ~0.3 (measured max 0.19 over the fixture's top-20 logits). The
test allows LOGIT_TOL = 0.5 and requires the same five most likely tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from chatmesh.model_files import bundled_model_path
from engine.model.paged_driver import PagedDriver

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "llamacpp_logits.json"
LOGIT_TOL = 0.5


@pytest.fixture(scope="module")
def llamacpp() -> dict:
    data = json.loads(FIXTURE.read_text())
    assert data["model_file"] == bundled_model_path().name
    return data


def test_next_token_logits_agree_with_llama_cpp(cpu_runner, llamacpp):
    prompts = [case["prompt_token_ids"] for case in llamacpp["cases"]]
    gens = PagedDriver(cpu_runner, num_blocks=64, shuffle_seed=11).generate(prompts, 1, keep_logits=True)
    for case, gen in zip(llamacpp["cases"], gens, strict=True):
        ours = gen.logits[0]
        theirs_ids = np.array(case["top_token_ids"])
        np.testing.assert_allclose(ours[theirs_ids], case["top_logits"], atol=LOGIT_TOL, rtol=0)
        assert set(np.argsort(-ours)[:5].tolist()) == set(theirs_ids[:5].tolist())
