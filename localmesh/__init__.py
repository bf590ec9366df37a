"""Developer tools: the whole mesh on one machine (``mesh``, behind ``make run``), its front door
(``front_door``) and the dev JWTs its Envoy accepts (``dev_jwt``). Nothing in a service imports this."""
