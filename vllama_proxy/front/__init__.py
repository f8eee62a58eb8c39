"""The serving processes: bind and serve (``site``), ``vllama serve`` (``server``), ``--workers``, systemd notifications."""
