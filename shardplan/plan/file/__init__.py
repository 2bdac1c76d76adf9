"""The plan file a trainer loads: one sealed, canonical msgpack file per (model config, layout, dtype).

    PlanFile.read(path) := read_plan_bytes -> decode (format.py) -> checks (checks.py, skeletons.py) -> PlanFile
    PlanFile.rank(r)    := rank_columns (rank.py), every box checked (bounds.py) -> ir.RankPlan with columnar writes
    load_plan(model, tp=, ep=, ...) := the plan of that fingerprint among the store's directories (store.py)

Every failure is one named error of errors.py (a `PlanFileError`), whose message names the file, the field or box,
and says how to re-record; a file that is not exactly the canonical encoding of what it decodes to is refused.

The trainer's lines import from here (README: `from shardplan.plan.file import load_plan`); docs/plan-format.md gives
the format byte by byte and every validation rule.

This package imports the plan language and the in-memory body (plan/body.py), never the compiler.
"""

from shardplan.plan.file.errors import PlanFileError
from shardplan.plan.file.format import PlanFile, PlanHeader, read_plan_bytes
from shardplan.plan.file.store import PlanNotFound, StalePlan, load_plan

__all__ = ["PlanFile", "PlanFileError", "PlanHeader", "PlanNotFound", "StalePlan", "load_plan", "read_plan_bytes"]
