"""``aloe eval``: score an operator and baselines on an edit stream, write the report."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from aloe_build import EditDataError, load_edits
from aloe_build.checkpoints import file_sha256
from aloe_build.models import cache_root, resolve_dtype
from aloe_build.tokens import chat_template_key
from aloe_eval import AloeEditor, evaluate
from aloe_eval.baselines.grace import GraceConfig
from aloe_eval.baselines.weight_editors import WEIGHT_EDITORS
from aloe_eval.chat import CHAT_ANSWERS_CACHE, SYSTEMS, chat_evaluation, chat_markdown
from aloe_eval.chunks import ChunkStore
from aloe_eval.editors import Editor, UneditedEditor
from aloe_eval.protocol import edited_layer, fit_baseline
from aloe_kernels import AloeOperator, weight_fingerprint
from aloe_kernels.errors import AloeError
from aloe_kernels.hf import locate_down_proj
from aloe_kernels.write_positions import DEFAULT_WRITE_POSITIONS, add_write_positions_argument

from .options import DTYPE_CHOICES, MODEL_HELP, add_device_args, load_model_for


def _command(args: argparse.Namespace) -> str:
    parts = ["aloe", "eval", "--model", str(args.model)]
    if args.operator:
        parts += ["--operator", str(args.operator)]
    parts += ["--edits", str(args.edits)]
    if args.limit is not None:
        parts += ["--limit", str(args.limit)]
    if args.skip_invalid:
        parts.append("--skip-invalid")
    if args.out:
        parts += ["--out", str(args.out)]
    for b in args.baseline or []:
        parts += ["--baseline", b]
    if args.no_unedited:
        parts.append("--no-unedited")
    if args.layer is not None:
        parts += ["--layer", str(args.layer)]
    parts += ["--batch-size", str(args.batch_size)]
    if args.grace_eps is not None:
        parts += ["--grace-eps", str(args.grace_eps)]
    if args.grace_iters is not None:
        parts += ["--grace-iters", str(args.grace_iters)]
    if args.no_check_fingerprint:
        parts.append("--no-check-fingerprint")
    if args.no_plots:
        parts.append("--no-plots")
    if args.threads is not None:
        parts += ["--threads", str(args.threads)]
    if args.write_positions != DEFAULT_WRITE_POSITIONS:
        parts += ["--write-positions", args.write_positions]
    if args.chat != "off":
        parts += ["--chat", args.chat]
        for text in args.chat_system or []:
            parts += ["--chat-system", text]
    return shlex.join(parts)


PARTS_DIR = "parts"  # chunks of a running evaluation, under its output directory


def _default_out(args: argparse.Namespace) -> Path:
    stem = Path(args.edits).stem
    model = Path(str(args.model)).name.lower()
    tag = f"_n{args.limit}" if args.limit is not None else ""
    return Path("benchmarks") / "results" / f"eval_{model}_{stem}{tag}"


def _fail(message: str) -> int:
    """Print an ``aloe eval`` usage error; the exit status for it."""
    print(f"aloe eval: error: {message}", file=sys.stderr)
    return 2


def _baselines(args: argparse.Namespace) -> list[str]:
    """The baselines to score, unedited first unless --no-unedited, each once in the order given."""
    baselines = [] if args.no_unedited else ["unedited"]
    for b in args.baseline or []:
        if b not in baselines:
            baselines.append(b)
    return baselines


def _grace_config(args: argparse.Namespace) -> GraceConfig:
    """GRACE's settings: its own defaults, but for the radius and iterations given on the command line."""
    kw = {}
    if args.grace_eps is not None:
        kw["eps"] = args.grace_eps
    if args.grace_iters is not None:
        kw["n_iter"] = args.grace_iters
    return GraceConfig(**kw)


def _layer_error(op: AloeOperator, args: argparse.Namespace) -> str | None:
    """Why --layer does not fit the operator, or ``None`` when it does."""
    if args.layer is not None and op.layer is not None and args.layer != op.layer:
        return f"--layer {args.layer} but the operator was built for layer {op.layer}"
    if op.layer is None and args.layer is None:
        return "the operator records no layer; pass --layer"
    return None


