"""A seeded family of reasoning tasks with checkable answers: trace a short Python
program of small-integer assignments and say what it prints.

A level-L item takes L arithmetic operations: one or two variables start as
constants, L - 1 statements (`c = a * 3`, `a += b`) update them, and the last line
prints one more operation. The reasoning the model learns writes one line per
statement, so the thinking grows with the level, and a model that is cut short of
the last line has not computed the answer yet:

    <|user|>                   <|assistant|>
    a = 6                      <think>
    b = a * 3                  a = 6
    a += b                     b = 6 * 3 = 18
    print(a - 5)               a = 6 + 18 = 24
                               a - 5 = 24 - 5 = 19
                               </think>
                               19

Each item is written "verbose" (the values substituted, as above) or "terse"
(`b = 18`): the same computation in fewer thinking tokens, so a length penalty has
something to remove. Every value stays in [0, MAX_VALUE]. Items are a pure
function of the seed (`random.Random`), and `run_program` checks an answer by
running the program itself.
"""

from __future__ import annotations

import contextlib
import io
import random
import re
from dataclasses import dataclass

LEVELS = (1, 2, 3, 4, 5, 6)
MAX_VALUE = 99
MAX_CONSTANT = 9
VARIABLES = "abcd"
OPERATORS = ("+", "-", "*")
VERBOSE_PROBABILITY = 0.75
THINK_START, THINK_END = "<think>", "</think>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
# Tries per statement before a level's program is drawn again (values out of range).
_TRIES = 50


@dataclass(frozen=True)
class TraceLine:
    """One line of the reasoning: `target = substituted = value` (target is the
    printed expression for the last line)."""

    target: str
    substituted: str  # "" for a constant assignment
    value: int

    def text(self, verbose: bool) -> str:
        if not self.substituted:
            return f"{self.target} = {self.value}"
        if verbose:
            return f"{self.target} = {self.substituted} = {self.value}"
        return f"{self.target} = {self.value}"


@dataclass(frozen=True)
class ReasoningItem:
    level: int
    program: str  # the user's message
    trace: tuple[TraceLine, ...]
    answer: int
    verbose: bool

    @property
    def thinking(self) -> str:
        """The reasoning between the markers, one line per statement."""
        return "".join(line.text(self.verbose) + "\n" for line in self.trace)

    @property
    def completion(self) -> str:
        """What the assistant writes: the thinking in its markers, then the answer."""
        return f"{THINK_START}\n{self.thinking}{THINK_END}\n{self.answer}"

    def chat_text(self) -> str:
        """The whole conversation as the chat template renders it, plus the answer."""
        return f"{USER}\n{self.program}\n{ASSISTANT}\n{self.completion}"


def _operand(rng: random.Random, env: dict[str, int]) -> str:
    """A defined variable or a constant."""
    if env and rng.random() < 0.6:
        return rng.choice(sorted(env))
    return str(rng.randint(1, MAX_CONSTANT))


def _value(term: str, env: dict[str, int]) -> int:
    return env[term] if term in env else int(term)


def _apply(left: int, op: str, right: int) -> int:
    return left + right if op == "+" else left - right if op == "-" else left * right


def _operation(rng: random.Random, env: dict[str, int], left: str
               ) -> tuple[str, str, str, int] | None:
    """(left, op, right, value) with `left` (a variable) as one operand and the value in
    range, or None after _TRIES draws. Zeros are rare and `x - x` never happens, so an
    answer is seldom guessable without the values."""
    for _ in range(_TRIES):
        op, right = rng.choice(OPERATORS), _operand(rng, env)
        if op == "-" and right == left:
            continue
        first, second = (right, left) if rng.random() < 0.3 else (left, right)
        value = _apply(_value(first, env), op, _value(second, env))
        if 0 <= value <= MAX_VALUE and (value or rng.random() < 0.2):
            return first, op, second, value
    return None


def _statement(rng: random.Random, env: dict[str, int], last: str
               ) -> tuple[str, str, TraceLine] | None:
    """An updating statement (`c = a * 3` or `a += b`), the variable it assigns and its
    trace line, or None. Most statements read the variable assigned just before, so the
    answer depends on the whole chain."""
    left = last if rng.random() < 0.75 else rng.choice(sorted(env))
    drawn = _operation(rng, env, left)
    if drawn is None:
        return None
    first, op, second, value = drawn
    substituted = f"{_value(first, env)} {op} {_value(second, env)}"
    if first in env and rng.random() < 0.3:  # an augmented assignment to the first operand
        source, target = f"{first} {op}= {second}", first
    else:
        free = [v for v in VARIABLES if v not in env]
        target = rng.choice(free) if free and rng.random() < 0.5 else rng.choice(sorted(env))
        source = f"{target} = {first} {op} {second}"
    env[target] = value
    return source, target, TraceLine(target, substituted, value)


def _try_item(rng: random.Random, level: int, verbose: bool) -> ReasoningItem | None:
    env: dict[str, int] = {}
    lines: list[str] = []
    trace: list[TraceLine] = []
    for name in VARIABLES[:rng.choice((1, 2))]:
        env[name] = rng.randint(1, MAX_CONSTANT)
        lines.append(f"{name} = {env[name]}")
        trace.append(TraceLine(name, "", env[name]))
    last = rng.choice(sorted(env))
    for _ in range(level - 1):
        made = _statement(rng, env, last)
        if made is None:
            return None
        lines.append(made[0])
        last = made[1]
        trace.append(made[2])
    drawn = _operation(rng, env, last)  # the printed value reads the last assignment
    if drawn is None:
        return None
    first, op, second, value = drawn
    lines.append(f"print({first} {op} {second})")
    trace.append(TraceLine(f"{first} {op} {second}",
                           f"{_value(first, env)} {op} {_value(second, env)}", value))
    return ReasoningItem(level, "\n".join(lines), tuple(trace), value, verbose)


def generate_item(rng: random.Random, level: int,
                  verbose_probability: float = VERBOSE_PROBABILITY) -> ReasoningItem:
    """One item of the given level, drawn from rng."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    verbose = rng.random() < verbose_probability
    while True:
        item = _try_item(rng, level, verbose)
        if item is not None:
            return item


def generate_items(seed: int, count: int, levels: tuple[int, ...] = LEVELS,
                   verbose_probability: float = VERBOSE_PROBABILITY) -> list[ReasoningItem]:
    """`count` items cycling through `levels`, a pure function of the arguments."""
    rng = random.Random(seed)
    return [generate_item(rng, levels[i % len(levels)], verbose_probability)
            for i in range(count)]


def run_program(program: str) -> int:
    """What the program prints, by running it (the oracle the answers are checked with)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(program, {"__builtins__": {"print": print}})  # noqa: S102 - our own generated code
    return int(out.getvalue())


_FIRST_INTEGER = re.compile(r"-?\d+")


def parse_answer(content: str) -> int | None:
    """The first integer of a model's answer (the text after its thinking), if any."""
    match = _FIRST_INTEGER.search(content)
    return int(match.group()) if match else None


def count_statements(item: ReasoningItem) -> int:
    """Arithmetic operations the item needs (its level, by construction)."""
    return sum(1 for line in item.trace if line.substituted)
