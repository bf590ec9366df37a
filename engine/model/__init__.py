"""Model runners: everything that knows tensors. The scheduler and KV manager see only ``runner.ModelRunner``."""
