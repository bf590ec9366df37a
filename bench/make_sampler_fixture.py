"""Writes tests/data/sampler_draws.json: the token the sampler draws for each row of
tests/fixtures/sampler_cases.py's fixed logits, at each of its settings and output positions.

tests/engine/test_core_sampler.py holds today's sampler to these tokens: a faster sampler must draw the
same token for the same (seed, position, logits). The committed file was written by the per-row numpy
sampler of commit e55cdb8, before the sampler was reworked for speed; regenerate it only for a change
that means to alter the draws (and say so in its commit):

    .venv/bin/python bench/make_sampler_fixture.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sampler import sample
from tests.fixtures.sampler_cases import OUTPUT, PARAMS, POSITIONS, logit_rows

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "sampler_draws.json"


def main() -> None:
    rows = logit_rows()
    draws = [
        [
            sample(rows, [params] * len(rows), [position] * len(rows), [OUTPUT] * len(rows))
            for position in POSITIONS
        ]
        for params in PARAMS
    ]
    OUT.write_text(json.dumps({"draws": draws}) + "\n")
    print(f"wrote {OUT}: {len(PARAMS)} settings x {len(POSITIONS)} positions x {len(rows)} rows")


if __name__ == "__main__":
    main()
