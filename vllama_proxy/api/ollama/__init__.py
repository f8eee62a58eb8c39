"""The Ollama wire, pure (no I/O): its typed requests, NDJSON and times, and the translation to vLLM's OpenAI bodies and back."""
