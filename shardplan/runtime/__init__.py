"""The byte contract and replay: where each write's bytes sit in a packed buffer (pack, packcols), packing them from
the trainer's tensors (replay, quantize), scattering them into a consumer's params (apply), trainers that hold only
shards (shards), and the tensor plumbing both sides share (tensors). torch and shardplan.plan only: no vLLM."""