def _editor(op: AloeOperator, args: argparse.Namespace) -> AloeEditor:
    """The editor that patches ``op`` into the model (checked by :func:`_layer_error` first)."""
    # "served" leaves the precision to the editor, which follows the model as the HF patch and vLLM do
    op_dtype = None if args.operator_dtype == "served" else resolve_dtype(args.operator_dtype, torch.device("cpu"))
    return AloeEditor(
        op,
        check_fingerprint=not args.no_check_fingerprint,
        layer=args.layer if op.layer is None else None,
        dtype=op_dtype,
        write_positions=args.write_positions,
    )


def _meta(args: argparse.Namespace, edits_path: Path) -> dict:
    """What the report records of its inputs, so that a result can be traced and reproduced."""
    return {
        "data_file": str(edits_path),
        "data_sha256": file_sha256(edits_path),
        "data_limit": args.limit,
        "operator_dir": str(args.operator) if args.operator else None,
        "write_positions": args.write_positions,
        "command": _command(args),
        "argv": list(sys.argv),
        "model_arg": str(args.model),
    }


def _save_report(report, out: Path, args: argparse.Namespace) -> None:
    """Write the report under ``out`` and print its summary tables and the files written."""
    paths = report.save(out, plots=not args.no_plots)
    ChunkStore(out / PARTS_DIR).clear()  # the report holds everything the chunks did
    print(report.to_markdown().split("## Definitions")[0].rstrip())
    print()
    for k, p in paths.items():
        print(f"wrote {k}: {p}")


