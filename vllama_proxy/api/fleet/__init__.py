"""Keys that keep a conversation on one engine behind vLLM's router, and their release."""
