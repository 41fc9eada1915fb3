"""Training tokenmill's embedded default models (tokenizer, weights, model cards)."""
