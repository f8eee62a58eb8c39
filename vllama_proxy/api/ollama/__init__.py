"""The Ollama wire: its typed requests, NDJSON and times, the translation to vLLM's OpenAI bodies and back, and the relay that streams an answer through."""
