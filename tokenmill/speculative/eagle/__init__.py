"""EAGLE-1 speculative decoding: the head (head.py), its file format (checkpoint.py) and
the proposer that drafts with it (proposer.py)."""
