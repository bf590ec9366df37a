"""edge: thin HTTP/SSE + OpenAI-compatible front for browsers, mapping every call onto ChatService."""
