"""Regenerate every plan shipped in plans/ (`make plans`). Each is recorded for all ranks of its layout."""

import subprocess
import sys
from pathlib import Path

LAYOUTS = [
    ("kimi-k2", ["--tp", "32", "--ep"]),
    ("kimi-k2", ["--tp", "16", "--ep"]),
    ("kimi-k2", ["--tp", "32"]),
    ("deepseek-v3", ["--tp", "16", "--ep"]),
    ("qwen3-235b-a22b", ["--tp", "8"]),
    ("qwen3-235b-a22b", ["--tp", "8", "--ep"]),
    ("qwen3-30b-a3b", ["--tp", "4"]),
    ("llama-3.1-70b", ["--tp", "8"]),
    ("llama-3.1-8b", ["--tp", "1"]),
    ("llama-3.1-8b", ["--tp", "2"]),
    ("gpt-oss-120b", ["--tp", "8", "--ep"]),
    ("qwen3-next-80b-a3b", ["--tp", "4"]),
    ("glm-4.5", ["--tp", "8", "--ep"]),
    ("glm-4.6", ["--tp", "8", "--ep"]),
    # frontier MoEs at their published serving layouts (docs/configs.md)
    ("minimax-m2", ["--tp", "4"]),
    ("minimax-m2", ["--tp", "1", "--dp", "8", "--ep"]),
    ("kimi-linear-48b-a3b", ["--tp", "4"]),
    ("deepseek-v4-flash", ["--tp", "4", "--ep"]),
    ("deepseek-v4-flash", ["--tp", "1", "--dp", "4", "--ep"]),
    ("deepseek-v4-pro", ["--tp", "8", "--ep"]),
    ("qwen3.5-397b-a17b", ["--tp", "8"]),
    ("deepseek-v3.2", ["--tp", "16", "--ep"]),
    # block-FP8 checkpoints (quantization_config kept; the trainer quantizes on replay, docs/fp8.md)
    ("kimi-k2-fp8", ["--tp", "16", "--ep"]),
    ("kimi-k2-fp8", ["--tp", "8", "--ep"]),
    ("deepseek-v3-fp8", ["--tp", "16", "--ep"]),
    ("qwen3-30b-a3b-fp8", ["--tp", "4"]),
    ("qwen3-30b-a3b-fp8", ["--tp", "4", "--ep"]),
]

if __name__ == "__main__":
    out = Path(__file__).resolve().parent.parent / "plans"
    for model, flags in LAYOUTS:
        cmd = [sys.executable, "-m", "shardplan.cli", "record", "--model", model, *flags, "--out", str(out)]
        print("$", " ".join(cmd[1:]), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print("\n".join(proc.stdout.splitlines()[-2:]), flush=True)
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            sys.exit(proc.returncode)
