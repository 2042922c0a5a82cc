"""Window -> derived values per engine; KV transfer backends; cross-target peers."""
