"""The request's way through the proxy: read the body, gate it (parse once, check), admit it (a place, a key's limits), finish vLLM's body, relay the answer, settle what it used."""
