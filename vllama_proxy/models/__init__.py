"""What vLLM serves and under which names: the catalog, the vLLM servers behind it, aliases, model files, the ``[[models]]`` config, the hub."""
