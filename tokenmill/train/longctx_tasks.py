"""A seeded family of long-context retrieval tasks (RULER-style), written as Python
source so a code model can be trained and evaluated on them.

Every item is a context of about `length` tokens of filler code (slices of the source
texts given), with facts planted at chosen depths, and a last line the model completes;
the answer is checkable text:

    needle        one `KEY_<name> = <value>` line; the prompt ends with
                  `assert KEY_<name> ==` (no trailing space: the space belongs to the
                  answer's first token) and the answer is the value.
    multi-key     the same, among `distractors` other KEY lines (distinct names and
                  values): the model must find the key asked for.
    multi-value   `KEY_<name>.append(<value>)` lines at `values` depths; the prompt
                  ends with `assert KEY_<name> == [` and the answer lists the values in
                  context order, `v1, v2, v3]` (aggregation).
    code          a real held-out file: an assignment of a literal to a module-level
                  name in its first fifth is asked about after the whole file
                  (`assert <name> ==`), so the answer lies thousands of tokens back.

Items are a pure function of the seed and the texts (`random.Random`); `length` is
measured with the caller's tokenizer (`count_tokens`), so a context fits the model it
is built for. `score` compares a completion's first line with the answer.
"""

from __future__ import annotations

import ast
import functools
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

KINDS = ("needle", "multi-key", "multi-value", "code")
NAME_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "so", "ta", "vi", "xe", "zu")


@dataclass(frozen=True)
class LongContextItem:
    kind: str
    prompt: str  # the context and the line to complete
    answer: str  # what the completion must start with (up to the end of its line)
    depths: tuple[float, ...]  # where the facts sit, as fractions of the context


def score(item: LongContextItem, completion: str) -> bool:
    """Whether the completion's first line is the answer (leading spaces aside), with
    nothing after it on that line but spaces or a comment: `41021` does not pass as
    `410219`, nor `x` as `x.upper()`."""
    line = completion.lstrip(" ").split("\n", 1)[0]
    if not line.startswith(item.answer):
        return False
    rest = line[len(item.answer):].strip()
    return not rest or rest.startswith("#")


def _name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice(NAME_SYLLABLES) for _ in range(3))
        if name not in taken:
            taken.add(name)
            return name


def _value(rng: random.Random, taken: set[str]) -> str:
    while True:
        value = str(rng.randrange(10_000, 100_000))
        if value not in taken:
            taken.add(value)
            return value


def _filler(rng: random.Random, texts: Sequence[str], length: int,
            count_tokens: Callable[[str], int]) -> list[str]:
    """Whole lines of the texts, from a random start, about `length` tokens."""
    lines: list[str] = []
    used = 0
    while used < length:
        source = rng.choice(texts).splitlines()
        start = rng.randrange(len(source))
        for line in source[start:]:
            if "KEY_" in line:  # never a fact the item did not plant
                continue
            lines.append(line)
            used += count_tokens(line + "\n")
            if used >= length:
                break
    return lines


def _plant(lines: list[str], facts: list[str], depths: list[float]) -> list[str]:
    """The lines with each fact inserted at its depth (a fraction of the lines)."""
    out = list(lines)
    for fact, depth in sorted(zip(facts, depths, strict=True), key=lambda p: -p[1]):
        out.insert(round(depth * len(lines)), fact)
    return out


def make_item(kind: str, seed: int, texts: Sequence[str], length: int,
              count_tokens: Callable[[str], int], distractors: int = 8,
              values: int = 3) -> LongContextItem:
    """One item of `kind` with a context of about `length` tokens (for `code`, the
    longest prefix of a file with a usable assignment, at most `length` tokens)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not texts:
        raise ValueError("texts: at least one source text is needed for the filler")
    rng = random.Random(f"{kind}-{seed}")
    if kind == "code":
        return _code_item(rng, texts, length, count_tokens)
    names: set[str] = set()
    taken: set[str] = set()
    question_tokens = 16 + (8 * values if kind == "multi-value" else 0)
    lines = _filler(rng, texts, length - question_tokens, count_tokens)
    name = _name(rng, names)
    if kind == "multi-value":
        answers = [_value(rng, taken) for _ in range(values)]
        depths = sorted(rng.uniform(0.05, 0.95) for _ in answers)
        facts = [f"KEY_{name}.append({v})" for v in answers]
        body = _plant(lines, facts, depths)
        prompt = f"KEY_{name} = []\n" + "\n".join(body) + f"\nassert KEY_{name} == ["
        return LongContextItem(kind, prompt, ", ".join(answers) + "]", tuple(depths))
    answer = _value(rng, taken)
    facts, depths = [f"KEY_{name} = {answer}"], [rng.uniform(0.05, 0.95)]
    if kind == "multi-key":
        for _ in range(distractors):
            facts.append(f"KEY_{_name(rng, names)} = {_value(rng, taken)}")
            depths.append(rng.uniform(0.05, 0.95))
    body = _plant(lines, facts, depths)
    prompt = "\n".join(body) + f"\nassert KEY_{name} =="
    return LongContextItem(kind, prompt, answer, (depths[0],))


@functools.lru_cache(maxsize=8192)  # a text is parsed once however many items use it
def _assignments(text: str) -> tuple[tuple[int, str, str], ...]:
    """(line index, name, literal source) of module-level `name = <literal>` lines."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ()
    lines = re.split(r"\r\n|\r|\n", text)  # ast's line numbering (not str.splitlines')
    found = []
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, (int, str)) and node.lineno == node.end_lineno):
            line = lines[node.lineno - 1].encode()  # offsets count UTF-8 bytes
            literal = line[node.value.col_offset:node.value.end_col_offset].decode(
                errors="replace")
            if literal and 2 <= len(literal) <= 40 and "\n" not in literal:
                found.append((node.lineno - 1, node.targets[0].id, literal))
    return tuple(found)


def _code_item(rng: random.Random, texts: Sequence[str], length: int,
               count_tokens: Callable[[str], int]) -> LongContextItem:
    candidates = list(range(len(texts)))
    rng.shuffle(candidates)
    for index in candidates:
        lines = texts[index].splitlines()
        kept: list[str] = []
        used = 0
        for line in lines:
            used += count_tokens(line + "\n")
            if used > length - 16:
                break
            kept.append(line)
        if len(kept) < 50:
            continue
        text = "\n".join(kept)
        # Parsed whole: the kept prefix usually ends inside a statement.
        early = [(i, n, lit) for i, n, lit in _assignments(texts[index])
                 if i < len(kept) / 5]
        # The name must not be assigned again (its value is the one asked for).
        early = [(i, n, lit) for i, n, lit in early
                 if sum(line.lstrip().startswith(f"{n} =") for line in kept) == 1]
        if early:
            line, name, literal = rng.choice(early)
            return LongContextItem("code", text + f"\nassert {name} ==", literal,
                                   (line / len(kept),))
    raise ValueError("code: no text has a module-level literal assignment in its first "
                     "fifth within the length")


def make_items(kind: str, count: int, seed: int, texts: Sequence[str], length: int,
               count_tokens: Callable[[str], int], **options) -> list[LongContextItem]:
    """`count` items of one kind and length, seeds seed .. seed + count - 1."""
    return [make_item(kind, seed + i, texts, length, count_tokens, **options)
            for i in range(count)]
