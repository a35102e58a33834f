"""Cached prompt tokens after preemption and resume, against specs/engine_statistics.md.

``AdmissionLog`` watches the KV cache manager from outside the scheduler:
each ``get_computed_blocks`` answer (the prefix hit) and whether the
following ``allocate_slots`` admitted the request, with how many tokens the
request had sampled by then. From that log alone the spec's rules give:

- ``num_cached_tokens`` (vLLM's ``PrefillStats``): the hit of the last
  admission before the first output token;
- kvref's ``SchedulerStats.prompt_tokens_cached``: ``min(hit, prompt)`` summed
  over every admission, resumes after the first token included;
- ``prompt_tokens_computed``: the prompt positions of every scheduled chunk
  (watched on each ``SchedulerOutput``).

Workloads run on tiny pools, so requests are preempted both before and after
their first token and resume on a hit of their own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvref import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager
from kvref.engine import LLM, ModelFreeRunner, SamplingParams, Scheduler, engine_step

from .hf_models import llama, reference

BLOCK = 4


@dataclass
class Admission:
    req_id: str
    hit: int
    num_output_tokens: int           # sampled before this admission
    num_prompt_tokens: int


@dataclass
class AdmissionLog:
    admissions: list[Admission] = field(default_factory=list)
    prompt_positions_computed: int = 0
    _pending: dict[str, tuple[int, int]] = field(default_factory=dict)

    def watch(self, scheduler) -> "AdmissionLog":
        manager = scheduler.kv_cache_manager
        get_computed_blocks, allocate_slots = manager.get_computed_blocks, manager.allocate_slots
        schedule = scheduler.schedule

        def watched_get_computed_blocks(request):
            blocks, num_hit = get_computed_blocks(request)
            self._pending[request.request_id] = (num_hit, len(request.output_token_ids))
            return blocks, num_hit

        def watched_allocate_slots(request, *args, **kwargs):
            result = allocate_slots(request, *args, **kwargs)
            if result is not None and request.request_id in self._pending:
                hit, num_out = self._pending.pop(request.request_id)
                self.admissions.append(Admission(request.request_id, hit, num_out,
                                                 request.num_prompt_tokens))
            return result

        def watched_schedule(*args, **kwargs):
            output = schedule(*args, **kwargs)
            starts = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
            cached = output.scheduled_cached_reqs
            starts.update(zip(cached.req_ids, cached.num_computed_tokens))
            for req_id, n in output.num_scheduled_tokens.items():
                prompt = scheduler.requests[req_id].num_prompt_tokens
                self.prompt_positions_computed += max(0, min(starts[req_id] + n, prompt)
                                                      - starts[req_id])
            return output

        manager.get_computed_blocks = watched_get_computed_blocks
        manager.allocate_slots = watched_allocate_slots
        scheduler.schedule = watched_schedule
        return self

    # -- the spec's rules ---------------------------------------------------------

    def num_cached_tokens(self, req_id: str) -> int:
        """Section 1: the hit of the last admission before the first output."""
        before = [a.hit for a in self.admissions
                  if a.req_id == req_id and a.num_output_tokens == 0]
        return before[-1]

    def prompt_tokens_cached(self) -> int:
        """Section 3: every admission's hit, its prompt part."""
        return sum(min(a.hit, a.num_prompt_tokens) for a in self.admissions)


def make_scheduler(num_blocks: int, budget: int, enable_caching: bool = True,
                   max_model_len: int = 48) -> Scheduler:
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["l0"], FullAttentionSpec(BLOCK))])
    manager = KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK, enable_caching=enable_caching,
                             log_stats=True)
    return Scheduler(manager, max_num_batched_tokens=budget)


def check_against_the_spec(scheduler, log: AdmissionLog, requests) -> None:
    stats = scheduler.stats
    for request in requests:
        expected = log.num_cached_tokens(request.request_id)
        assert request.num_cached_tokens == expected, request.request_id
        assert 0 <= expected <= request.num_prompt_tokens - 1
        assert expected % BLOCK == 0
    assert stats.prompt_tokens_cached == log.prompt_tokens_cached()
    assert stats.prompt_tokens_computed == log.prompt_positions_computed
    total_prompt = sum(r.num_prompt_tokens for r in requests)
    covered = stats.prompt_tokens_cached + stats.prompt_tokens_computed
    assert total_prompt <= covered <= sum(a.num_prompt_tokens for a in log.admissions)
    if stats.num_preemptions == 0:
        assert stats.prompt_tokens_cached == sum(r.num_cached_tokens for r in requests)
        assert covered == total_prompt


