"""Recording: build each rank of a layout on the meta device, run vLLM's real loaders with a recording tensor, and
compile what they did into a plan file (docs/recording.md). The only stage that imports vLLM."""
