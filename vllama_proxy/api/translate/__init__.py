"""Between Ollama's wire format and vLLM's OpenAI one, by direction, as Ollama's ``openai/openai.go``
keeps its ``From*``/``To*`` functions: ``to_openai.py`` (an Ollama request -> vLLM's request body)
and ``to_ollama.py`` (vLLM's answer, streamed or whole -> Ollama's chunks). Pure: no I/O here;
``api/relay.py`` sends and streams."""
