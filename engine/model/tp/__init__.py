"""Tensor parallelism for the CPU runner: ranks as processes, shared-memory all-reduce (see plan.py)."""
