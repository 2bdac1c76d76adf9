"""What `shardplan`'s front exports, for type checkers and IDEs (__init__.py imports each name on first use;
`X as X` is how a stub re-exports)."""

from shardplan.engine.errors import SyncIncomplete as SyncIncomplete
from shardplan.engine.sharding import dtensor_shards as dtensor_shards
from shardplan.engine.trainer import EngineSync as EngineSync
from shardplan.engine.trainer import ModuleSource as ModuleSource
from shardplan.engine.trainer import TrainerRank as TrainerRank
from shardplan.errors import ShardplanError as ShardplanError
from shardplan.plan.file.format import PlanFile as PlanFile
from shardplan.plan.file.store import PlanNotFound as PlanNotFound
from shardplan.plan.file.store import StalePlan as StalePlan
from shardplan.plan.file.store import load_plan as load_plan
from shardplan.runtime.apply import Applier as Applier
from shardplan.runtime.apply import params_from_plan as params_from_plan
from shardplan.runtime.quantize import QuantizingReplayer as QuantizingReplayer
from shardplan.runtime.replay import Replayer as Replayer
from shardplan.sync.stages import SyncConfig as SyncConfig

__version__: str
__all__: list[str]
