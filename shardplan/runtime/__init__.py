"""The byte contract and replay: the same plan gives both sides of a sync the same packed-buffer layout.

    PackLayout.from_plans(plans)        where each write's bytes sit in a buffer, grouped by layer (pack, segments)
    Replayer(plan, sources).bind(t).pack() -> buffer      the trainer cuts the bytes out of its tensors (replay)
    QuantizingReplayer                  the same from BF16 into a block-FP8 consumer's layout (quantize)
    Applier(plan, layout, params).apply(buffer)           the consumer scatters them into its params (apply)
    plan_shards(plans, sources, shards)                   trainers that hold only boxes of each tensor (shards)

Both sides compute the layout independently and compare its digest before a byte moves; everything a layout and its
batches need is computed once per plan (columns, numpy) and every sync runs a few large copies per weight group.

Every fast path here is tested bit for bit against `shardplan.plan.interp.apply_reference` on random plans and
tensors with NaN-poisoned destinations (tests/unit/test_replay.py, test_columns.py, test_shards.py).

torch and shardplan.plan only: a trainer replays without vLLM (tensors.py holds the plumbing both sides share).
"""
