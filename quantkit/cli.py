"""The `quantkit` command: click + rich wiring over the core, nothing else."""

from __future__ import annotations

import json
import os
import shlex
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from quantkit.errors import QuantkitError
from quantkit.formats import DEFAULT_FORMAT, FORMAT_CHOICES
from quantkit.methods import CLI_METHODS
from quantkit.methods.options import (
    CALIB_FLAGS,
    FLAG_READERS,
    FLAGS,
    FORMAT_FLAG,
    Flag,
    FlagValues,
    shared_options,
)

# emoji off: rich would turn ":train:" in user input (hf:wikitext:...:train:text) into a symbol;
# user- and engine-supplied text is passed through escape() / Text, never read as markup
console = Console(stderr=True, emoji=False)
out = Console(emoji=False)

class _Progress:
    """Turns the core's on_progress(stage, done, total) calls into rich bars."""

    def __init__(self):
        self.progress = Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                                 transient=False)
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage.startswith("resuming"):  # a one-off event, not a bar
            self.progress.console.print(f"[cyan]{escape(stage)}[/] (checkpoint of an earlier run)")
            return
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(stage, total=total)
        self.progress.update(self.tasks[stage], completed=done, total=total)


def _fail(exc: QuantkitError) -> None:
    console.print(f"[bold red]error:[/] {escape(exc.message)}", soft_wrap=True)
    if exc.hint:
        console.print(f"[yellow]hint:[/] {escape(exc.hint)}", soft_wrap=True)
    sys.exit(2)


def _warn(message, category, filename, lineno, file=None, line=None) -> None:
    """Core warnings (fallbacks, choices made for the user) as one `warning:` line each."""
    console.print(f"[yellow]warning:[/] {escape(str(message))}", soft_wrap=True)


class _Group(click.Group):
    def invoke(self, ctx):
        warnings.showwarning = _warn
        try:
            return super().invoke(ctx)
        except QuantkitError as exc:
            _fail(exc)
        except KeyboardInterrupt as exc:  # quantize says what is on disk; others wrote nothing
            console.print(f"[red]interrupted[/]: {escape(str(exc.args[0]) if exc.args else 'stopped')}",
                          soft_wrap=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="quantkit")
def main() -> None:
    """quantkit: quantize LLMs, evaluate the artifacts, compare them.

    MODEL is a built-in alias (smollm2-135m), a local Hugging Face directory or a Hub id.
    """


def _click_option(flag: Flag) -> Callable:
    """The click option of one of quantkit.methods.options.FLAGS."""
    kw: dict = {"default": flag.default, "help": flag.help}
    if flag.kind == "flag":
        kw = {"is_flag": True, "help": flag.help}
    elif flag.kind == "choice":
        kw["type"] = click.Choice(list(flag.choices))
    elif flag.kind == "float_range":
        kw["type"] = click.FloatRange(*flag.bounds)
    elif flag.kind == "int_range":
        kw["type"] = click.IntRange(*flag.bounds)
    elif flag.kind == "path":
        kw["type"] = click.Path(dir_okay=False)
    elif flag.kind in ("int", "float"):
        kw["type"] = int if flag.kind == "int" else float
    if flag.name == FORMAT_FLAG:  # the formats' registry knows their names
        kw.update(default=DEFAULT_FORMAT, show_default=True,
                  help=f"Artifact format: {FORMAT_CHOICES}.")
    if flag.show_default:
        kw["show_default"] = True
    if flag.metavar:
        kw["metavar"] = flag.metavar
    if kw.get("help") is None:
        kw.pop("help")
    return click.option(*flag.decls, **kw)


def _method_options(f):
    """The flags `quantize` and `plan` share (one definition, so they cannot drift apart)."""
    opts = [click.argument("model"),
            click.option("--method", type=click.Choice(list(CLI_METHODS)), required=True,
                         help="Quantization algorithm."),
            *(_click_option(flag) for flag in FLAGS)]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _given_flags(ctx: click.Context) -> dict[str, str]:
    """The FLAG_READERS flags the user typed, as typed (--asym, not --sym/--asym)."""
    given = {}
    for param in ctx.command.params:
        if param.name in FLAG_READERS and ctx.get_parameter_source(param.name) not in (
                None, click.core.ParameterSource.DEFAULT):
            off = param.secondary_opts and ctx.params.get(param.name) is False
            given[param.name] = param.secondary_opts[0] if off else param.opts[0]
    return given


