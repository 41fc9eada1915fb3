"""Packing documents into fixed-length token windows, in a seeded order.

Documents are concatenated with ``<|endoftext|>`` after each one, so a window can
span a document boundary and the model learns that a new file starts after the
separator.  Windows do not overlap within an epoch; each epoch draws a fresh,
seeded start offset and permutation so that boundaries move between epochs while
any two runs with the same seed see identical batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer


def pack_documents(tokenizer: Tokenizer, texts: Iterable[str], end_of_text_id: int) -> torch.Tensor:
    """All documents' token ids, each followed by ``end_of_text_id``, as one 1-D tensor."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(end_of_text_id)
    return torch.tensor(ids, dtype=torch.long)


@dataclass(frozen=True)
class PackedCorpus:
    train: torch.Tensor  # every training document, packed
    held_out: torch.Tensor  # every held-out document, packed
    eval_windows: torch.Tensor  # the periodic-evaluation subset of held-out windows


def pack_corpus(tokenizer: Tokenizer, end_of_text_id: int, train_texts: Iterable[str],
                held_out_texts: Iterable[str], eval_seq_len: int,
                eval_windows: int | None) -> PackedCorpus:
    """Both splits packed, and the held-out windows periodic evaluation scores."""
    train = pack_documents(tokenizer, train_texts, end_of_text_id)
    held_out = pack_documents(tokenizer, held_out_texts, end_of_text_id)
    return PackedCorpus(train, held_out, evaluation_windows(held_out, eval_seq_len, eval_windows))


def training_batches(
    tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int
) -> Iterator[torch.Tensor]:
    """An endless stream of ``[batch_size, seq_len]`` windows, epoch after epoch."""
    if tokens.numel() < seq_len * batch_size + seq_len:
        raise ValueError(
            f"corpus of {tokens.numel()} tokens is too small for batch {batch_size} x {seq_len}"
        )
    epoch = 0
    while True:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        offset = int(torch.randint(0, seq_len, (1,), generator=generator))
        num_windows = (tokens.numel() - offset) // seq_len
        windows = tokens[offset : offset + num_windows * seq_len].view(num_windows, seq_len)
        order = torch.randperm(num_windows, generator=generator)
        # A ragged tail batch is dropped so every step has the same shape.
        for start in range(0, num_windows - batch_size + 1, batch_size):
            yield windows[order[start : start + batch_size]]
        epoch += 1


def evaluation_windows(tokens: torch.Tensor, seq_len: int, max_windows: int | None) -> torch.Tensor:
    """Non-overlapping held-out windows, evenly spaced through the held-out text.

    With ``max_windows=None`` every full window is returned, which is what the
    reported held-out loss uses; periodic evaluation takes a fixed spread subset.
    """
    num_windows = tokens.numel() // seq_len
    if num_windows == 0:
        raise ValueError(f"held-out text of {tokens.numel()} tokens is shorter than {seq_len}")
    windows = tokens[: num_windows * seq_len].view(num_windows, seq_len)
    if max_windows is None or max_windows >= num_windows:
        return windows
    picks = torch.linspace(0, num_windows - 1, max_windows).round().long()
    return windows[picks]