def _cmd_eval(args: argparse.Namespace) -> int:
    """``aloe eval``: check the options, load the edits, operator and model, score, write the report."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    baselines = _baselines(args)
    if not args.operator and baselines == []:
        return _fail("nothing to evaluate: give --operator and/or --baseline")
    if args.chat_system and args.chat == "off":
        return _fail("--chat-system needs --chat also or --chat only")
    if args.sequential:
        return _cmd_sequential(args)
    try:
        edits_path = Path(args.edits)
        requests = load_edits(edits_path, args.limit, skip_invalid=args.skip_invalid)
        op = AloeOperator.load(args.operator) if args.operator else None
    except (EditDataError, AloeError, FileNotFoundError) as exc:
        return _fail(str(exc))
    model, tokenizer = load_model_for(args)
    grace_cfg = _grace_config(args) if "grace" in baselines else None
    editor = None
    if op is not None:
        error = _layer_error(op, args)
        if error is not None:
            return _fail(error)
        editor = _editor(op, args)
    meta = _meta(args, edits_path)
    out = Path(args.out) if args.out else _default_out(args)
    layer = edited_layer(model, editor, args.layer)
    # each baseline is fitted once, for the chat questions and the stream alike
    fitted = [
        fit_baseline(b, model, tokenizer, requests, layer, grace_cfg, args.batch_size, progress=not args.quiet) for b in baselines
    ]
    if args.chat != "off":
        chatted = ([editor] if editor is not None else []) + [e for e in fitted if not isinstance(e, UneditedEditor)]
        if not chatted:
            return _fail("--chat needs --operator or a --baseline other than unedited")
        for e in chatted:
            _chat(model, tokenizer, requests, e, layer, args, meta, out)
        if args.chat == "only":
            ChunkStore(out / PARTS_DIR).clear()  # the chat files hold every answer saved there
            return 0
    try:
        report = evaluate(
            model,
            tokenizer,
            requests,
            editor,
            batch_size=args.batch_size,
            progress=not args.quiet,
            baseline=fitted,
            layer=args.layer,
            grace_config=grace_cfg,
            meta=meta,
            chunk_edits=args.chunk_edits,
            parts_dir=out / PARTS_DIR,
        )
    except AloeError as exc:
        return _fail(str(exc))
    _save_report(report, out, args)
    return 0


def _chat(model, tokenizer, requests, editor: Editor, layer: int, args: argparse.Namespace, meta: dict, out: Path) -> None:
    """The chat-form evaluation (:mod:`aloe_eval.chat`) of one editor (``layer``: the evaluation's edited
    layer, which keys the unedited model's answers): the operator's into
    ``out/chat.json`` and ``out/chat.md``, a baseline's into ``out/chat_<kind>.json`` and ``.md``."""
    systems = {**SYSTEMS, **{f"system_{k + 1}": text for k, text in enumerate(args.chat_system or [])}}
    # the answers are saved under OUT/parts as they come, so an interrupted run resumes there; the
    # unedited model's answers go to a cache that every evaluation of the same model reads
    param = next(model.parameters())
    model_context = {
        # the evaluation's layer, whichever layers the editor changes: the unedited answers are shared
        "weight": weight_fingerprint(locate_down_proj(model, layer).weight()),
        "layer": layer,
        "dtype": str(param.dtype),
        "device": param.device.type,
        "template": chat_template_key(tokenizer),
    }
    # keyed by the editor's fitted state, never by its info, which holds this run's timings
    context = {"editor": editor.name, "state": editor.state_key()}
    saved = context["state"] is not None
    stem = "chat" if isinstance(editor, AloeEditor) else f"chat_{str(editor.info().get('kind', editor.name)).lower()}"
    result = chat_evaluation(
        model,
        tokenizer,
        requests,
        editor,
        batch_size=args.batch_size,
        progress=not args.quiet,
        systems=systems,
        parts=ChunkStore(out / PARTS_DIR) if saved else None,
        context=context,
        model_context=model_context,
        unedited_parts=ChunkStore(cache_root() / CHAT_ANSWERS_CACHE),
    )
    result["meta"] = {**meta, "editor": editor.name}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    table = chat_markdown(result)
    (out / f"{stem}.md").write_text(f"Command: `{meta['command']}`\nEditor: {editor.name}\n\n{table}\n")
    print(f"{editor.name}:\n{table}")
    print(f"wrote chat: {out / (stem + '.json')}")


def _cmd_sequential(args: argparse.Namespace) -> int:
    """``--sequential K``: build the first batch, append the others, score all edits so far after each."""
    from aloe_eval.sequential import run_sequential

    if args.operator:
        return _fail("--sequential builds its own operators; do not pass --operator")
    requests = load_edits(Path(args.edits), args.limit, skip_invalid=args.skip_invalid)
    model, tokenizer = load_model_for(args)
    out = Path(args.out) if args.out else _default_out(args).with_name(_default_out(args).name + f"_seq{args.sequential}")
    result = run_sequential(model, tokenizer, requests, args.sequential, out, batch_size=args.batch_size, progress=not args.quiet)
    print(f"wrote {out / 'sequential.json'} and {out / 'retention.png'} ({len(result['steps'])} steps)")
    return 0


def _add_input_args(p: argparse.ArgumentParser) -> None:
    """What is scored on what: the model, the operator, the edit stream, and where the report goes."""
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--operator", default=None, help="ALOE artifact directory (omit to score baselines only)")
    p.add_argument("--edits", required=True, help="edit file (any format aloe_build.data.load_edits reads)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N edits of the file")
    p.add_argument("--skip-invalid", action="store_true", help="drop invalid records instead of failing")
    p.add_argument(
        "--out", default=None, help="output directory (default benchmarks/results/eval_<model>_<data stem>[_n<limit>])"
    )


def _add_baseline_args(p: argparse.ArgumentParser) -> None:
    """The baselines scored beside the operator, and the layer they edit."""
    p.add_argument(
        "--baseline",
        action="append",
        choices=["grace", "unedited", "told", *WEIGHT_EDITORS, "ft-m", "wise"],
        default=None,
        help="also score this baseline on the same model and stream (repeatable): told, the unedited model asked "
        "every prompt of an edit after its statement ('<request> <target>. <prompt>', also in chat), reported as "
        "'unedited, told the fact'; GRACE on the same layer (its "
        "values saved under $ALOE_CACHE/grace after each batch); ROME, MEMIT or AlphaEdit, the weight editors, on "
        "their own early layers (their target values cached under $ALOE_CACHE/weight-edits); FT-M, sequential "
        "fine-tuning of one down-projection (layer 8 of 30, saved under $ALOE_CACHE/ft-m as it goes); WISE, a "
        "routed side memory of one late down-projection (layer 26 of 30, saved under $ALOE_CACHE/wise as it "
        "goes): a rerun resumes any of them; the unedited model is always scored "
        "unless --no-unedited",
    )
    p.add_argument("--no-unedited", action="store_true", help="do not score the unedited model as a baseline")
    p.add_argument(
        "--layer",
        type=int,
        default=None,
        help="edited layer for baselines (default: the operator's layer, else the model's default)",
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """How the evaluation runs: batching, chunks, GRACE's settings, checks, output and threads."""
    p.add_argument("--batch-size", type=int, default=32, help="sequences per forward pass (default 32)")
    p.add_argument(
        "--chunk-edits",
        type=int,
        default=500,
        metavar="N",
        help="score N edits at a time, each chunk saved under OUT/parts as it finishes, so that an "
        "interrupted run resumes there (default 500; the numbers do not depend on it)",
    )
    p.add_argument("--grace-eps", type=float, default=None, help="GRACE initial deferral radius (default 1.0)")
    p.add_argument("--grace-iters", type=int, default=None, help="GRACE value-training iterations (default 100)")
    p.add_argument(
        "--no-check-fingerprint",
        action="store_true",
        help="apply the operator even if its weight fingerprint does not match the model",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures (their data still goes to eval_plots.json)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_protocol_args(p: argparse.ArgumentParser) -> None:
    """The other protocols: the lifelong (sequential) one and the chat-form questions."""
    p.add_argument(
        "--sequential",
        type=int,
        default=0,
        metavar="K",
        help="lifelong protocol: build the first of K batches, append the others one by one, and score "
        "all edits so far after each (operators in OUT/op<k>, curve in OUT/sequential.json, "
        "OUT/retention.png; resumable)",
    )
    add_device_args(p)  # here, so that --help lists the options in their usual order
    p.add_argument(
        "--chat",
        default="off",
        choices=("off", "also", "only"),
        help="also (or only) ask each request through the model's chat template, with its default and "
        "with a custom system prompt (chat.json, chat.md); the unedited model's answers are kept "
        "under $ALOE_CACHE/chat-answers (default ~/.cache/aloe) for the next evaluation",
    )
    add_write_positions_argument(p)
    p.add_argument(
        "--chat-system",
        action="append",
        metavar="TEXT",
        help="with --chat: also ask after this system prompt (repeatable; reported as system_1, ...)",
    )


def add_eval_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``aloe eval`` on the ``aloe`` command's subparsers; returns the subparser."""
    p = subparsers.add_parser(
        "eval",
        help="score an operator (and baselines) on an edit stream",
        description="Score an ALOE operator on an edit stream with the paper's protocol (greedy exact match), "
        "EasyEdit's teacher-forced token accuracy, and gate diagnostics; compare with the unedited model and "
        "a GRACE reimplementation on the same model, layer and stream. Writes eval_report.json and "
        "eval_report.md (the summaries), eval_rows.jsonl.gz (the per-edit rows), eval_plots.json (the data of "
        "the figures) and PNG plots.",
    )
    _add_input_args(p)
    _add_baseline_args(p)
    _add_run_args(p)
    _add_protocol_args(p)
    p.add_argument(
        "--operator-dtype",
        default="served",
        choices=("served",) + DTYPE_CHOICES[1:],
        help="precision of the patched operator (default served: float32 on CPU, the model's dtype on "
        "a GPU, as the HF patch and vLLM serve it); bfloat16 on CPU reproduces a GPU's numbers",
    )
    p.set_defaults(func=_cmd_eval)
    return p
