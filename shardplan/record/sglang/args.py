"""The command-line options of `shardplan record|verify --engine sglang`: SGLang's server args that change layouts
(options.SglangOptions), parsed and refused by name when given without `--engine sglang`."""

from __future__ import annotations

from shardplan.errors import ShardplanError
from shardplan.record.sglang.options import SglangOptions


def add_sglang_arguments(p) -> None:
    group = p.add_argument_group("SGLang server args that change layouts (--engine sglang; kept in the plan header)")
    dests = []

    def add(*flags, **kw):
        dests.append(group.add_argument(*flags, **kw).dest)

    add("--ep-size", type=int, default=None, help="SGLang --ep-size (default with --ep: the TP size)")
    add(
        "--enable-dp-attention",
        action="store_true",
        help="SGLang DP attention: --dp N shards attention over tp/N ranks inside the TP group",
    )
    add("--enable-dp-lm-head", action="store_true", help="SGLang --enable-dp-lm-head")
    add("--moe-dense-tp-size", type=int, default=None, help="SGLang --moe-dense-tp-size")
    add("--moe-runner-backend", default=None, help="SGLang --moe-runner-backend (default auto)")
    add("--moe-a2a-backend", default=None, help="SGLang --moe-a2a-backend (default none)")
    add(
        "--ep-num-redundant-experts",
        type=int,
        default=None,
        help="SGLang --ep-num-redundant-experts (EPLB's extra expert slots)",
    )
    add(
        "--sglang-cpu-engine",
        action="store_true",
        help="record SGLang's CPU engine layout (SGLANG_USE_CPU_ENGINE=1: padded CPU linears)",
    )
    # sglang_options refuses these without --engine sglang: this function is their one list
    p.set_defaults(sglang_arg_dests=tuple(dests))


class EngineArgsError(ShardplanError):
    pass


def sglang_options(args):
    """The SGLang recording options from the command line; None for --engine vllm (which refuses them)."""
    given = [a for a in args.sglang_arg_dests if getattr(args, a) not in (None, False)]
    if args.engine != "sglang":
        if given:
            raise EngineArgsError(
                f"--{given[0].replace('_', '-')} is an SGLang server arg: add --engine sglang "
                f"(vLLM's layouts are --tp/--pp/--dp/--ep)"
            )
        return None
    if getattr(args, "trust_remote_code", False):
        raise EngineArgsError(
            "--trust-remote-code is not supported with --engine sglang: shardplan builds SGLang's "
            "models without remote code (docs/sglang.md)"
        )
    d = SglangOptions()
    if args.dp > 1 and not args.enable_dp_attention:
        raise EngineArgsError(
            "--engine sglang --dp N: SGLang's data-parallel replicas each load what one TP group "
            "loads (record --tp alone and use the plan for every replica); for DP attention add "
            "--enable-dp-attention"
        )
    ep_size = args.ep_size if args.ep_size is not None else (args.tp if args.ep else 1)
    if args.ep_size is not None and args.ep_size > 1 and not args.ep:
        raise EngineArgsError(f"--ep-size {args.ep_size}: add --ep (experts split over ranks)")
    return SglangOptions(
        ep_size=ep_size,
        dp_size=args.dp if args.enable_dp_attention else 1,
        enable_dp_lm_head=args.enable_dp_lm_head,
        moe_dense_tp_size=args.moe_dense_tp_size or 0,
        moe_runner_backend=args.moe_runner_backend or d.moe_runner_backend,
        moe_a2a_backend=args.moe_a2a_backend or d.moe_a2a_backend,
        ep_num_redundant_experts=args.ep_num_redundant_experts or 0,
        cpu_engine=args.sglang_cpu_engine,
    )
