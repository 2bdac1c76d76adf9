"""The plan file a trainer loads: format (msgpack, sealed by a checksum), checks, bounds, errors, one rank's
instantiation, and the store that finds a plan by fingerprint (docs/plan-format.md)."""
from shardplan.plan.file.errors import PlanFileError
from shardplan.plan.file.format import PlanFile, PlanHeader, read_plan_bytes
from shardplan.plan.file.store import PlanNotFound, StalePlan, load_plan

__all__ = ["PlanFile", "PlanFileError", "PlanHeader", "PlanNotFound", "StalePlan", "load_plan", "read_plan_bytes"]