def check_flags_apply(ctx: click.Context, method: str) -> FlagValues:
    """Refuse a flag that --method (with its other flags) would not read; the flags as the
    method's record sees them."""
    from quantkit.methods import method_record

    record = method_record(method)
    given = _given_flags(ctx)
    if ctx.params.get("kv_cache") and record.kv_cache_calibrates:  # KV scales calibrate on the data
        given = {n: f for n, f in given.items() if n not in CALIB_FLAGS}
    for name, flag in given.items():
        readers = FLAG_READERS[name]
        if method not in readers:
            raise QuantkitError(
                f"{flag} is read by --method {' / '.join(readers)} only; --method {method} does "
                "not use it.", f"Drop {flag}, or use --method {readers[0]}.")
    explicit = {name for name in ctx.params
                if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)}
    values = FlagValues(dict(ctx.params), given, explicit)
    record.check_flags(values)
    return values


def _request(**extra):
    """The QuantizeRequest of this `quantize` / `plan` command line; `extra`: its other fields."""
    from quantkit.methods import method_record

    ctx = click.get_current_context()
    model, method = ctx.params["model"], ctx.params["method"]
    alias = method_record(method).format_aliases.get(ctx.params[FORMAT_FLAG])
    if alias:  # the format makes it another method's request (GPTQ onto GGML grids)
        method, overrides = alias
        ctx.params.update(overrides)
    values = check_flags_apply(ctx, method)  # before the pipeline and the model load
    from quantkit.pipeline.quantize import QuantizeRequest

    record = method_record(method)
    p = values.values
    if record.native_format and p[FORMAT_FLAG] == DEFAULT_FORMAT:  # its only format
        if FORMAT_FLAG in values.explicit:
            raise QuantkitError(*record.native_format_refusal)
        p[FORMAT_FLAG] = record.native_format
    built = record.build(values, shared_options(values))
    return QuantizeRequest(model=model, method=method, scheme=built.scheme,
                           out=Path(p.get("output") or "."), format=built.format,
                           force=bool(p.get("force")), calib=p["calib"],
                           calib_samples=p["calib_samples"], calib_seqlen=p["calib_seqlen"],
                           seed=p["seed"], chat=p["chat"], allow_pickle=p["allow_pickle"],
                           trust_remote_code=p["trust_remote_code"], device=p["device"],
                           method_options=built.options, stream=p["stream"],
                           group_size_auto=built.group_size_auto, text_column=p["text_column"],
                           # --sym / --asym not typed: the format's grid (asymmetric for mlx)
                           symmetric_auto=method in FLAG_READERS["sym"]
                           and "sym" not in values.explicit,
                           # GPTQ without --act-order / --no-act-order: the format's (on for mlx)
                           act_order_auto=method in FLAG_READERS["act_order"]
                           and "act_order" not in values.explicit,
                           moe_calibrate_all_experts=p["moe_calibrate_all_experts"],
                           expert_min_tokens=p["expert_min_tokens"], kv_cache=p["kv_cache"],
                           command="quantkit " + shlex.join(sys.argv[1:]), **extra)


@main.command()
@_method_options
@click.option("-o", "--output", "output", required=True, type=click.Path(), help="Artifact path.")
@click.option("--force", is_flag=True, help="Replace an existing output.")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Checkpoint every finished block in .OUTPUT.partial/ and continue from it "
                   "when the same command runs again.")
@click.option("--no-memory-check", "no_memory_check", is_flag=True,
              help="Skip the early refusal when the planned peak RAM exceeds what is available "
                   "($QUANTKIT_MEMORY_LIMIT_BYTES caps what counts as available).")
@click.option("--reproducible", is_flag=True,
              help="Pin torch, MKL, oneDNN and OpenBLAS to their AVX2 kernels, so the same "
                   "command gives the same bytes on any x86-64 CPU with AVX2 (slower where "
                   "the CPU has AVX-512; same as QUANTKIT_REPRODUCIBLE=1).")
@click.option("--quantize-vision", "quantize_vision", is_flag=True,
              help="Vision-language checkpoints: quantize the vision encoder's Linears too "
                   "(round-to-nearest where the method calibrates: calibration text never "
                   "reaches the vision tower). Default: the vision tower and projector stay "
                   "dense.")
@click.option("--quantize-mtp", "quantize_mtp", is_flag=True,
              help="Checkpoints with multi-token-prediction (MTP) layers (GLM-4.5, DeepSeek-V3 "
                   "nextn blocks, Qwen3.5 / Qwen3-Next mtp.*): quantize their Linears like the "
                   "trunk's (round-to-nearest in the same scheme where the method calibrates: "
                   "transformers gives no forward for them). Default: they are kept dense, as "
                   "stored. Not for GGUF.")
@click.option("--verify", "verify_engine", type=click.Choice(["vllm", "llamacpp", "trtllm", "mlx"]),
              default=None, help="Run `quantkit verify OUT --engine E` at the end and keep its "
                                 "result in the artifact's metadata (compare shows it).")
