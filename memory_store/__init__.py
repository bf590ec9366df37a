"""memory_store: the only code that speaks CQL. Chat history, runs and usage on Apache Cassandra."""
