"""The sync engine: at every RL step, ship each consumer (inference) rank exactly its bytes from the trainer ranks.

Roles and what each one calls
-----------------------------
    Coordinator (driver)      announce(version): who takes part, and the schedule id, on the control channel
    TrainerSync (per trainer) sync(version): pack each consumer's groups, send them, mark them done
    ConsumerSync (per cons.)  sync(version): receive into two registered buffers, verify, apply;
                              state -> (version, complete)

The data path per (trainer, consumer) pair is a *lane*: a thread on the trainer that, for each weight group (one
decoder layer) the pair shares, packs the group into one of two staging slots, waits for the consumer's "slot free"
mark, sends, and then marks the *previous* group done (with checksums). So packing group N+1 overlaps the transfer of
N, and at most two groups are in flight per side. The consumer posts receives for groups N and N+1 (marking both
slots free), waits for N's done marks, verifies, applies N while N+1 is in flight, then re-posts the slot for N+2.

Control channel keys (values are short strings or JSON):
    join/<rank>                      {"epoch", "held", "stamps"}  a rank (re)starting; trainers say which tensors they
                                     hold whole; both sides the stamp of each consumer's bytes (plan rank + digest
                                     + sync protocol version)
    schedule/<id>                    the Schedule (JSON)  written once per membership (and, for EPLB plans whose
                                     trainers hold subsets of the experts, per set of placements); the last 4 kept
    v<V>/announce                    {"schedule", "members": {rank: epoch}, "stamps": {rank: {consumer: stamp}}}
    v<V>/free/<consumer>/<g>         "ok <unix time>" | "abort: ..."        consumer -> its trainers
    v<V>/done/<trainer>/<consumer>/<g>  {"sums": [...]} | "abort: ..."      trainer -> consumer, after the send finished
    v<V>/result/<rank>               {"ok", "epoch", "errors"}
    v<V>/amax/<trainer>/<group>      {weight: [block grid shape, base64 float32]}  block-FP8 plans whose trainer boxes
                                     cut blocks: each holder's partial block amaxes, read by the others (docs/fp8.md)
    v<V>/placement/<consumer>        {"digest", "layers", "rows"}  EPLB plans only: the placement the consumer's engine
                                     holds for this version; each trainer lane binds to it first (sync/placement.py)
The coordinator deletes a version's v<V>/ keys two versions later (control.version_keys), so a long job's store does
not grow by every version.

Failure model
-------------
Every wait has a deadline and names the peer it waited for. A consumer waits `timeout_s` for each group's bytes from
each of its trainers; a trainer waits `1.5 * timeout_s` for a consumer (the consumer may itself be waiting up to
`timeout_s` on another trainer, and must be the first to give up, so nobody blames a bystander). Whoever gives up
writes "abort: <why>" into every mark the other side may still wait on, so peers end at once instead of timing out.
A lane's failure never stops the other lanes: surviving consumers complete (degraded sync). Each rank that saw any
failure bumps its epoch (so adapters re-open its connections), records its result, and raises SyncFailed naming the
peers. The coordinator leaves out of the next version every rank that wrote no result (dead or stalled) and brings
back any rank that re-joined (a restart writes `join/<rank>` with a fresh epoch). A consumer's `state` says
(version, complete): complete only when every byte of that version arrived, matched its checksum and was applied;
(new version, False) as soon as the first group of a version was applied.

Checksum (schedule.checksum_tensor, per message, both sides): row and column sums of the bytes as int64 words
(wrapping), folded level by level, keyed by position and mixed; catches missing, zeroed, truncated or stale pieces and
also swapped words and +x/-x in two words, which the plain sum of protocol 1 did not; two passes over the bytes.
The join stamps carry the sync protocol version (control.PROTOCOL): a peer of another version is refused by name.

Modules, in import order: stages (Protocols, config, errors, results) -> schedule (pure) -> control (keys, marks)
-> coordinator, rank -> trainer, consumer -> adapters (replay/apply/shards behind the stage Protocols).
"""

from shardplan.sync.adapters import PART_BYTES, ApplyUnpacker, ReplayPacker, ShardedPacker, ShardedUnpacker, spans_of
from shardplan.sync.consumer import ConsumerSync
from shardplan.sync.coordinator import Announcement, Coordinator
from shardplan.sync.schedule import Piece, Schedule, build_schedule, checksum, checksum_tensor, held_whole
from shardplan.sync.stages import (
    ChecksumMismatch,
    LayoutMismatch,
    NotAMember,
    Packer,
    Replicas,
    ScheduleError,
    Span,
    SyncConfig,
    SyncConfigError,
    SyncFailed,
    SyncReport,
    SyncState,
    Unpacker,
    WeightSource,
    set_event_listener,
)
from shardplan.sync.trainer import TrainerSync

__all__ = [
    "PART_BYTES",
    "Announcement",
    "ApplyUnpacker",
    "ChecksumMismatch",
    "ConsumerSync",
    "Coordinator",
    "LayoutMismatch",
    "NotAMember",
    "Packer",
    "Piece",
    "ReplayPacker",
    "Replicas",
    "Schedule",
    "ScheduleError",
    "ShardedPacker",
    "ShardedUnpacker",
    "Span",
    "SyncConfig",
    "SyncConfigError",
    "SyncFailed",
    "SyncReport",
    "SyncState",
    "TrainerSync",
    "Unpacker",
    "WeightSource",
    "build_schedule",
    "checksum",
    "checksum_tensor",
    "held_whole",
    "set_event_listener",
    "spans_of",
]