def quantize(resume, no_memory_check, reproducible, quantize_vision, quantize_mtp, verify_engine,
             **kw) -> None:
    """Quantize MODEL with METHOD and write an engine-ready artifact to -o."""
    from quantkit import reproducible as mode

    if reproducible and not mode.active():  # the libraries are loaded: pin them in a new process
        mode.reexec_with_mode()
    from quantkit.pipeline.quantize import quantize as run

    req = _request(resume=resume, memory_check=not no_memory_check,
                   reproducible=mode.active(), quantize_vision=quantize_vision,
                   quantize_mtp=quantize_mtp)
    if os.environ.get("RANK", "0") != "0":  # a data-parallel worker (torchrun): rank 0 reports
        run(req)
        return
    with _Progress() as progress:
        meta = run(req, on_progress=progress)
    console.print(f"[green]wrote[/] {escape(str(req.out))} ({meta['format']}, {meta['method']}, "
                  f"{req.scheme.describe()}) in {meta['seconds']['total']:.1f} s")
    _print_info(str(req.out))
    if verify_engine:
        from quantkit.verify import record_verification
        from quantkit.verify import verify as run_verify

        result = run_verify(req.out, verify_engine,
                            on_progress=lambda s: console.print(f"[dim]{escape(s)}[/]"))
        record_verification(req.out, result)
        _print_verify(result)
        if not result.ok:  # the artifact is kept (and says so in its metadata), the run fails
            sys.exit(result.exit_code)


@main.command("plan")
@_method_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--gpus", type=int, default=1, show_default=True,
              help="Plan a data-parallel run over this many GPUs (torchrun --nproc-per-node N): "
                   "the peaks are per GPU (one rank's process), the time the whole run's.")
def plan_cmd(as_json, gpus, **kw) -> None:
    """Expected peak RAM / GPU memory, artifact size and time of `quantize`, before any work."""
    from quantkit.machine import available_memory
    from quantkit.pipeline.quantize import plan

    p, info = plan(_request(), gpus=gpus)
    avail, why = available_memory()
    record = {**info, **p.to_dict(), "available_ram_bytes": avail, "available_ram_source": why}
    if as_json:
        out.print_json(json.dumps(record))
        return
    gib = 2**30
    table = Table(title=f"quantkit plan: {escape(kw['model'])} ({info['method']}, {info['scheme']})")
    table.add_column("item")
    table.add_column("estimate", justify="right")
    rows = [("model weights (stored dtype)", f"{p.model_bytes / gib:.2f} GiB"),
            ("largest block", f"{p.block_params / 1e6:.1f} M params"),
            ("peak RAM", f"{p.peak_ram_bytes / gib:.2f} GiB"
             + ("" if p.streaming else " (whole model in memory)")),
            *((f"  phase: {k}", f"{v / gib:.2f} GiB + baseline") for k, v in p.phase_bytes.items()),
            ("available RAM", f"{avail / gib:.2f} GiB ({why})"),
            ("peak GPU memory", f"{p.peak_gpu_bytes / gib:.2f} GiB" if p.peak_gpu_bytes else "-"),
            *((("  activations offloaded", f"{p.peak_gpu_offloaded_bytes / gib:.2f} GiB (chosen "
                "when the peak above does not fit the free GPU memory)"),)
              if p.peak_gpu_offloaded_bytes else ()),
            ("artifact on disk", f"{p.disk_bytes / gib:.2f} GiB"),
            *((("ranks", f"{p.gpus} processes, one GPU each: the peaks above are per rank"),
               ("  solves", f"{p.solve_seconds / 60:.1f} min, "
                + ("spread over the ranks" if p.solves_spread else "on rank 0"))) if p.gpus > 1 else ()),
            ("time (rough)", f"{p.seconds / 60:.1f} min on "
             + (f"{p.gpus} x {info['device']}" if p.gpus > 1 else info["device"]))]
    for k, v in rows:
        _add_row(table, k, v)
    out.print(table)
    if p.peak_ram_bytes > avail:
        console.print("[yellow]warning:[/] the peak exceeds available RAM; quantize would refuse")


def _speed_settings(f):
    """--speed-prompt, --speed-gen, --speed-batch, --repeats: one definition for eval and compare."""
    for opt in reversed((
            click.option("--speed-prompt", type=int, default=256, show_default=True,
                         help="Prompt tokens per request for --speed."),
            click.option("--speed-gen", type=int, default=32, show_default=True,
                         help="New tokens per request for --speed."),
            click.option("--speed-batch", default="1,8", show_default=True,
                         help="Batch sizes for --speed."),
            click.option("--repeats", type=int, default=3, show_default=True,
                         help="Timed runs per batch size after one warm-up."))):
        f = opt(f)
    return f


