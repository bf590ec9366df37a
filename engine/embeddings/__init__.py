"""The embedding engine: a sentence encoder served with ``Embed`` (engine.v1), batched across callers."""
