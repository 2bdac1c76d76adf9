"""`shardplan record | verify | inspect | models | coverage | simulate` and `--version`: a thin layer over session,
store and inspect."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import os
import sys
import tempfile
import time

from shardplan import __version__
from shardplan.errors import ShardplanError
from shardplan.models import list_models, resolve_model
from shardplan.plan.file import store
from shardplan.plan.file.format import write_plan
from shardplan.plan.inspect import human_bytes, inspect_plan
from shardplan.plan.layout import Layout, parse_ranks
from shardplan.record import coverage, remote
from shardplan.record.session import RecordSession
from shardplan.record.sglang.args import add_sglang_arguments, sglang_options
from shardplan.record.sglang.session import SglangRecordSession
from shardplan.record.sglang.verify import verify_rank as verify_sglang_rank
from shardplan.record.verify import random_checkpoint, verify_rank
from shardplan.simulate import cli as simulate_cli


def _layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="built-in short name or HF id (see `shardplan models`), a local HF directory, or a config.json path",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (shapes the expert-parallel group)")
    p.add_argument("--ep", action="store_true", help="vLLM's enable_expert_parallel")
    p.add_argument("--ranks", default=None, help="global ranks to record, e.g. 0,3-5 (default: all)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. num_hidden_layers=2 (repeatable; dotted keys for nested)",
    )
    p.add_argument(
        "--engine",
        default="vllm",
        choices=["vllm", "sglang"],
        help="whose loaders to record: vLLM's (default) or SGLang's (docs/sglang.md)",
    )
    add_sglang_arguments(p)
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the config and model code in --model's local directory (its auto_map), as vLLM's "
        "--trust-remote-code does; never fetched from the hub. Recorded in the plan header",
    )


class _Version(argparse.Action):
    """--version: computed when asked (it reads the shipped plans' headers), not at every parse."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def version_text() -> str:
    """The package's version, the engine versions the shipped plans were recorded with, and those installed here."""
    shipped = store.shipped_versions()
    recorded = "; ".join(
        f"{engine} " + ", ".join(f"{v} ({n})" for v, n in sorted(counts.items()))
        for engine, counts in sorted(shipped.items())
    )
    installed = "; ".join(
        f"{engine} {store.installed_engine_version(engine) or 'not installed'}" for engine in ("vllm", "sglang")
    )
    total = sum(n for counts in shipped.values() for n in counts.values())
    return (
        f"shardplan {__version__}\n"
        f"shipped plans: {total} in {store.SHIPPED_DIR}, recorded with {recorded or '(none)'}\n"
        f"installed: {installed}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardplan", description=__doc__)
    parser.add_argument(
        "--version",
        action=_Version,
        help="print the version and the engine versions the shipped plans were recorded with",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    rec = sub.add_parser("record", help="record vLLM's loaders for a model and layout into a plan file")
    _layout_args(rec)
    rec.add_argument("--out", default=None, help="output directory (default: the per-user plan cache)")
    rec.add_argument(
        "--strict",
        action="store_true",
        help="fail on any loader that cannot be recorded, instead of recording it as a fallback",
    )
    rec.add_argument(
        "--exhaustive",
        action="store_true",
        help="record every rank fully (no sampling); the output is byte-identical either way",
    )
    rec.add_argument(
        "--eplb-redundant",
        type=int,
        default=None,
        metavar="R",
        help="for engines running vLLM's EPLB with R redundant expert slots (R >= 0; needs --ep): expert "
        "writes name their physical slot, bound to the live placement at every sync (docs/eplb.md)",
    )

    ver = sub.add_parser("verify", help="prove replay == vLLM's real load_weights, bitwise, on random tensors")
    _layout_args(ver)
    ver.add_argument("--seed", type=int, default=0)

    ins = sub.add_parser("inspect", help="print a plan: IR, bytes per rank and layer, redundancy, ops, fallbacks")
    ins.add_argument("plan", help="plan file path")
    ins.add_argument("--rank", type=int, default=None, help="print this rank's IR (default: summary only)")
    ins.add_argument("--max-lines", type=int, default=200, help="IR lines to print (0: all)")

    sub.add_parser("models", help="list the built-in models")
    cov = sub.add_parser(
        "coverage",
        help="record + verify every text decoder vLLM implements (tiny configs, TP 1/2/4, "
        "every rank) and write docs/coverage.md; options as python -m "
        "shardplan.record.coverage --help",
        add_help=False,
    )
    cov.add_argument("args", nargs=argparse.REMAINDER)
    simulate_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # --trust-remote-code: the hub stays off for the whole command, verify's builds included (record/remote.py)
    offline = remote.hub_offline() if getattr(args, "trust_remote_code", False) else contextlib.nullcontext()
    try:
        with offline:
            return _COMMANDS[args.command](args)
    except ShardplanError as e:
        print(f"shardplan {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _layout(args):
    dp = 1 if args.engine == "sglang" and args.enable_dp_attention else args.dp  # DP attention: inside the TP group
    layout = Layout(tp=args.tp, pp=args.pp, dp=dp, ep=args.ep)
    return layout, parse_ranks(args.ranks, layout.world_size)


def _session(args, layout, **kwargs):
    options = sglang_options(args)
    if options is None:
        return RecordSession(
            args.model,
            layout,
            dtype=args.dtype,
            overrides=args.override,
            trust_remote_code=args.trust_remote_code,
            **kwargs,
        )
    return SglangRecordSession(args.model, layout, dtype=args.dtype, overrides=args.override, options=options, **kwargs)


def _progress(total: int):
    start = time.perf_counter()
    done = [0]

    def tick(stats):
        done[0] += 1
        width = 30
        filled = width * done[0] // total
        elapsed = time.perf_counter() - start
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done[0]}/{total} ranks  {elapsed:6.1f}s")
        if done[0] == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return tick


class UnknownOverrideKey(ShardplanError):
    pass


class OutputNotWritable(ShardplanError):
    pass


def _check_override_keys(model: str, overrides: list[str]) -> None:
    """A misspelt --override key would record the unshrunk model without a word: refuse a key that neither the
    config nor its transformers config class knows, naming the closest known key. Dotted keys: the first part."""
    keyed = [(text, text.split("=", 1)[0].split(".")[0].strip()) for text in overrides if "=" in text]
    if not keyed:
        return
    config = resolve_model(model).config
    known = set(config)
    try:
        from transformers import AutoConfig

        known |= set(AutoConfig.for_model(config["model_type"]).to_dict())
    except (ImportError, ValueError, KeyError, TypeError):
        pass  # a model type transformers does not know: the config's own keys are all there is
    for text, key in keyed:
        if key and key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else "see the model's config.json for its fields."
            raise UnknownOverrideKey(
                f"--override {text!r}: {model} has no config field {key!r}; {hint} "
                f"(`shardplan models` lists the built-ins; docs/recording.md)"
            )


def _check_out(args, layout, ranks) -> os.PathLike:
    """The plan's path, after proving its directory is writable: before minutes of recording, not after."""
    path = store.plan_path(resolve_model(args.model, args.override), layout, args.dtype, out_dir=args.out, ranks=ranks)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".shardplan-write-test-"):
            pass
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "the plan's file name is taken by a directory")
    except OSError as e:
        raise OutputNotWritable(
            f"--out {args.out or path.parent}: cannot write {path} ({e.strerror or e}). Choose "
            f"a writable directory with --out; nothing was recorded."
        ) from None
    return path


