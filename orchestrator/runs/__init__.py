"""Runs: one object per kind of run (send, regenerate, complete) and the lifecycle steps they share."""
