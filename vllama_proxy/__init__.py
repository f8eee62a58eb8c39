"""vllama: the Ollama API in front of vLLM's OpenAI-compatible server."""

__version__ = "0.1.0"
