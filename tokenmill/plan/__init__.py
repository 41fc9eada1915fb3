"""Capacity planning commands (`tokenmill plan ...`)."""
