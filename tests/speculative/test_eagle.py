"""EAGLE head: training lowers its loss, the proposer's cached incremental drafts equal
a from-scratch recompute (also after rollback), save/load, and its KV pool limits."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill.core.step import ProposalRequest
from tokenmill.model.loader import load_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.speculative.eagle.checkpoint import load_eagle_head, save_eagle_head
from tokenmill.speculative.eagle.head import EagleHead
from tokenmill.speculative.eagle.proposer import EagleProposer
from tokenmill.train.eagle import EagleRecipe, target_record, train_eagle_head
from tokenmill.train.presets import Phase, Schedule

REPO_ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=64)
@pytest.fixture(scope="module")
def target(llama_dir):
    return load_model(llama_dir, dtype="float32", device="cpu", progress=False).model


@pytest.fixture(scope="module")
def hf_target(llama_dir):
    return AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def head_dir(eagle_head_dir) -> Path:
    return eagle_head_dir


def features_of(hf_target, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_target.model(input_ids=torch.tensor([token_ids])).last_hidden_state[0]


def reference_logits(head: EagleHead, target, features: torch.Tensor, token_ids: list[int],
                     offset: int, drafts: list[int]) -> list[torch.Tensor]:
    """Draft logits recomputed from scratch: the whole pair sequence through the head
    without a cache, once per draft step, feeding back the proposal's own tokens."""
    pair_features = features[offset:len(token_ids) - 1]
    pair_tokens = token_ids[offset + 1:]
    logits = []
    with torch.no_grad():
        for step in range(len(drafts)):
            embeds = target.embed(torch.tensor(pair_tokens))
            predicted = head.forward_windows(pair_features[None], embeds[None], offset)[0, -1]
            logits.append(target.compute_logits(predicted[None])[0])
            pair_features = torch.cat((pair_features, predicted[None]))
            pair_tokens = pair_tokens + [drafts[step]]
    return logits


def request(request_id: str, token_ids: list[int], params: SamplingParams) -> ProposalRequest:
    return ProposalRequest(request_id, list(token_ids), params, 0, 0)


def propose(proposer, requests: list[ProposalRequest], num_tokens: list[int]):
    for r, k in zip(requests, num_tokens, strict=True):
        r.num_tokens = k
    return proposer.propose(requests)


def check_proposal(proposal, head, target, features, request: ProposalRequest, offset: int,
                   num_tokens: int) -> None:
    assert len(proposal.token_ids) == num_tokens
    expected = reference_logits(head, target, features, request.token_ids, offset,
                                proposal.token_ids)
    if request.params.temperature == 0:
        assert proposal.probs is None
        assert proposal.token_ids == [int(row.argmax()) for row in expected]
    else:
        assert proposal.probs.shape == (num_tokens, target.arch.vocab_size)
        torch.testing.assert_close(proposal.probs, torch.stack(expected).softmax(-1),
                                   rtol=1e-4, atol=1e-6)


