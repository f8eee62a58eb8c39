"""What vLLM serves and under which names: the catalog, backends, aliases, model files, the ``[[models]]`` config, the hub."""
