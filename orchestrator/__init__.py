"""Orchestrator: ChatService (history, prompt assembly, budgets, moderation, runs, resume)."""
