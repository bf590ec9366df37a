"""What a user may do: token budgets and concurrent runs by tier, content moderation, limit refusals."""