COVERAGE = {"resumed_after_first_token_with_hit": 0, "readmitted_before_first_token": 0}


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(data=st.data(), num_blocks=st.integers(6, 14), budget=st.integers(3, 12),
       enable_caching=st.sampled_from([True, True, False]))
def test_drawn_workloads_count_cached_prompt_tokens_as_the_spec_says(
        data, num_blocks, budget, enable_caching):
    scheduler = make_scheduler(num_blocks, budget, enable_caching,
                               max_model_len=(num_blocks - 1) * BLOCK)
    log = AdmissionLog().watch(scheduler)
    runner = ModelFreeRunner(vocab_size=50)
    shared = [[], list(range(1, 9)), list(range(20, 32))]
    requests, arrivals = [], {}
    for i in range(data.draw(st.integers(1, 6), label="num_requests")):
        prompt = data.draw(st.sampled_from(shared), label="prefix") + data.draw(
            st.lists(st.integers(0, 49), min_size=1, max_size=10), label="tail")
        prompt = prompt[:(num_blocks - 1) * BLOCK - 2]
        max_tokens = data.draw(st.integers(1, 12), label="max_tokens")
        arrivals.setdefault(data.draw(st.integers(0, 4), label="arrival"), []).append(
            (f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    step = 0
    while scheduler.has_unfinished_requests() or any(s >= step for s in arrivals):
        for req_id, prompt, params in arrivals.get(step, []):
            requests.append(scheduler.new_request(req_id, prompt, params))
        if scheduler.has_unfinished_requests():
            engine_step(scheduler, runner)
        step += 1
        assert step < 400
    check_against_the_spec(scheduler, log, requests)
    if not enable_caching:
        assert all(r.num_cached_tokens == 0 for r in requests)
        assert scheduler.stats.prompt_tokens_cached == 0
    for request in requests:
        mine = [a for a in log.admissions if a.req_id == request.request_id]
        COVERAGE["resumed_after_first_token_with_hit"] += sum(
            a.num_output_tokens > 0 and a.hit > 0 for a in mine)
        COVERAGE["readmitted_before_first_token"] += sum(a.num_output_tokens == 0
                                                         for a in mine) > 1


def test_the_drawn_workloads_preempt_before_and_after_the_first_token():
    """Runs after the property above (file order): both cases were exercised."""
    if not all(COVERAGE.values()):
        test_drawn_workloads_count_cached_prompt_tokens_as_the_spec_says()
    assert all(count > 0 for count in COVERAGE.values()), COVERAGE


def test_a_resume_after_the_first_token_keeps_num_cached_tokens():
    # "a" prefills 12 tokens and decodes; "b" arrives and prefills, its blocks
    # crowd "a" out after a's first token; "a" resumes on a hit of its own blocks.
    scheduler = make_scheduler(num_blocks=8, budget=16)
    log = AdmissionLog().watch(scheduler)
    runner = ModelFreeRunner(vocab_size=50)
    a = scheduler.new_request("a", list(range(1, 13)), SamplingParams(max_tokens=10,
                                                                       ignore_eos=True))
    engine_step(scheduler, runner)
    b = scheduler.new_request("b", list(range(30, 42)), SamplingParams(max_tokens=10,
                                                                        ignore_eos=True))
    while scheduler.has_unfinished_requests():
        engine_step(scheduler, runner)
    resumes = [x for x in log.admissions if x.num_output_tokens > 0]
    assert resumes and all(x.hit > 0 for x in resumes)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    assert scheduler.stats.prompt_tokens_cached == log.prompt_tokens_cached() > 0
    check_against_the_spec(scheduler, log, [a, b])


def test_request_outputs_report_the_spec_num_cached_tokens():
    """The same rules through ``LLM``: each ``RequestOutput.num_cached_tokens``."""
    model = llama(seed=41, vocab_size=40, layers=1)
    llm = LLM(model, block_size=BLOCK, max_model_len=40, max_num_batched_tokens=8,
              num_gpu_blocks=12)
    log = AdmissionLog().watch(llm.scheduler)
    system = list(range(1, 13))
    prompts = [system + [20 + i] * (2 + i) for i in range(5)] + [system[:8] + [33]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert llm.stats.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        assert output.num_cached_tokens == log.num_cached_tokens(output.request_id)
        assert output.outputs[0].token_ids == reference(model, prompt, 8)[0]
    assert any(o.num_cached_tokens > 0 for o in outputs)
    assert llm.stats.prompt_tokens_cached == log.prompt_tokens_cached()
    assert llm.stats.prompt_tokens_computed == log.prompt_positions_computed
