"""The Ollama API: the aiohttp app, its routes, the wire types, translation to vLLM, streaming back, admission."""
