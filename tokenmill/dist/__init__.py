"""Distributed execution: process groups, collectives (tokenmill's own ring, tree and
recursive halving-doubling all-reduce beside the backend's), tensor-parallel linear
methods."""