def cmd_record(args) -> int:
    layout, ranks = _layout(args)
    options = sglang_options(args)
    _check_override_keys(args.model, args.override)
    path = _check_out(args, layout, ranks)
    if (
        args.eplb_redundant is not None
    ):  # its own file: a plan without the slots must not be found for an engine with them
        path = path.with_name(path.name.replace(f"--{layout.tag()}--", f"--{layout.tag()}-eplb{args.eplb_redundant}--"))
    if options is not None:  # its own file too: SGLang lays weights out differently from vLLM
        path = path.with_name(path.name.replace(f"--{layout.tag()}--", f"--{layout.tag()}-{options.tag()}--"))
    t0 = time.perf_counter()
    session = _session(args, layout, strict=args.strict, eplb_redundant=args.eplb_redundant)
    recorded = session.record_plans(ranks, exhaustive=args.exhaustive, progress=_progress(len(ranks)))
    stats = recorded.stats
    data = session.encode(recorded.body)
    write_plan(path, data)
    print(f"{'rank':>5} {'recorded':>9} {'fallback':>9} {'not needed':>11} {'bytes':>12} {'seconds':>8}")
    for s in stats:
        print(
            f"{s.rank:>5} {s.num_recorded:>9} {s.num_fallback:>9} {s.num_not_needed:>11} {human_bytes(s.nbytes):>12} "
            f"{s.seconds:>8.2f}"
        )
    print(
        f"{len(ranks)} ranks of {session.spec.name} {layout.tag()} {args.dtype}: {len(session.tensors)} checkpoint "
        f"tensors; plan {path} ({human_bytes(len(data))}); {time.perf_counter() - t0:.1f}s"
    )
    print(f"recording: {recorded.how}")
    full = [s for s in stats if s.tier == "full"]
    if full:  # the full tier is exact too, only slower: say why the fast one could not be used
        print(f"recorder: full tier on {len(full)} of {len(stats)} ranks ({full[0].tier_note})")
    else:
        print("recorder: fast tier on every rank")
    fallbacks = [(r, f) for r, fs in sorted(recorded.body.fallbacks.items()) for f in fs]
    for rank, f in fallbacks[:10]:
        print(f"  fallback on rank {rank}: {f.source}: {f.op} in {f.loader or '?'}: {f.reason}")
    if len(fallbacks) > 10:
        print(f"  ... {len(fallbacks) - 10} more fallbacks (shardplan inspect lists them all)")
    return 0


