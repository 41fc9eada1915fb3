"""The step tracer: valid Chrome trace JSON, phases tiling each step, a 100% summary."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.driver import run_engine_workload
from tokenmill.bench.workload import WorkloadSpec, build_workload
from tokenmill.engine.engine import LLMEngine
from tokenmill.profile import PHASES, StepTracer, summarize_steps
from tokenmill.profile.tracer import StepRecord

ALWAYS = ("schedule", "prepare_inputs", "forward", "sample", "output")


@pytest.fixture(scope="module")
def traced(llama_dir):
    engine = LLMEngine.from_kwargs(str(llama_dir), progress=False, num_threads=1,
                                   max_num_batched_tokens=48, chunk_size=32)
    workload = build_workload(WorkloadSpec(num_requests=4, input_len=40, output_len=5), 384)
    tracer = StepTracer().attach(engine)
    run_engine_workload(engine, workload, progress=False)
    tracer.detach(engine)
    assert engine.tracer is None and engine.executor.worker.tracer is None
    return tracer


def test_every_step_has_each_phase_once_in_order(traced):
    assert len(traced.steps) >= 6
    for step in traced.steps:
        names = [name for name, _, _ in step.phases]
        assert [n for n in names if n != "logits"] == list(ALWAYS)
        assert names.count("logits") <= 1
        # phases tile the step: contiguous from its start to its end
        assert step.phases[0][1] == step.start and step.phases[-1][2] == step.end
        for (_, _, end), (_, start, _) in zip(step.phases, step.phases[1:], strict=False):
            assert end == start


def test_batch_composition_is_recorded(traced):
    prefill = sum(s.prefill_tokens for s in traced.steps)
    decode = sum(s.decode_tokens for s in traced.steps)
    assert prefill == 4 * 40  # every prompt token prefilled once (chunked at 32)
    assert decode == 4 * 4  # 5 outputs: the first comes from the prefill step
    assert any(s.num_waiting > 0 for s in traced.steps)  # budget 48 < 4 prompts


def test_chrome_trace_is_valid_json_with_one_span_per_phase(traced, tmp_path):
    path = traced.write(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    for event in events:
        assert event["ph"] in ("X", "C", "M")
        if event["ph"] == "X":
            assert {"name", "ts", "dur", "pid", "tid"} <= event.keys()
            assert event["dur"] >= 0
    phases = [e for e in events if e["ph"] == "X" and e.get("cat") == "phase"]
    assert len(phases) == sum(len(s.phases) for s in traced.steps)
    assert {e["name"] for e in phases} <= set(PHASES)
    steps = [e for e in events if e.get("cat") == "step"]
    assert len(steps) == len(traced.steps)
    assert {"prefill_tokens", "decode_tokens", "running", "waiting"} <= steps[0]["args"].keys()


def test_summary_shares_add_to_100_percent_of_wall_time(traced):
    summary = summarize_steps(traced.steps)
    assert sum(summary.shares.values()) == pytest.approx(100.0)
    wall = traced.steps[-1].end - traced.steps[0].start
    assert summary.wall_s == pytest.approx(wall, rel=1e-9)
    assert summary.compute_s > 0 and summary.host_s > 0


def test_idle_gaps_between_steps_are_counted():
    a = StepRecord(0, 0.0, 1.0, [("schedule", 0.0, 0.25), ("forward", 0.25, 1.0)])
    b = StepRecord(1, 3.0, 4.0, [("schedule", 3.0, 3.5), ("output", 3.5, 4.0)])
    summary = summarize_steps([a, b])
    assert summary.wall_s == pytest.approx(4.0)
    assert summary.shares == pytest.approx({"compute": 18.75, "communication": 0.0,
                                            "host": 31.25, "idle": 50.0})


def test_communication_is_carved_out_of_the_forward_on_its_own_lane():
    step = StepRecord(0, 0.0, 1.0, [("schedule", 0.0, 0.2), ("forward", 0.2, 1.0)],
                      communication_s=0.3)
    summary = summarize_steps([step])
    assert summary.shares == pytest.approx({"compute": 50.0, "communication": 30.0,
                                            "host": 20.0, "idle": 0.0})
    tracer = StepTracer()
    tracer.steps.append(step)
    lane = [e for e in tracer.chrome_trace()["traceEvents"] if e.get("cat") == "communication"]
    assert len(lane) == 1 and lane[0]["tid"] == 2 and lane[0]["dur"] == pytest.approx(3e5)


def test_a_worker_in_another_process_reports_its_phases():
    times = iter([0.0, 0.1, 1.0, 1.2])
    tracer = StepTracer(clock=lambda: next(times))
    tracer.begin_step()
    tracer.mark("schedule")  # t = 0.1
    tracer.worker_step({"prepare_inputs": 0.1, "forward": 0.6, "sample": 0.1,
                        "communication": 0.2})  # returned at t = 1.0
    tracer.end_step()  # t = 1.2
    phases = [(name, round(start, 3), round(end, 3)) for name, start, end in tracer.steps[0].phases]
    assert phases == [("schedule", 0.0, 0.1), ("transfer", 0.1, 0.2),
                      ("prepare_inputs", 0.2, 0.3), ("forward", 0.3, 0.9), ("sample", 0.9, 1.0),
                      ("output", 1.0, 1.2)]
    assert tracer.steps[0].communication_s == 0.2


def test_engine_without_tracer_has_none(llama_dir):
    engine = LLMEngine.from_kwargs(str(llama_dir), progress=False, num_threads=1)
    assert engine.tracer is None and engine.executor.worker.tracer is None
