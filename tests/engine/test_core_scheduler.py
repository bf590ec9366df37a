"""Scheduler decisions: token budget, chunked prefill, priority with aging, preemption, displacement."""

import itertools

import pytest

from engine.kv_cache import KVCacheManager
from engine.kv_events import KvEventLog
from engine.request import EngineRequest, Priority, Request, RequestStatus
from engine.scheduler import Scheduler

BS = 4
AGING_S = 10.0
_ids = itertools.count()


def scheduler(num_blocks: int = 64, budget: int = 32, max_running: int = 8, watermark: int = 0) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS, KvEventLog()), budget, max_running, watermark)


def new_request(
    prompt_len: int,
    priority: Priority = Priority.NORMAL,
    arrival: float = 0.0,
    name: str = "",
    max_queue_s: float = 0.0,
) -> Request:
    tokens = tuple(next(_ids) % 1000 + 3 for _ in range(prompt_len))  # unique: no accidental prefix hits
    request = EngineRequest(name or f"r{next(_ids)}", tokens, priority=priority, max_queue_s=max_queue_s)
    return Request(request, arrival, AGING_S)


def step(s: Scheduler) -> dict[str, int]:
    """One step: schedule, 'compute', and sample a token for every sequence that reached its end."""
    out = s.schedule()
    s.update(out)
    for req in out.scheduled:
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(1)
    return {req.request.request_id: n for req, n in out.scheduled.items()}


def test_each_step_hands_out_the_token_budget_decodes_first():
    s = scheduler(budget=32)
    running = [new_request(4, name=f"d{i}") for i in range(3)]
    for req in running:
        s.add(req)
    step(s)  # three 4-token prefills
    s.add(new_request(100, name="long"))
    assert step(s) == {"d0": 1, "d1": 1, "d2": 1, "long": 29}


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget():
    s = scheduler(budget=16)
    s.add(new_request(50, name="long"))
    chunks = [step(s)["long"] for _ in range(4)]
    assert chunks == [16, 16, 16, 2]
    assert step(s) == {"long": 1}, "then it decodes"


def test_decodes_are_scheduled_before_a_running_prefill_chunk_even_of_higher_priority():
    s = scheduler(budget=8)
    s.add(new_request(3, Priority.NORMAL, arrival=0.0, name="talking"))
    assert step(s) == {"talking": 3}
    s.add(new_request(40, Priority.HIGH, arrival=1.0, name="long"))
    assert step(s) == {"talking": 1, "long": 7}
    assert step(s) == {"talking": 1, "long": 7}, "a long prompt never stalls a stream already talking"


def test_new_requests_join_a_running_batch():
    s = scheduler()
    s.add(new_request(4, name="a"))
    step(s)
    step(s)
    s.add(new_request(5, name="b"))
    assert step(s) == {"a": 1, "b": 5}


def test_running_requests_are_capped():
    s = scheduler(max_running=2)
    for i in range(3):
        s.add(new_request(4, name=f"r{i}"))
    assert set(step(s)) == {"r0", "r1"}
    assert s.num_waiting == 1


def test_higher_priority_waits_less():
    s = scheduler(max_running=1)
    s.add(new_request(4, Priority.LOW, arrival=0.0, name="low"))
    s.add(new_request(4, Priority.NORMAL, arrival=1.0, name="normal"))
    s.add(new_request(4, Priority.HIGH, arrival=2.0, name="high"))
    assert set(step(s)) == {"high"}


def test_aging_lets_a_long_waiting_low_request_go_before_a_new_high_one():
    s = scheduler(max_running=1)
    s.add(new_request(4, Priority.LOW, arrival=0.0, name="low"))
    s.add(new_request(4, Priority.HIGH, arrival=2 * AGING_S + 1, name="high"))
    assert set(step(s)) == {"low"}


def test_a_low_request_is_not_starved_by_a_stream_of_high_ones():
    s = scheduler(max_running=1)
    s.add(new_request(4, Priority.LOW, arrival=0.0, name="low"))
    order = []
    for t in range(60):  # a HIGH request arrives every second; each one runs for one step
        s.add(new_request(4, Priority.HIGH, arrival=float(t), name=f"high@{t}"))
        [name] = step(s)
        order.append(name)
        s.finish(s.running[0])
    position = order.index("low")
    assert position <= 2 * AGING_S + 1
    assert all(int(name[5:]) <= 2 * AGING_S for name in order[:position])


def test_when_blocks_run_out_the_lowest_priority_newest_request_is_preempted():
    s = scheduler(num_blocks=7, budget=64)
    a = new_request(7, Priority.NORMAL, arrival=0.0, name="a")
    b = new_request(7, Priority.LOW, arrival=1.0, name="b")
    c = new_request(7, Priority.NORMAL, arrival=2.0, name="c")
    for req in (a, b, c):
        s.add(req)
    step(s)  # 6 blocks used: each holds 8 token slots, 7 used + 1 sampled
    assert s.kv.num_used_blocks == 6
    step(s)  # every one needs a 3rd block on the next token; only one is free
    out = s.schedule()
    assert out.preempted[0] is b
    assert b.status is RequestStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert s.num_preemptions >= 1


def test_between_equal_priorities_the_newest_is_preempted():
    s = scheduler(num_blocks=4, budget=64)
    old, new = new_request(7, arrival=0.0, name="old"), new_request(7, arrival=1.0, name="new")
    s.add(old)
    s.add(new)
    step(s)  # prompts: 2 blocks each, all 4 used
    step(s)  # the sampled 8th token still fits
    step(s)  # both need a third block for the 9th; the old one gets the new one's
    assert old.status is RequestStatus.RUNNING and new.status is RequestStatus.WAITING


