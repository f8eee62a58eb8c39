"""The usage ledger (``api/ledger.py``) and the budgets read from it (``Usage``)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Usage(BaseModel):
    """The usage ledger and its budgets."""

    usage_db: str | None = Field(
        None,
        description="Where the usage ledger keeps one row per answered request: an SQLite file (default: usage.sqlite3 in "
        "the state directory), postgresql://USER@HOST/DB (pip install 'vllama-proxy[postgres]'; several fronts may share one), "
        "or off (no ledger, no budgets).",
    )
    usage_retention_days: int = Field(400, ge=0, description="Days the usage ledger keeps its rows (0: forever).")
    usage_flush_interval: float = Field(
        1.0, gt=0, description="Seconds between writes of the usage ledger's rows (a kill -9 loses at most this much).",
    )
    usage_flush_rows: int = Field(1000, ge=1, description="Write the usage ledger's rows at once when this many wait.")
    usage_refresh_interval: float = Field(
        5.0, gt=0, description="Seconds between reads of each key's usage totals for budgets (other workers' and fronts' "
        "usage counts within this time).",
    )