def test_training_lowers_the_loss_writes_a_loadable_head_and_can_continue_from_it(llama_dir, target, tmp_path):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in ("bisect.py", "colorsys.py", "keyword.py")]
    held_out = [(stdlib / "stat.py").read_text()[:3000]]
    recipe = EagleRecipe(
        Schedule(phases=(Phase(steps=30, seq_len=64, batch_size=4),), peak_lr=1e-2,
                 warmup_steps=3, eval_every=10, eval_windows=2, eval_seq_len=64),
        final_eval_windows=4, acceptance_prompts=2, prompt_len=16, continuation_len=16)
    out = tmp_path / "head"
    log = train_eagle_head(llama_dir, out, texts, held_out, recipe, show_progress=False)
    losses = log["history"]["train_loss"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05, losses
    assert log["history"]["eval_loss"][-1] < log["history"]["eval_loss"][0]
    assert 0.0 <= log["held_out"]["top1_agreement"] <= 1.0
    assert 1.0 <= log["acceptance"]["tokens_per_pass"] <= 1.0 + recipe.draft_len
    for name in ("config.json", "model.safetensors", "README.md", "loss_curve.png",
                 "train_log.json"):
        assert (out / name).is_file(), name
    load_eagle_head(out, target)

    continued = train_eagle_head(llama_dir, tmp_path / "continued", texts, held_out,
                                 recipe.with_overrides(steps=3), show_progress=False,
                                 init_from=out)
    assert continued["history"]["train_loss"][0] < sum(losses[:5]) / 5 - 0.05
    assert continued["init_from"] == json.loads((out / "config.json").read_text())["target"]


@pytest.mark.parametrize("micro_batch", [None, 2])
def test_incremental_drafts_match_full_recompute_through_steps_and_rollback(
        target, hf_target, head_dir, micro_batch):
    head = load_eagle_head(head_dir, target)
    reference_head = load_eagle_head(head_dir, target)
    proposer = EagleProposer(head, target, num_blocks=32, block_size=4, micro_batch=micro_batch)
    generator = torch.Generator().manual_seed(1)
    vocab = target.arch.vocab_size
    # Each request walks along a fixed token sequence; offset > 0 is a prefix-cache
    # hit whose positions the target never computed (no features for them).
    sequences = [torch.randint(1, vocab, (40,), generator=generator).tolist() for _ in range(3)]
    features = [features_of(hf_target, s) for s in sequences]
    setups = [(GREEDY, 13, 0), (SAMPLED, 9, 0), (GREEDY, 11, 5)]
    requests, offsets = [], []
    for index, (params, prompt_len, offset) in enumerate(setups):
        r = request(f"r{index}", sequences[index][:prompt_len], params)
        # Chunked prefill: two observe() calls, then the sampled first token.
        middle = (offset + prompt_len) // 2
        proposer.observe(r.request_id, offset, features[index][offset:middle])
        proposer.observe(r.request_id, middle, features[index][middle:prompt_len])
        r.token_ids.append(sequences[index][prompt_len])
        requests.append(r)
        offsets.append(offset)

    def propose_and_check(num_tokens: list[int]) -> None:
        proposals = propose(proposer, requests, num_tokens)
        for i, proposal in enumerate(proposals):
            check_proposal(proposal, reference_head, target, features[i], requests[i],
                           offsets[i], num_tokens[i])
        proposer.kv_manager.check_integrity()

    propose_and_check([3, 4, 2])
    for accepted in ([0, 2, 1], [3, 1, 0]):  # verification steps: accepted + 1 tokens each
        for i, r in enumerate(requests):
            start = len(r.token_ids)
            r.token_ids.extend(sequences[i][start:start + accepted[i] + 1])
            proposer.observe(r.request_id, start - 1, features[i][start - 1:start + accepted[i]])
        propose_and_check([4, 3, 2])
    propose_and_check([4, 3, 2])  # nothing changed: the same drafts again

    # Rollback: verified tokens cut back below what the head has processed...
    for r in requests:
        del r.token_ids[-4:]
    propose_and_check([2, 3, 4])
    # ...then continued with different tokens: nothing is drafted from the stale
    # features until the new positions' features are observed.
    for i, r in enumerate(requests):
        start = len(r.token_ids)
        sequences[i][start:] = torch.randint(1, vocab, (40 - start,), generator=generator).tolist()
        features[i] = features_of(hf_target, sequences[i])
        r.token_ids.extend(sequences[i][start:start + 3])
    assert [p.token_ids for p in propose(proposer, requests, [3, 3, 3])] == [[], [], []]
    for i, r in enumerate(requests):
        start = len(r.token_ids) - 3
        proposer.observe(r.request_id, start - 1, features[i][start - 1:start + 2])
    propose_and_check([3, 3, 3])


def test_save_load_round_trip_and_geometry_mismatch(target, head_dir, model_factory, tmp_path):
    head = load_eagle_head(head_dir, target)
    save_eagle_head(head, tmp_path / "copy", {"name": "tiny-llama"})
    copy = load_eagle_head(tmp_path / "copy", target)
    for (name, a), (_, b) in zip(head.named_parameters(), copy.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    config = json.loads((head_dir / "config.json").read_text())
    assert config["target"] == {"name": "tiny-llama"}
    assert config["hidden_size"] == target.arch.hidden_size

    for family, field in (("qwen3", "head_dim"), ("llama_mqa_tied", "num_kv_heads")):
        other = load_model(model_factory(family), dtype="float32", device="cpu",
                           progress=False).model
        with pytest.raises(ValueError, match=field):
            load_eagle_head(head_dir, other)


def test_full_pool_proposes_nothing_and_release_frees_every_block(target, hf_target, head_dir):
    proposer = EagleProposer.load(head_dir, target, num_blocks=2, block_size=4)
    tokens = list(range(1, 21))
    features = features_of(hf_target, tokens)
    long = request("long", tokens[:19], GREEDY)
    short = request("short", tokens[:3], SAMPLED)
    proposer.observe("long", 0, features[:19])
    proposer.observe("short", 0, features[:3])
    long.token_ids.append(tokens[19])
    short.token_ids.append(tokens[3])
    # short: 3 pairs + 2 draft steps = 5 slots = both blocks; long cannot fit at all.
    long_proposal, short_proposal = propose(proposer, [long, short], [3, 3])
    assert long_proposal.token_ids == [] and long_proposal.probs is None
    assert len(short_proposal.token_ids) == 3
    proposer.kv_manager.check_integrity()
    assert proposer.kv_manager.num_free_blocks == 0
    # Never observed: nothing to draft from.
    assert propose(proposer, [request("new", [1, 2], GREEDY)], [2])[0].token_ids == []
    proposer.release("short")
    proposer.release("long")
    proposer.kv_manager.check_integrity()
    assert proposer.kv_manager.num_free_blocks == 2


def test_committed_pycoder_head_was_trained_for_the_committed_pycoder():
    model_dir, head_dir = REPO_ROOT / "models" / "pycoder", REPO_ROOT / "models/pycoder/eagle"
    if not (head_dir / "model.safetensors").is_file():
        pytest.skip("models/pycoder/eagle is not trained yet")
    config = json.loads((head_dir / "config.json").read_text())
    # A retrained pycoder needs a retrained head (python -m tokenmill.train eagle ...).
    assert config["target"] == target_record(model_dir)
    target = load_model(model_dir, dtype="float32", device="cpu", progress=False).model
    proposer = EagleProposer(load_eagle_head(head_dir, target), target, num_blocks=4)
    hf_pycoder = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    prompt = list(range(100, 116))
    r = request("pycoder", prompt, GREEDY)
    proposer.observe(r.request_id, 0, features_of(hf_pycoder, prompt))
    r.token_ids.append(7)
    assert len(propose(proposer, [r], [4])[0].token_ids) == 4
