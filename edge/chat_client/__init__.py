"""The edge's client of ChatService: every call and answer stream it makes travels on CompleteMany links
to the orchestrator replicas themselves (``client.ChatClient``)."""