def test_nothing_new_is_admitted_in_a_step_that_preempted():
    s = scheduler(num_blocks=4, budget=64)
    old, new = new_request(7, arrival=0.0, name="old"), new_request(7, arrival=1.0, name="new")
    s.add(old)
    s.add(new)
    step(s)
    step(s)
    s.add(new_request(1, Priority.HIGH, arrival=2.0, name="tiny"))  # would fit in the block `new` frees
    out = s.schedule()
    assert out.preempted == [new]
    assert {req.request.request_id for req in out.scheduled} == {"old"}


def test_a_preempted_request_resumes_and_completes_its_prompt_again():
    s = scheduler(num_blocks=4, budget=64)
    old, new = new_request(7, arrival=0.0, name="old"), new_request(7, arrival=1.0, name="new")
    s.add(old)
    s.add(new)
    for _ in range(3):
        step(s)
    assert new.status is RequestStatus.WAITING
    s.finish(old)
    # Preemption evicted its last block for `old`; its first block is still cached, the rest is recomputed
    # (prompt and the two tokens it had sampled: 9 tokens known, 4 of them cached).
    assert step(s) == {"new": 5}
    assert new.num_computed_tokens == new.num_tokens - 1


def test_a_higher_priority_request_displaces_a_running_lower_one_when_slots_are_full():
    s = scheduler(max_running=1)
    low = new_request(4, Priority.LOW, arrival=0.0, name="low")
    s.add(low)
    step(s)
    s.add(new_request(4, Priority.HIGH, arrival=1.0, name="high"))
    assert step(s) == {"high": 4}
    assert low.status is RequestStatus.WAITING and low.block_table == []


def test_an_equal_priority_newcomer_does_not_displace_anyone():
    s = scheduler(max_running=1)
    s.add(new_request(4, arrival=0.0, name="first"))
    step(s)
    s.add(new_request(4, arrival=1.0, name="second"))
    assert step(s) == {"first": 1}


def test_finish_frees_blocks_at_once_from_running_or_waiting():
    s = scheduler(max_running=1)
    running, waiting = new_request(9, name="running"), new_request(9, name="waiting")
    s.add(running)
    s.add(waiting)
    step(s)
    assert s.kv.num_used_blocks == 3
    s.finish(running)
    s.finish(waiting)
    assert s.kv.num_used_blocks == 0 and not s.running and s.num_waiting == 0
    assert not s.has_work() and step(s) == {}


def test_the_first_request_may_use_every_block_despite_the_watermark():
    s = scheduler(num_blocks=4, watermark=1)
    s.add(new_request(16, name="first"))
    assert step(s) == {"first": 16}


@pytest.mark.parametrize(("watermark", "admitted"), [(1, False), (0, True)])
def test_the_watermark_keeps_blocks_free_for_running_requests(watermark, admitted):
    s = scheduler(num_blocks=6, watermark=watermark)
    s.add(new_request(3, name="a"))
    step(s)
    s.add(new_request(8, name="b"))
    step(s)
    step(s)  # a and b each grew by a block: 5 used, 1 free, and the next tokens fit in their blocks
    s.add(new_request(4, name="c"))  # needs that last free block
    out = s.schedule()
    assert not out.preempted
    assert ("c" in {req.request.request_id for req in out.scheduled}) is admitted


def test_a_request_never_scheduled_expires_at_its_queue_limit_and_one_without_a_limit_waits_on():
    s = scheduler(max_running=1)
    s.add(new_request(4, Priority.HIGH, arrival=0.0, name="busy"))
    step(s)
    limited = new_request(4, Priority.LOW, arrival=1.0, name="limited", max_queue_s=2.0)
    patient = new_request(4, Priority.LOW, arrival=1.0, name="patient")
    s.add(limited)
    s.add(patient)
    step(s)
    assert s.expire(2.9) == []
    assert s.expire(3.0) == [limited]
    assert s.expire(100.0) == [], "each request expires once"
    s.finish(limited)
    assert s.num_waiting == 1 and patient.status is RequestStatus.WAITING


def test_a_request_scheduled_once_never_expires_even_when_preempted_back_to_waiting():
    s = scheduler(max_running=1)
    low = new_request(4, Priority.LOW, arrival=0.0, name="low", max_queue_s=1.0)
    s.add(low)
    step(s)
    s.add(new_request(4, Priority.HIGH, arrival=0.5, name="high"))
    step(s)  # displaces `low` back to the queue
    assert low.status is RequestStatus.WAITING
    assert s.expire(50.0) == []


def test_the_prompt_tokens_still_to_compute_count_running_prefills_and_waiting_prompts_beyond_the_cache():
    s = scheduler(budget=16)
    first = new_request(20, name="first")
    s.add(first)
    assert s.prefill_tokens == 20
    step(s)  # 16 of its 20
    assert s.prefill_tokens == 4
    step(s)  # the last 4: it decodes now (one token to compute each step, not a prefill)
    assert s.prefill_tokens == 0
    # A request sharing its first 16 tokens (4 cached blocks) waits for 4 + 6 of its own.
    shared = EngineRequest("shared", (*first.token_ids[:16], 901, 902, 903, 904, 905, 906))
    s.add(Request(shared, 0.0, AGING_S))
    other = new_request(12, name="other")
    s.add(other)
    assert s.prefill_tokens == 6 + 12
    s.finish(other)  # a waiting request cancelled takes its tokens out
    assert s.prefill_tokens == 6
