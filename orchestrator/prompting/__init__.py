"""Prompts: the branch read from Cassandra, fitted to the context window with the model's own template."""