def cmd_verify(args) -> int:
    layout, ranks = _layout(args)
    _check_override_keys(args.model, args.override)
    session = _session(args, layout)
    checkpoint = random_checkpoint(session.tensors, args.seed)
    failures = 0
    print(f"{'rank':>5} {'params':>7} {'mismatched':>11} {'unwritten':>10}  verdict")
    for rank in ranks:
        plan, _ = session.record_rank(rank)
        if args.engine == "sglang":
            verdict = verify_sglang_rank(session.builder, rank, plan, checkpoint)
        else:
            verdict = verify_rank(session.vllm_config, layout, rank, plan, checkpoint)
        failures += not verdict.ok
        print(
            f"{rank:>5} {verdict.num_params:>7} {len(verdict.mismatched):>11} {len(verdict.unwritten):>10}  "
            f"{'bitwise equal' if verdict.ok else 'MISMATCH'}"
        )
        for name in verdict.mismatched:
            print(f"      mismatch: {name}")
        constructed = set(verdict.constructed)
        if constructed:
            shown = ", ".join(sorted(constructed)[:3]) + (
                f" and {len(constructed) - 3} more" if len(constructed) > 3 else ""
            )
            print(
                f"      initialised at construction, not by the loader (poisoned here, so left NaN by both): "
                f"{len(constructed)} buffers ({shown}); vLLM sets them when it builds the model and a plan leaves them"
            )
        for name in verdict.unwritten:
            if name in constructed:
                continue
            nan, numel = verdict.undefined.get(name, (0, 0))
            part = f"{nan} of {numel} elements" if nan < numel else "every element"
            print(
                f"      not written by the real loader either (left NaN): {name}: {part}; no checkpoint tensor "
                f"defines them, so vLLM leaves them uninitialised and the plan does not write them (the shardplan "
                f"engine backend zeroes them at every update)"
            )
    engine = "SGLang" if args.engine == "sglang" else "vLLM"
    print(f"{len(ranks) - failures}/{len(ranks)} ranks bitwise equal to {engine}'s load_weights")
    return 1 if failures else 0


def cmd_inspect(args) -> int:
    print(inspect_plan(args.plan, rank=args.rank, max_lines=args.max_lines))
    return 0


def cmd_models(args) -> int:
    for short, hf_id, arch in list_models():
        print(f"{short:<20} {hf_id:<40} {arch}")
    return 0


def cmd_coverage(args) -> int:
    return coverage.main(args.args)


_COMMANDS = {
    "record": cmd_record,
    "verify": cmd_verify,
    "inspect": cmd_inspect,
    "models": cmd_models,
    "coverage": cmd_coverage,
    "simulate": simulate_cli.run,
}

if __name__ == "__main__":
    sys.exit(main())
