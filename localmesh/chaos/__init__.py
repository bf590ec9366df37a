"""The chaos suite (``make chaos``, bench/chaos.py): a steady chat load on the multi-replica local mesh
while each kind of component is killed, terminated, paused and slowed; per fault kind, what the users saw."""
