"""shardplan: record vLLM's weight loaders once, replay each inference rank's exact bytes at every sync."""

__version__ = "0.1.0"