def _batches(text: str) -> tuple[int, ...]:
    try:
        batches = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise QuantkitError(f"--speed-batch {text!r} is not a list of batch sizes.",
                            "Pass positive integers separated by commas, e.g. --speed-batch 1,8.")
    return batches


@main.command("eval")
@click.argument("artifact")
@click.option("--base", default=None, help="Unquantized model for KLD / top-1 / flips (alias, dir or Hub id).")
@click.option("--heldout", default="mixed", show_default=True,
              help="Held-out text: a built-in set's heldout split or a local file.")
@click.option("--ctx", type=int, default=512, show_default=True, help="Window length in tokens.")
@click.option("--max-windows", type=int, default=32, show_default=True,
              help="Windows scored (ctx-1 tokens each).")
@click.option("--batch-size", type=int, default=4, show_default=True)
@click.option("--ppl/--no-ppl", default=True, show_default=True, help="Held-out PPL / KLD.")
@click.option("--tasks", default=None,
              help="lm-eval tasks, comma-separated (offline: quantkit_cloze_mixed, "
                   "quantkit_heldout_mixed, ... ; Hub tasks when online).")
@click.option("--backend", type=click.Choice(["hf", "vllm", "llamacpp", "mlx"]), default=None,
              help="Engine for --tasks (default: llamacpp for .gguf, else hf); mlx: held-out "
                   "PPL / KLD / top-1 of the artifact and --base scored in MLX (mlx-lm, "
                   "scripts/setup_mlx.sh), no --tasks.")
@click.option("--num-fewshot", type=int, default=0, show_default=True)
@click.option("--limit", type=int, default=None, help="Samples per task (default: all).")
@click.option("--chat-template", is_flag=True, help="Apply the model's chat template to tasks.")
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--fresh-base", is_flag=True,
              help="Run the base's lm-eval tasks again instead of reusing stored results of the "
                   "same model files, tasks and settings (built-in tasks only).")
@click.option("--speed", is_flag=True, help="Prefill/decode tokens/s, TTFT and peak memory.")
@click.option("--speed-engine", type=click.Choice(["vllm", "llamacpp", "transformers"]),
              default=None, help="Engine for --speed (default: llamacpp for .gguf, else vllm).")
@_speed_settings
@click.option("--json", "json_out", type=click.Path(), default=None,
              help="Results file (default: ARTIFACT/quantkit_eval.json for directories).")
def eval_cmd(artifact, base, heldout, ctx, max_windows, batch_size, ppl, tasks, backend,
             num_fewshot, limit, chat_template, seed, fresh_base, speed, speed_engine, speed_prompt,
             speed_gen, speed_batch, repeats, json_out) -> None:
    """Accuracy of an artifact: held-out PPL, KLD / top-1 vs --base, lm-eval tasks and flips."""
    from quantkit.errors import EngineError
    from quantkit.eval.harness import evaluate, task_record
    from quantkit.eval.logits import PPLConvention
    from quantkit.eval.speed import default_engine, vllm_blocker
    from quantkit.pipeline.output import check_writable

    if json_out:  # before the evaluation, not after it
        check_writable(Path(json_out), "--json")
    command = "quantkit " + shlex.join(sys.argv[1:])
    backend = backend or ("llamacpp" if str(artifact).endswith(".gguf") else "hf")
    speed_engine = speed_engine or default_engine(artifact)
    # ask the engine probe before the long work: a vLLM part it cannot run is not started
    blocked = (vllm_blocker(artifact) if (tasks and backend == "vllm")
               or (speed and speed_engine == "vllm") else None)
    names = [t.strip() for t in tasks.split(",") if t.strip()] if tasks else []
    if names and backend == "mlx":
        raise click.UsageError("--backend mlx scores held-out PPL / KLD / top-1 only; run "
                               "--tasks with --backend hf or vllm.")
    if names:  # an unknown or offline-unreachable task is refused before the held-out scoring
        from quantkit.eval.tasks import resolve_tasks, task_manager

        resolve_tasks(names, task_manager(names))
    conv = PPLConvention(ctx=ctx, max_windows=max_windows, batch_size=batch_size)
    with _Progress() as progress:
        record = evaluate([artifact], base, heldout=heldout, conv=conv, on_progress=progress,
                          command=command, ppl=ppl,
                          backend="mlx" if backend == "mlx" else "quantkit")[0]
    target = Path(json_out) if json_out else (
        Path(artifact) / "quantkit_eval.json" if Path(artifact).is_dir() else None)
    not_run: list[tuple[str, str]] = []  # (option vLLM cannot serve here, what to run instead)
    try:
        if tasks and backend == "vllm" and blocked:
            not_run.append(("--tasks --backend vllm", f"--tasks {tasks} --backend hf"))
        elif tasks:
            task_record(record, artifact, base, names, backend=backend, num_fewshot=num_fewshot,
                        limit=limit, batch_size=batch_size, seed=seed, chat=chat_template,
                        reuse_base=not fresh_base)
        if speed and speed_engine == "vllm" and blocked:
            record["speed"] = {"engine": "vllm", "unmeasured": blocked}
            not_run.append(("--speed", "--speed --speed-engine transformers"))
        elif speed:
            from quantkit.eval.speed import measure_speed

            record["speed"] = measure_speed(
                artifact if Path(artifact).exists() else record["artifact"]["path"], speed_engine,
                prompt_tokens=speed_prompt, gen_tokens=speed_gen, repeats=repeats,
                batches=_batches(speed_batch))
    except EngineError as exc:  # keep what was measured before the engine failed
        if speed and "speed" not in record:
            record["speed"] = {"engine": speed_engine, "unmeasured": exc.message}
        if _save_eval(record, target):
            exc.hint = f"{exc.hint or ''} The results measured before it are saved in {target}."
        raise
    saved = _save_eval(record, target)
    _print_eval(record)
    if target is not None:
        console.print(f"results: {target}")
    if not_run:
        raise EngineError(
            f"{' and '.join(o for o, _ in not_run)} did not run: {artifact} cannot run in vLLM "
            f"here: {blocked}.",
            f"Run `quantkit eval {artifact} {' '.join(i for _, i in not_run)}` instead, or "
            "evaluate a GGUF or FP8 --scheme dynamic artifact in its engine; `quantkit doctor` "
            "lists what runs here." + (f" The other results are saved in {target}." if saved else ""))


