"""Tenancy: who may talk to the proxy (keys, roles, hosts), what a key may send, and how much and in which order it is served (limits, budgets, the fair queue)."""
