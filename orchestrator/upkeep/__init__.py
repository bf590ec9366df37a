"""Background upkeep: titles and rolling summaries after runs, and the replica's membership and reaper."""
