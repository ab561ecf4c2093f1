"""Time-slicing for training loops you already have (``timeslice.integrations.trl``: TRL).

Each integration is a module of its own that imports its framework; this package imports
nothing, so ``timeslice`` stays importable without them.
"""
