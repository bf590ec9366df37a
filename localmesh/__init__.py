"""Developer tools: the whole mesh on one machine (``mesh``, behind ``make run``), its front door
(``front_door``), the dev JWTs its Envoy accepts (``dev_jwt``) and the local Cassandra it starts
(``cassandra``). Nothing in a service imports this."""
