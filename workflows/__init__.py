"""Timeslice workflows (deterministic; no I/O, torch or vLLM imports)."""
