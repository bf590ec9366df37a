"""Runs: one object per kind of run (send, regenerate, complete), the steps they share, and the runs held here."""
