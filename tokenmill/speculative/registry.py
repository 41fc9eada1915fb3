"""The speculative methods, one table: the config's choices, the CLI's and the factory's.

Pure data (no torch), so the config can validate against it. Each method's module
(loaded in the worker when the method is used) defines

    build_proposer(context: ProposerContext) -> Proposer
    proposer_footprint(context: ProposerContext) -> ProposerFootprint | None  # for planning

A new method is a module with those two functions and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SpeculativeMethod:
    name: str
    module: str
    # Where the method's own model sits when --speculative-model is not given, with
    # {model} the target's directory; None: the method needs no model.
    default_model: str | None = None

    def model_dir(self, target: str, speculative_model: str | None) -> Path | None:
        if speculative_model:
            return Path(speculative_model)
        if self.default_model is None:
            return None
        return Path(self.default_model.format(model=str(Path(target))))


SPECULATIVE_METHODS: dict[str, SpeculativeMethod] = {
    method.name: method for method in (
        # Prompt lookup: the request's own earlier tokens.
        SpeculativeMethod("ngram", "tokenmill.speculative.ngram"),
        # A small model with the target's tokenizer.
        SpeculativeMethod("draft", "tokenmill.speculative.draft", "{model}-draft"),
        # A feature-level head trained for the target (EAGLE-1).
        SpeculativeMethod("eagle", "tokenmill.speculative.eagle.proposer", "{model}/eagle"),
    )
}
