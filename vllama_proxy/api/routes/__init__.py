"""HTTP handlers, one module per group of Ollama routes; ``app.py`` wires them."""
