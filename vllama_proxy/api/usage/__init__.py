"""The usage ledger: one row per request and key, kept in SQLite or PostgreSQL."""
