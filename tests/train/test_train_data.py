"""The corpus split and the packed batch order are fixed by names and seeds alone."""

from __future__ import annotations

import torch

from tokenmill.train.corpus import is_held_out, list_sources, read_sources, split_sources
from tokenmill.train.packing import evaluation_windows, pack_documents, training_batches


def make_tree(root, names):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\nx = 1\n", encoding="utf-8")


def test_corpus_skips_tests_and_site_packages_and_sorts(tmp_path):
    make_tree(
        tmp_path,
        [
            "b.py",
            "a.py",
            "pkg/mod.py",
            "test/test_a.py",
            "pkg/tests/t.py",
            "site-packages/x.py",
            "notes.txt",
        ],
    )
    assert list_sources(tmp_path) == ["a.py", "b.py", "pkg/mod.py"]


def test_held_out_split_depends_only_on_relative_path(tmp_path):
    names = [f"m{i}.py" for i in range(200)]
    make_tree(tmp_path, names)
    train, held_out = split_sources(read_sources(tmp_path))
    held_names = {s.relpath for s in held_out}
    assert held_names == {n for n in names if is_held_out(n)}
    assert held_names and not held_names & {s.relpath for s in train}
    assert len(train) + len(held_out) == len(names)


def test_training_batches_repeat_for_a_seed_and_differ_across_seeds(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    tokens = pack_documents(tokenizer.backend_tokenizer, ["def f():\n    pass\n"] * 50, 0)
    assert int((tokens == 0).sum()) == 50

    def first_batches(seed):
        stream = training_batches(tokens, seq_len=16, batch_size=3, seed=seed)
        return [next(stream) for _ in range(20)]  # spans several epochs

    a, b, c = first_batches(1), first_batches(1), first_batches(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    assert all(batch.shape == (3, 16) for batch in a)


def test_evaluation_windows_are_evenly_spread_and_fixed():
    tokens = torch.arange(1000)
    windows = evaluation_windows(tokens, seq_len=100, max_windows=3)
    assert windows[:, 0].tolist() == [0, 400, 900]
    assert evaluation_windows(tokens, seq_len=100, max_windows=None).shape == (10, 100)
