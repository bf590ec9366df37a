"""After-run upkeep: chat titles and rolling summaries, generated in the background once a run's end is
stored (bounded, low priority). The replica's membership (heartbeats, adopting lost replicas' runs) is
``orchestrator/membership.py``."""
