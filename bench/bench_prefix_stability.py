"""How much of each turn's prompt an engine already holds, over a long chat: per-turn cuts vs steps.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_prefix_stability.py [--turns 60] [--json out.json]

A chat of ``--turns`` exchanges (a user message and an answer of the given token lengths, the seeds'
long chats) is assembled turn after turn by the orchestrator's own code: ``fit_prompt`` with the real
SmolLM2 tokenizer and chat template, and the rolling-summary policy of ``orchestrator.upkeep.summaries``
(``needs_refresh``, ``split_for_summary``). The engine side is the engine's prefix cache as
``engine/kv_cache.py`` keeps it: every full block of every prompt *and* of its answer (the answer's ids
are the tokenizer's encoding of its text, i.e. the model emitted canonical tokens) is cached, with
``chatmesh.block_hash``; nothing is evicted (one chat on a warm engine). A turn's hit rate is its prompt
tokens in cached leading blocks over its prompt tokens.

What is simulated rather than run: the texts are synthetic (random words of the stated token lengths)
and a summary is a synthetic text of the summary's full ``max_tokens`` length (its words do not change
where the prompt's prefix breaks, only its length does). A summary lands before the next turn
(``--summary-lag`` turns later otherwise: the turns in between are cut by ``fit_prompt`` alone).

Policies side by side, each under the same chat:
- ``per-turn`` (the defaults before this change): summary at 0.6 of the budget keeping 0.3, and a
  history that does not fit loses its oldest turn each turn;
- ``stepped`` (today's defaults, ``PromptConfig``/``SummaryConfig``: a summary at 0.75 keeping 0.25,
  cuts in steps of 0.35 of the budget);
- each with summaries off, where only ``fit_prompt``'s cuts keep a long chat in the window.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402
from chatmesh.block_hash import DEFAULT_BLOCK_SIZE, block_hashes  # noqa: E402
from chatmesh.model_files import bundled_model_path  # noqa: E402
from chatmesh.tokenizer import ChatMessage, ChatTokenizer, EncodedTexts, load_tokenizer  # noqa: E402
from memory_store.models import Message, Role  # noqa: E402
from orchestrator.config import DEFAULT_SYSTEM_PROMPT, PromptConfig, SummaryConfig  # noqa: E402
from orchestrator.prompting.prompt import fit_prompt  # noqa: E402
from orchestrator.upkeep.summaries import needs_refresh, split_for_summary  # noqa: E402

# Words the synthetic messages are drawn from (their tokens, not their sense, matter here).
VOCABULARY = (
    "the of and to in is that for it as with was on be by this are from at or an have not which but "
    "model cache engine router token prompt answer history summary chat user request latency budget "
    "window block prefix memory replica stream placement question because however therefore example"
)
WORDS = VOCABULARY.split()


@dataclass(frozen=True)
class Policy:
    name: str
    summaries: bool
    trigger_fraction: float
    keep_fraction: float
    step_fraction: float


def policies() -> list[Policy]:
    prompt, summary = PromptConfig(), SummaryConfig()
    per_turn = Policy("per-turn", True, 0.6, 0.3, 0.0)
    stepped = Policy("stepped", True, summary.trigger_fraction, summary.keep_fraction, prompt.truncation_step)
    return [
        per_turn,
        stepped,
        dataclasses.replace(per_turn, name="per-turn, no summaries", summaries=False),
        dataclasses.replace(stepped, name="stepped, no summaries", summaries=False),
    ]


def text_of(tokenizer: ChatTokenizer, tokens: int, rng: random.Random) -> str:
    words: list[str] = []
    while len(words) < tokens * 2 and len(tokenizer.encode(" ".join(words))) < tokens:
        words.extend(rng.choice(WORDS) for _ in range(8))
    return " ".join(words)


@dataclass(frozen=True)
class ChatResult:
    rates: list[float]  # per turn after the first: prompt tokens in cached blocks / prompt tokens
    hit_tokens: int  # over the turns after the first
    prompt_tokens: int
    summaries: int
    mean_prompt: int
    # CPU milliseconds ``fit_prompt`` took each turn (what a send's prompt assembly costs the orchestrator).
    fit_ms: list[float]


def run_chat(tokenizer: ChatTokenizer, policy: Policy, args: argparse.Namespace) -> ChatResult:
    rng = random.Random(args.seed)
    budget = args.context_window - args.max_tokens
    config = SummaryConfig(trigger_fraction=policy.trigger_fraction, keep_fraction=policy.keep_fraction)
    step_tokens = int(policy.step_fraction * budget)
    system = [ChatMessage("system", DEFAULT_SYSTEM_PROMPT)]
    messages: list[Message] = []  # the branch after the summary, as the orchestrator reads it
    summary: str | None = None
    pending: tuple[int, list[Message]] | None = None  # (turn it lands at, messages it covers)
    cached: set[int] = set()
    rates: list[float] = []
    lengths: list[int] = []
    hit_tokens = prompt_tokens = 0
    summaries = 0
    fit_ms: list[float] = []
    # What the orchestrator keeps of earlier prompts (``Prompter``).
    recent = EncodedTexts(PromptConfig().encoded_cache_tokens)
    for turn in range(args.turns):
        if pending and pending[0] <= turn:
            covered = pending[1]
            messages = messages[len(covered) :]
            summary = text_of(tokenizer, args.summary_tokens, rng)
            summaries += 1
            pending = None
        question = text_of(tokenizer, args.user_tokens, rng)
        chat = [ChatMessage(m.role.value, m.content) for m in messages] + [ChatMessage("user", question)]
        started = time.process_time()
        prompt = fit_prompt(tokenizer, system, chat, budget, summary, step_tokens, recent)
        fit_ms.append((time.process_time() - started) * 1000)
        hashes = block_hashes(prompt.token_ids, DEFAULT_BLOCK_SIZE)
        hit_blocks = 0
        for block_hash in hashes:
            if block_hash not in cached:
                break
            hit_blocks += 1
        if turn > 0:
            rates.append(hit_blocks * DEFAULT_BLOCK_SIZE / len(prompt.token_ids))
            hit_tokens += hit_blocks * DEFAULT_BLOCK_SIZE
            prompt_tokens += len(prompt.token_ids)
        lengths.append(len(prompt.token_ids))
        answer = text_of(tokenizer, args.answer_tokens, rng)
        cached.update(block_hashes(prompt.token_ids + tokenizer.encode(answer), DEFAULT_BLOCK_SIZE))
        for role, content in ((Role.USER, question), (Role.ASSISTANT, answer)):
            messages.append(
                Message(str(uuid.uuid4()), "chat", role, content, token_count=len(tokenizer.encode(content)))
            )
        if policy.summaries and pending is None and needs_refresh(prompt, config):
            older, _ = split_for_summary(messages, tokenizer, int(config.keep_fraction * budget))
            if older:
                pending = (turn + 1 + args.summary_lag, older)
    return ChatResult(rates, hit_tokens, prompt_tokens, summaries, int(statistics.mean(lengths)), fit_ms)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=60, help="exchanges in the chat")
    parser.add_argument("--user-tokens", type=int, default=150)
    parser.add_argument("--answer-tokens", type=int, default=350)
    parser.add_argument("--context-window", type=int, default=8192, help="SmolLM2-135M's window")
    parser.add_argument("--max-tokens", type=int, default=512, help="answer budget (the default max_tokens)")
    parser.add_argument("--summary-tokens", type=int, default=SummaryConfig().max_tokens)
    parser.add_argument("--summary-lag", type=int, default=0, help="turns before a summary lands")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    tokenizer = load_tokenizer(str(bundled_model_path()))
    print(f"machine: {machine()}")
    print(
        f"workload: one chat of {args.turns} exchanges ({args.user_tokens} + {args.answer_tokens} tokens), "
        f"window {args.context_window}, max_tokens {args.max_tokens}, summary {args.summary_tokens} tokens "
        f"landing {args.summary_lag} turn(s) later, block {DEFAULT_BLOCK_SIZE}"
    )
    print(
        f"{'policy':<24} {'hit (tokens)':>12} {'mean/turn':>9} {'p10':>6} {'summaries':>9} {'prompt':>7} "
        f"{'fit ms p50/max':>15}  (fit: CPU ms to assemble a turn's prompt)"
    )
    results = []
    for policy in policies():
        result = run_chat(tokenizer, policy, args)
        by_tokens = result.hit_tokens / result.prompt_tokens
        p10 = statistics.quantiles(result.rates, n=10)[0]
        results.append({"policy": policy.name, "hit_by_tokens": by_tokens} | dataclasses.asdict(result))
        print(
            f"{policy.name:<24} {by_tokens:>12.3f} {statistics.mean(result.rates):>9.3f} {p10:>6.3f} "
            f"{result.summaries:>9} {result.mean_prompt:>7} "
            f"{statistics.median(result.fit_ms):>7.1f}/{max(result.fit_ms):<7.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}))


if __name__ == "__main__":
    main()
