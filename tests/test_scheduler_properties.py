"""Scheduler + KV manager under random workloads (pure Python, no model)."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(arrivals, block_size, num_blocks, config, prefix_caching, vocab=5, spec_k=0,
             seed=0):
    """Run the scheduler loop with a fake model that emits token (position % vocab).

    spec_k > 0: before each step, running decodes get up to spec_k speculative tokens,
    right for a random prefix and wrong after it; the fake verifier accepts the right
    prefix and rolls back the rest, as the engine does.
    """
    rng = random.Random(seed)
    clock = FakeClock()
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    sched = Scheduler(config, kv, clock=clock)
    pending = sorted(arrivals, key=lambda a: a[0])
    counter = itertools.count()
    finished: list[Request] = []
    all_requests: list[Request] = []
    for step in range(5000):
        clock.now = step * 0.01
        while pending and pending[0][0] <= step:
            _, prompt, max_tokens = pending.pop(0)
            req = Request(f"r{next(counter)}", prompt, SamplingParams(max_tokens=max_tokens),
                          clock.now, max_tokens)
            all_requests.append(req)
            sched.add_request(req)
        for req in sched.running:
            req.spec_token_ids = []
            room = req.max_tokens - req.num_output_tokens - 1
            if spec_k and req.num_tokens_to_compute == 1 and room > 0:
                k = rng.randint(1, min(spec_k, room))
                right = rng.randint(0, k)
                req.spec_token_ids = [(req.num_tokens + i) % vocab + (vocab if i >= right else 0)
                                      for i in range(k)]
        out = sched.schedule()
        assert out.num_batched_tokens <= config.max_num_batched_tokens
        assert len(sched.running) <= config.max_num_seqs
        for req, num_new in out.scheduled:
            assert num_new >= 1
            assert req.num_computed_tokens + num_new <= req.num_tokens + len(req.spec_token_ids)
            assert len(kv.get_block_table(req.request_id)) * block_size >= (
                req.num_computed_tokens + num_new)
            if req.spec_token_ids:
                assert num_new == 1 + len(req.spec_token_ids)
                accepted = 0
                while (accepted < len(req.spec_token_ids) and
                       req.spec_token_ids[accepted] == (req.num_tokens + accepted) % vocab):
                    accepted += 1
                req.num_computed_tokens += 1 + accepted
                emitted = [(req.num_tokens + i) % vocab for i in range(accepted + 1)]
                req.spec_token_ids = []
            else:
                req.num_computed_tokens += num_new
                emitted = ([req.num_tokens % vocab]
                           if req.num_computed_tokens == req.num_tokens else [])
            for token in emitted:
                req.append_token(token)
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish_request(req, "length")
                    finished.append(req)
                    break
            kv.cache_full_blocks(req)
        sched.check_integrity()
        if not pending and not sched.num_unfinished:
            break
    return kv, sched, finished, all_requests


def check_outcome(arrivals, kv, sched, finished, requests) -> None:
    """Every request finished with exactly its tokens, and the pool is whole."""
    assert len(finished) == len(requests) == len(arrivals)
    for req in finished:
        # The fake model's output is a function of position only, so recompute after
        # preemption (and rollback after speculation) must reproduce it exactly.
        expected = [(req.num_prompt_tokens + i) % 5 for i in range(req.max_tokens)]
        assert req.output_token_ids == expected
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


request_strategy = st.tuples(st.integers(0, 30), st.lists(st.integers(0, 4), min_size=1,
                                                           max_size=60), st.integers(1, 20))


@settings(max_examples=300, deadline=None)
@given(arrivals=st.lists(request_strategy, min_size=1, max_size=12),
       block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(1, 96), max_seqs=st.integers(1, 6),
       chunk_policy=st.sampled_from(["fixed", "dynamic"]), chunk_size=st.integers(1, 40),
       prefix_caching=st.booleans(), starvation=st.integers(0, 3))
def test_random_workloads_finish_within_budget_and_return_every_block(
        arrivals, block_size, budget, max_seqs, chunk_policy, chunk_size, prefix_caching,
        starvation):
    longest = max(len(p) + m for _, p, m in arrivals)
    # Enough blocks for the longest request alone, so every request can finish.
    num_blocks = -(-longest // block_size) + 1
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             chunk_policy=chunk_policy, chunk_size=chunk_size,
                             dynamic_chunk_threshold=8, starvation_queue_threshold=starvation)
    check_outcome(arrivals, *simulate(arrivals, block_size, num_blocks, config, prefix_caching))


@settings(max_examples=150, deadline=None)
@given(arrivals=st.lists(request_strategy, min_size=1, max_size=10),
       block_size=st.sampled_from([1, 4, 16]), budget=st.integers(1, 64),
       max_seqs=st.integers(1, 6), spec_k=st.integers(1, 6), prefix_caching=st.booleans(),
       seed=st.integers(0, 1000))
def test_random_workloads_with_speculation_stay_exact_and_whole(
        arrivals, block_size, budget, max_seqs, spec_k, prefix_caching, seed):
    longest = max(len(p) + m for _, p, m in arrivals)
    # Room for the longest request plus its lookahead slots.
    num_blocks = -(-(longest + spec_k) // block_size) + 1
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, chunk_size=7)
    check_outcome(arrivals, *simulate(arrivals, block_size, num_blocks, config, prefix_caching,
                                      spec_k=spec_k, seed=seed))


def test_decodes_go_first_and_prefills_take_the_rest():
    kv = KVCacheManager(64, 4)
    config = SchedulerConfig(max_num_batched_tokens=10, chunk_size=6)
    sched = Scheduler(config, kv, clock=FakeClock())
    decoding = Request("d", [1, 2, 3], SamplingParams(), 0.0, 16)
    sched.add_request(decoding)
    out = sched.schedule()
    decoding.num_computed_tokens = 3
    decoding.append_token(1)
    long = Request("p", list(range(20)), SamplingParams(), 0.0, 16)
    sched.add_request(long)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("d", 1), ("p", 6)]


def test_starving_queue_puts_prefills_first():
    clock = FakeClock()
    kv = KVCacheManager(64, 4)
    config = SchedulerConfig(max_num_batched_tokens=4, starvation_wait_s=1.0)
    sched = Scheduler(config, kv, clock=clock)
    decoding = Request("d", [1, 2, 3], SamplingParams(), 0.0, 16)
    sched.add_request(decoding)
    sched.schedule()
    decoding.num_computed_tokens = 3
    decoding.append_token(1)
    sched.add_request(Request("w", [5, 6, 7, 8], SamplingParams(), 0.0, 16))
    clock.now = 5.0  # "w" has waited 5 s > 1 s
    out = sched.schedule()
    assert out.prefill_first
    assert [(r.request_id, n) for r, n in out.scheduled] == [("w", 4)]


def test_big_waiting_request_does_not_block_small_ones():
    kv = KVCacheManager(8, 4)
    config = SchedulerConfig(max_num_batched_tokens=64, enable_chunked_prefill=False)
    sched = Scheduler(config, kv, clock=FakeClock())
    holder = Request("holder", list(range(16)), SamplingParams(), 0.0, 4)
    sched.add_request(holder)
    sched.schedule()
    holder.num_computed_tokens = 16
    holder.append_token(0)  # its decode takes a 5th of the 8 blocks
    sched.add_request(Request("big", list(range(20)), SamplingParams(), 0.0, 4))  # needs 5
    sched.add_request(Request("small", [1, 2, 3], SamplingParams(), 0.0, 4))
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["holder", "small"]
    assert [r.request_id for r in sched.waiting] == ["big"]


def test_preemption_victim_is_latest_arrival():
    kv = KVCacheManager(3, 2)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, clock=FakeClock())
    early = Request("early", [1, 2], SamplingParams(), 0.0, 8)
    late = Request("late", [3, 4], SamplingParams(), 1.0, 8)
    for req in (early, late):
        sched.add_request(req)
    sched.schedule()
    for req in (early, late):
        req.num_computed_tokens = 2
        req.append_token(0)
    out = sched.schedule()  # both need a second block; only one is free
    assert [r.request_id for r in out.preempted] == ["late"]
    assert [r.request_id for r, _ in out.scheduled] == ["early"]
    assert sched.num_preemptions == 1
    sched.check_integrity()
