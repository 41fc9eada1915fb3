"""Drive an engine through staggered arrivals, checking the KV pool every step."""

from __future__ import annotations

from tokenmill import SamplingParams
from tokenmill.engine.engine import LLMEngine


def run_staggered(engine: LLMEngine, prompts: list[list[int]],
                  params: SamplingParams | list[SamplingParams],
                  arrivals: list[int] | None = None, max_steps: int = 3000) -> list[list[int]]:
    """Add prompt i (as request "r{i}") at step arrivals[i] (default: all at step 0),
    step until every request finishes, run check_integrity() after each step, and
    require the whole pool free at the end. Returns each prompt's output tokens."""
    arrivals = arrivals or [0] * len(prompts)
    results: dict[str, list[int]] = {}
    step = 0
    while len(results) < len(prompts):
        for index, at in enumerate(arrivals):
            if at == step:
                p = params[index] if isinstance(params, list) else params
                engine.add_request(f"r{index}", prompts[index], p)
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        engine.check_integrity()
        step += 1
        assert step < max_steps, "engine did not finish"
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    # The worker's side: a draft model's or EAGLE head's own pool and the sampling
    # streams, every finished request released.
    engine.executor.check_integrity(idle=True)
    return [results[f"r{i}"] for i in range(len(prompts))]
