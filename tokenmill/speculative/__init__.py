"""Speculative decoding: proposers (n-gram, draft model, EAGLE-style head) and the
exact verifier (greedy and rejection sampling)."""