def _save_eval(record: dict, target: Path | None) -> bool:
    """Write the results record where `quantkit eval` keeps it; False when there is no place."""
    if target is None or not os.access(target.parent if target.parent.exists() else ".", os.W_OK):
        return False
    target.write_text(json.dumps(record, indent=2))
    return True


def _fmt(metric: dict | None, key: str = "value", digits: int = 4) -> str:
    if not metric:
        return "not measured"
    v = metric.get(key)
    se = metric.get("stderr") if key in ("value", "mean") else None
    return f"{v:.{digits}f}" + (f" ± {se:.{digits}f}" if se is not None else "")


def _add_row(table: Table, *cells: str) -> None:
    """A table row whose text is shown as it is (artifact metadata, task names: no markup)."""
    table.add_row(*(Text(c) for c in cells))


def _print_eval(record: dict) -> None:
    m = record["metrics"]
    c = record.get("convention") or {}
    table = Table(title=f"quantkit eval: {escape(str(record['artifact']['path']))}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    if "base_ppl" in m:
        _add_row(table, "PPL (base)", _fmt(m["base_ppl"], digits=3))
    _add_row(table, "PPL (artifact)", _fmt(m.get("ppl"), digits=3))
    if "kld" in m:
        k = m["kld"]
        _add_row(table, "KLD mean", _fmt(k, "mean", 5))
        _add_row(table, "KLD median / p99 / max", f"{k['median']:.5f} / {k['p99']:.5f} / {k['max']:.3f}")
        _add_row(table, "top-1 agreement", f"{100 * m['top1_agreement']['value']:.2f} %")
        _add_row(table, "RMS Δp", f"{100 * m['rms_delta_p']['value']:.3f} %")
    for task, metrics in (m.get("tasks") or {}).items():
        for name, val in metrics.items():
            _add_row(table, f"{task} {name}", _fmt(val, digits=4))
        if task in (m.get("flips") or {}):
            _add_row(table, f"{task} flips vs base", f"{100 * m['flips'][task]['value']:.1f} %")
    sp = record.get("speed") or {}
    engine = f"{sp.get('engine')} {sp['dtype']}" if sp.get("dtype") else sp.get("engine")
    for key, val in sp.items():
        if key.startswith("batch_") and val:
            for name, label in (("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s"),
                                ("ttft_s", "TTFT s")):
                v = val[name]
                _add_row(table, f"{label} ({engine}, {key.replace('_', ' ')})",
                              f"{v['median']:.3g} [{v['min']:.3g}, {v['max']:.3g}]")
    if sp.get("unmeasured"):
        _add_row(table, f"speed ({sp['engine']})", f"not run: {sp['unmeasured']}")
    if sp.get("peak_rss_bytes"):
        _add_row(table, f"peak RSS ({sp['engine']})", f"{sp['peak_rss_bytes'] / 2**30:.2f} GiB")
    a = record["artifact"]
    _add_row(table, "format / method", f"{a['format']} / {a['method']}")
    if a.get("bits_per_weight_quantized"):
        _add_row(table, "bits/weight (quantized Linears)", f"{a['bits_per_weight_quantized']:.3f}")
    _add_row(table, "size on disk", f"{a['size_bytes'] / 2**20:.1f} MiB")
    out.print(table)
    if not c:
        return
    out.print(f"[dim]convention: {escape(str(c['corpus']))} {c['split']}, {c['windows']} windows x {c['ctx']} tokens, "
              f"no overlap, {c['bos']}, {c['scored_tokens']} scored tokens; engine "
              f"{record['engine']['name']} ({record['engine']['dtype']})[/]")


def _print_info(path: str) -> None:
    from quantkit.info import artifact_info

    info = artifact_info(path)
    table = Table(title=f"quantkit info: {escape(path)}")
    table.add_column("field")
    table.add_column("value")
    s = info.get("scheme") or {}
    rows = [("format", info["format"]), ("method", info["method"]),
            ("scheme", ", ".join(f"{k}={v}" for k, v in s.items() if v is not None) or "-"),
            ("meant for", ", ".join(info.get("engines") or []) or "-"),
            ("source model", info.get("source_model") or "-"),
            ("calibration", info.get("calibration") or "none"),
            ("size on disk", f"{info['size_bytes'] / 2**20:.1f} MiB ({info['size_bytes']} bytes)")]
    if info.get("nominal_bits_per_weight"):
        rows.append(("bits/weight, nominal (the scheme's label)", f"{info['nominal_bits_per_weight']:.3f}"))
    if "bits_per_weight_quantized" in info:
        rows.append(("bits/weight, quantized Linears", f"{info['bits_per_weight_quantized']:.3f}"))
    if "bits_per_weight_with_embeddings" in info:
        rows.append(("bits/weight, Linears + embeddings/output",
                     f"{info['bits_per_weight_with_embeddings']:.3f}"))
    if "bits_per_weight_model" in info:
        rows.append(("bits/weight, whole model", f"{info['bits_per_weight_model']:.3f}"))
    for k, v in rows:
        _add_row(table, k, str(v))
    out.print(table)
    if isinstance(info.get("tensor_types"), dict):
        types = Table(title="tensor types (every tensor of the file)")
        for name in ("type", "tensors", "params", "bytes", "bits/weight", "share of weights"):
            types.add_column(name, justify="left" if name == "type" else "right")
        for name, t in info["tensor_types"].items():
            types.add_row(name, str(t["tensors"]), f"{t['params']:,}", f"{t['bytes']:,}",
                          f"{t['bits_per_weight']:.3f}", f"{100 * t['share']:.1f} %")
        out.print(types)
    auto = info.get("auto_types")
    if isinstance(auto, dict):
        target = {k: v for k, v in (auto.get("target") or {}).items() if v is not None}
        chosen = Table(title="types chosen by --gguf-type auto (measured sensitivity, budget "
                             + ", ".join(f"{k}={v}" for k, v in target.items()) + ")")
        chosen.add_column("tensor")
        chosen.add_column("type")
        for name, qtype in {**auto.get("fixed", {}), **auto.get("tensors", {})}.items():
            fixed = " (fixed: q4_k_m's rule)" if name in auto.get("fixed", {}) else ""
            chosen.add_row(escape(name), escape(str(qtype)) + fixed)
        out.print(chosen)


@main.command()
@click.argument("artifact")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def info(artifact, as_json) -> None:
    """What an artifact is: format, method, bits, group size, size, bits/weight."""
    from quantkit.info import artifact_info

    if as_json:
        out.print_json(json.dumps(artifact_info(artifact)))
    else:
        _print_info(artifact)


@main.command()
@click.argument("artifacts", nargs=-1, required=True)
@click.option("--base", default=None,
              help="Unquantized model (alias, dir or Hub id); default: the artifacts' source model.")
@click.option("--report", "report", type=click.Path(dir_okay=False), default=None,
              help="Write FILE.html (self-contained) plus FILE.md and FILE.json.")
@click.option("--heldout", default=None, help="Held-out text for missing evals (default: mixed).")
@click.option("--ctx", type=int, default=None, help="Window length for missing evals (default 512).")
@click.option("--max-windows", type=int, default=None,
              help="Windows for missing evals (default 32, or what stored results used).")
@click.option("--batch-size", type=int, default=4, show_default=True)
@click.option("--fresh", is_flag=True,
              help="Re-evaluate (and with --speed re-measure) every artifact, ignoring stored results.")
@click.option("--title", default=None, help="Report title.")
@click.option("--speed", is_flag=True,
              help="Speed and peak memory of every artifact and the base in its engine (vLLM for "
                   "directories, llama.cpp for .gguf); stored results measured alike are reused.")
@_speed_settings
def compare(artifacts, base, report, heldout, ctx, max_windows, batch_size, fresh, title, speed,
            speed_prompt, speed_gen, speed_batch, repeats) -> None:
    """Compare artifacts (dirs, GGUF files or results JSON) against one base model."""
    from quantkit.eval.logits import PPLConvention
    from quantkit.pipeline.output import check_writable
    from quantkit.report import collect, write_report

    if report:  # before the evaluations, not after them
        check_writable(Path(report), "--report")
    conv = None
    if ctx is not None or max_windows is not None:
        conv = PPLConvention(ctx=ctx or 512, max_windows=max_windows or 32, batch_size=batch_size)
    with _Progress() as progress:
        summary = collect(list(artifacts), base, conv=conv, heldout=heldout, fresh=fresh,
                          on_progress=progress, title=title,
                          command="quantkit " + shlex.join(sys.argv[1:]),
                          speed={"prompt_tokens": speed_prompt, "gen_tokens": speed_gen,
                                 "batches": _batches(speed_batch), "repeats": repeats}
                          if speed else None)
    if report:
        paths = write_report(summary, report)
        console.print("report: " + ", ".join(str(p) for p in paths.values()))
    else:
        _print_compare(summary)


def _print_compare(summary: dict) -> None:
    from quantkit.report.table import cells, omitted

    cols, rows = cells(summary)
    # piped to a file or a PR comment: do not wrap cells at the default 80 columns
    con = out if out.is_terminal else Console(width=max(out.width, 240), emoji=False)
    table = Table(title=escape(summary["title"]))
    for c in cols:
        table.add_column(escape(c.label), justify="right" if c.numeric else "left")
    for r, line in zip(summary["rows"], rows, strict=True):
        style = "dim" if r["role"] == "base" else None
        table.add_row(*[f"[bold green]{escape(x['text'])} ★[/]" if x["best"] else
                        (f"[italic]{escape(x['text'])}[/]" if x["missing"] else escape(x["text"]))
                        for x in line], style=style)
    con.print(table)
    if omitted(summary["rows"]):
        con.print("[dim]not measured for any row: " + ", ".join(omitted(summary["rows"])) + "[/]")
    for w in summary["warnings"]:
        con.print(f"[yellow]warning:[/] {escape(w)}", soft_wrap=True)
    for c in summary["conventions"]:
        v = c["convention"]
        con.print(f"[dim]{c['id']}: {escape(str(v.get('corpus')))} {escape(str(v.get('split')))}, "
                  f"{v.get('windows')} windows x {v.get('ctx')} tokens, {v.get('scored_tokens')} "
                  "scored tokens[/]")


@main.command()
@click.argument("artifact")
@click.option("--engine", type=click.Choice(["vllm", "llamacpp", "trtllm", "mlx"]), default="trtllm",
              show_default=True, help="The engine that will serve ARTIFACT (TensorRT-LLM cannot "
              "run here: its loader rules are checked).")
@click.option("--base", default=None, help="The source model (default: the one quantkit.json "
              "records).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify(artifact, engine, base, as_json) -> None:
    """Prove ARTIFACT in ENGINE: coverage, fidelity tensor by tensor, parity of the engine's
    log-probs with quantkit's decode. Exit 0 verified, 1 wrong, 3 the engine cannot run this
    scheme here (what could be checked still was)."""
    if engine == "trtllm" and base is None:  # the loader-rule report, as before
        from quantkit.engines.trtllm_rules import verify as run_rules

        report = run_rules(artifact, engine)
        if as_json:
            out.print_json(json.dumps(report.to_dict()))
        else:
            out.print(escape(report.render()), soft_wrap=True, highlight=False)
        sys.exit(0 if report.conformant else 1)
    from quantkit.verify import verify as run_verify

    result = run_verify(artifact, engine, base=base,
                        on_progress=None if as_json else lambda s: console.print(f"[dim]{escape(s)}[/]"))
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        _print_verify(result)
    sys.exit(result.exit_code)


def _print_verify(result) -> None:
    con = out if out.is_terminal else Console(width=max(out.width, 200), emoji=False)
    table = Table(title=escape(f"quantkit verify {result.artifact} --engine {result.engine}"))
    for c in ("check", "status", "what was measured"):
        table.add_column(c)
    for name, status, what in result.rows():
        table.add_row(escape(name), escape(status), escape(what))
    con.print(table)
    for c in result.checks.values():
        for p in c.problems:
            con.print(f"[red]{escape(c.name)}:[/] {escape(p)}", soft_wrap=True, highlight=False)
    for n in result.notes:
        con.print(f"note: {escape(n)}", soft_wrap=True, highlight=False)
    con.print(f"RESULT: {escape(result.verdict)}", soft_wrap=True, highlight=False)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.option("--refresh", is_flag=True,
              help="Probe vLLM again instead of reusing the cached probe of this venv and CPU.")
def doctor(as_json, refresh) -> None:
    """What this machine can run: CPU, memory, GPUs, vLLM's kernels, llama.cpp, and what a
    missing piece means (which artifacts cannot run in which engine here, what to use instead)."""
    from quantkit.engines.capabilities import machine_report, what_runs_here

    report = machine_report(refresh=refresh)
    report["what_runs_here"] = what_runs_here(report)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(_doctor_text(report))  # plain text, engine and user strings printed verbatim


def _doctor_text(r: dict) -> str:
    gib = 2**30
    cpu, mem, tch, v, ll = r["cpu"], r["memory"], r["torch"], r["vllm"], r["llamacpp"]
    lines = ["quantkit doctor: what this machine can run", "",
             f"CPU        {cpu['model']}, {cpu['cores']} cores usable; SIMD flags: "
             f"{' '.join(cpu['simd_flags']) or '-'} (informational: the engines are asked below)",
             f"memory     {mem.get('MemTotal', 0) / gib:.1f} GiB total, "
             f"{mem['available_bytes'] / gib:.1f} GiB available ({mem['available_source']})"
             + (f", cgroup limit {mem['cgroup_limit'] / gib:.1f} GiB" if "cgroup_limit" in mem
                else ""),
             "           malloc huge pages: " + ("on" if mem["malloc_huge_pages"]["on"] else "off")
             + f" ({mem['malloc_huge_pages']['why']})",
             f"torch      {tch['version']}; GPUs: " + (", ".join(
                 f"{g['name']} ({g['memory_bytes'] / gib:.0f} GiB)" for g in tch["gpus"]) or "none"),
             "           CPU bf16 GEMM: " + ("native (calibration forwards on the CPU run in "
                                           "bf16 for bf16 checkpoints)" if tch["cpu_bf16_native"]
                                           else "emulated (calibration on the CPU runs in "
                                                "float32)")]
    if v["available"]:
        lines.append(f"vLLM       {v['version']} ({v['python']}); compiled ops: "
                     f"{v['kernel_library'] or '?'} ({v['platform']})")
        for label, key in (("int4 weight-only GEMM (cpu_gemm_wna16)", "int4_wna16"),
                           ("FP8 channel weights, dynamic inputs (torch._scaled_mm)", "fp8"),
                           ("FP8 per-tensor weights (static_scaled_fp8_quant)", "fp8_static"),
                           ("FP8 128x128 blocks (AMX)", "fp8_block"),
                           ("INT8 W8A8 (oneDNN)", "int8_w8a8")):
            lines.append(f"  {label:<56} {'yes' if v[key] else 'MISSING'}")
        if v["fp8"] and (v.get("fp8_vs_bf16_time") or 0) > 20:
            lines.append(f"  note: FP8 runs through torch's reference GEMM here, "
                         f"~{v['fp8_vs_bf16_time']:.0f}x slower than bf16: FP8 speed is not "
                         "measured in vLLM on this CPU (accuracy is)")
        if v["platform"] == "CpuPlatform" and not v.get("bf16_native", True):
            lines.append("  note: vLLM's torch emulates bf16 GEMMs here, so quantkit runs dense, "
                         "int8 W8A8 and FP8 dynamic checkpoints in vLLM in float32 (1.4-4x faster); "
                         "int4 ones stay bf16 (its int4 kernel takes 16-bit inputs only)")
        if v.get("int4_w4a8_default"):
            lines.append("  note: on this CPU (AMX) vLLM's default runs int4 checkpoints as W4A8 "
                         "(activations rounded to int8); quantkit runs them as written "
                         "(VLLM_CPU_INT4_W4A8=0) unless you set VLLM_CPU_INT4_W4A8=1")
        lines.append(f"  (probe cached in {v['cache_file']}; --refresh probes again)")
    else:
        lines.append(f"vLLM       not usable: {v['error']}")
    if ll["available"]:
        lines.append(f"llama.cpp  llama-cpp-python {ll['version']}; build: "
                     f"{' '.join(ll['features']) or '-'}")
    else:
        lines.append(f"llama.cpp  not usable: {ll['error']}")
    lines += ["", "What runs here:"]
    for row in r["what_runs_here"]:
        if row["runs"]:
            lines.append(f"  ok    {row['what']}")
        else:
            lines.append(f"  NO    {row['what']}: {row['reason']}.")
            lines.append(f"        instead: {row['instead']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
