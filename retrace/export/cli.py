"""`retrace-export`: build engine bundles and inspect them.

    retrace-export build --target DIR --drafter DIR --out BUNDLE [--backend onnxruntime] [--dtype ...]
    retrace-export inspect BUNDLE [--json] [--quick]

Further subcommands register on `main` (a click group), e.g. `@main.command("triton")` in this module or
`main.add_command(cmd)` from elsewhere. Backends plug into `build` through
`retrace.export.build.BACKEND_HOOKS`; `--backend` offers every key of that table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from retrace.cli_errors import cli_errors


@click.group()
@click.version_option(package_name="retrace")
def main() -> None:
    """Export ReTrace/DFlash + Qwen3 checkpoints to deployable engine bundles."""


def _backends() -> list[str]:
    from retrace.export.build import BACKEND_HOOKS

    return list(BACKEND_HOOKS)


@main.command()
@click.option("--target", "target", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Qwen3 target (HF directory)")
@click.option("--drafter", "drafter", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="DFlash drafter directory (with retrace_config.json/retrace.safetensors for ReTrace); "
                   "omit for a target-only (autoregressive) bundle")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="bundle directory to create")
@click.option("--backend", type=click.Choice(_backends()), default="onnxruntime", show_default=True,
              help="onnxruntime: the ONNX graphs are the engine (CPU EP; CUDA EP with onnxruntime-gpu); "
                   "tensorrt: TensorRT plans built from them as well (needs TensorRT and an NVIDIA GPU)")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True)
@click.option("--weights", type=click.Choice(["fp32", "int8", "int4", "w8a8"]), default="fp32", show_default=True,
              help="weight-only quantization of the linear layers and the LM head (ONNX Runtime MatMulNBits, "
                   "onnxruntime backend): int4/int8 are what CPU deployments run; w8a8: int8 weights per column "
                   "and int8 activations per row in integer matmuls (exactly row-invariant on every CPU); fp32 "
                   "keeps the graphs that match torch")
@click.option("--weight-block-size", type=int, default=None,
              help="quantization block along K (power of two >= 16) [default: 256 for int4, 128 for int8]")
@click.option("--head-block-size", type=int, default=None,
              help="the LM head's quantization block [default: --weight-block-size's]")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=None,
              help="MatMulNBits accuracy_level (4: int8 activations, the fastest on CPU) [default: 4]")
@click.option("--drafter-weights", type=click.Choice(["fp32", "int8", "int4", "w8a8"]), default=None,
              help="the drafter's own precision (its kind's default block and accuracy level): a draft never "
                   "changes the output, only how much of it is accepted; int8 beside an fp32 target drafts at "
                   "0.14 of a decode instead of 0.20 at the Qwen3-0.6B shape, acceptance unchanged "
                   "[default: --weights']")
@click.option("--max-batch", type=int, default=8, show_default=True, help="most concurrent requests")
@click.option("--max-seq-len", type=int, default=None,
              help="prompt + output tokens per request [default: min(2048, target's max_position_embeddings)]")
@click.option("--block-size", type=int, default=None, help="draft block size (default and maximum at run "
              "time; default: the drafter's)")
@click.option("--attention", type=click.Choice(["native", "decomposed"]), default="native", show_default=True,
              help="opset-23 Attention/RMSNormalization nodes, or MatMul/Softmax for older runtimes")
@click.option("--tolerance", type=float, default=None,
              help="parity tolerance on logits (default 1e-4 float32, 3e-2 float16; scaled by max(1, max|logit|))")
@click.option("--conditioner/--no-conditioner", default=True, show_default=True,
              help="include the drafter directory's ReTrace conditioner (--no-conditioner: a DFlash-only bundle)")
@click.option("--force", is_flag=True, help="replace an existing bundle at --out (and repository at --triton-repo) "
              "that retrace wrote; any other non-empty directory is refused")
@click.option("--quiet", "-q", is_flag=True, help="no progress output (the summary is still printed)")
@click.option("--triton-repo", type=click.Path(path_type=Path), default=None,
              help="also write a Triton Inference Server model repository for the bundle here")
@click.option("--tree-mask", is_flag=True,
              help="give the target graph the optional tree_mask input (tree verification: --tree-budget)")
@click.option("--export-cache", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="reuse ONNX exports of the same models and settings from this directory, and keep new ones "
              "there (default: $RETRACE_EXPORT_CACHE, or none)")
@cli_errors
def build(target, drafter, out, backend, dtype, weights, weight_block_size, head_block_size, accuracy_level,
          drafter_weights, max_batch, max_seq_len, block_size, attention, tolerance, conditioner, force, quiet,
          triton_repo, tree_mask, export_cache) -> None:
    """Export, check and package a target (+ drafter) as an engine bundle.

    The bundle is built in a temp directory beside --out and renamed into place only when every check
    passed; an error or Ctrl-C leaves nothing behind."""
    from rich.console import Console

    from retrace.export.build import BuildOptions, Reporter, build_bundle

    console = Console(stderr=True)
    if triton_repo is not None:  # refuse a repository path we may not write before the (long) build
        from retrace.export.triton.repository import KIND, is_legacy_repository
        from retrace.output_dir import check_output

        check_output(Path(triton_repo).absolute(), KIND, force, is_legacy_repository, "Triton model repository")
    opts = BuildOptions(target=target, drafter=drafter, out=out, backend=backend, dtype=dtype, max_batch=max_batch,
                        max_seq_len=max_seq_len, block_size=block_size, force=force, attention=attention,
                        tolerance=tolerance, conditioner=conditioner, tree_mask=tree_mask, weights=weights,
                        weight_block_size=weight_block_size, accuracy_level=accuracy_level,
                        head_block_size=head_block_size, drafter_weights=drafter_weights, export_cache=export_cache)
    if not quiet:
        console.print(f"[bold]retrace-export build[/bold] {target} + {drafter or '(no drafter)'} -> {out} "
                      f"[dim]({backend}, {dtype}{'' if weights == 'fp32' else ', ' + weights + ' weights'}"
                      f"{'' if drafter_weights is None else ', drafter ' + drafter_weights})[/dim]")
    result = build_bundle(opts, Reporter(console, quiet=quiet))
    _summary(result.out, result.manifest, result.seconds)
    if triton_repo is not None:
        _write_triton(result.out, triton_repo, "retrace", 1, max_batch, force)


def _write_triton(bundle: Path, out: Path, model_name: str, instances: int, max_batch: int, force: bool,
                  env: Path | None = None, no_env: bool = False, verify_policy: str = "adaptive",
                  device: str = "cpu") -> None:
    from retrace.export.triton.env import ensure_triton_env
    from retrace.export.triton.repository import write_repository

    env_path = env
    if env_path is None and not no_env:
        click.echo("preparing the python-backend environment (numpy<2; built once, cached) ...", err=True)
        env_path = ensure_triton_env().model_env
    repo = write_repository(bundle, out, model_name=model_name, instances=instances, max_batch=max_batch,
                            env_path=env_path, force=force, verify_policy=verify_policy, device=device,
                            backend="tensorrt" if device == "cuda" else "onnxruntime")
    click.echo(f"wrote Triton model repository {repo} (model {model_name!r}, env: {env_path or 'server Python'})")
    click.echo(f"serve it: python -m retrace.export.triton serve {repo} --model {model_name}")


@main.command()
@click.option("--engine", "engine", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="engine bundle from retrace-export build")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="model repository to create")
@click.option("--model-name", default="retrace", show_default=True)
@click.option("--instances", type=int, default=1, show_default=True, help="model instances (each runs a runtime)")
@click.option("--max-batch", type=int, default=8, show_default=True, help="requests batched together per instance")
@click.option("--env", type=click.Path(path_type=Path), default=None,
              help="python-backend execution environment (default: build/reuse the cached numpy<2 env)")
@click.option("--no-env", is_flag=True, help="run the model in the server's own Python (e.g. NVIDIA's container)")
@click.option("--force", is_flag=True, help="replace an existing repository at --out that retrace wrote; any other "
              "non-empty directory is refused")
@click.option("--verify-policy", type=click.Choice(["adaptive", "fixed"]), default="adaptive", show_default=True,
              help="drafts verified per round (config.pbtxt RETRACE_VERIFY_POLICY)")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="instance kind: cpu (KIND_CPU, ONNX Runtime bundle) or cuda (KIND_GPU, TensorRT bundle; each "
                   "instance on the GPU Triton assigns)")
@cli_errors
def triton(engine, out, model_name, instances, max_batch, env, no_env, force, verify_policy, device) -> None:
    """Write a Triton Inference Server model repository (python backend, decoupled/streaming) for a bundle.

    Written atomically; the bundle is copied in. Concurrent requests are batched by retrace's runtime."""
    _write_triton(engine, out, model_name, instances, max_batch, force, env, no_env, verify_policy, device)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _quant_how(q: dict) -> str:
    """A quantization section's settings, as the summary prints them."""
    return (f"activations {q['activations']}" if q.get("activations") else
            f"block {q['block_size']}, LM head {q.get('lm_head_block_size')}, accuracy level {q['accuracy_level']}")


def _summary(out: Path, manifest: dict, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"engine bundle {out}", show_lines=False)
    table.add_column("file")
    table.add_column("size", justify="right")
    table.add_column("sha256")
    total = 0
    for rel, meta in manifest["files"].items():
        table.add_row(rel, _size(meta["size"]), meta["sha256"][:16])
        total += meta["size"]
    console.print(table)
    lim = manifest["limits"]
    par = manifest.get("parity") or {}
    worst = max((par[g]["max_scaled_logits_diff"] for g in ("target", "drafter") if g in par), default=None)
    console.print(f"{len(manifest['files'])} files, {_size(total)}, built in {seconds:.1f} s; backend "
                  f"{manifest['backend']}, {manifest['dtype']}, max_batch {lim['max_batch']}, max_seq_len "
                  f"{lim['max_seq_len']}, block_size {lim['block_size']}"
                  + (f"; parity max |Δlogits| {worst:.1e} (tolerance {par['tolerance']:g})"
                     if worst is not None else ""))
    if manifest.get("quantization"):
        q = manifest["quantization"]
        a = q.get("agreement_with_fp32") or {}
        console.print(f"weights {q['weights']} ({_quant_how(q)}); "
                      f"top-1 agreement with fp32 {a.get('top1_agreement', 0):.1%}, max |logit error| "
                      f"{a.get('max_logit_error', 0):.3g} on {a.get('tokens')} held-out tokens")
    if manifest.get("drafter_weights"):
        q = manifest.get("drafter_quantization")
        console.print(f"drafter weights {manifest['drafter_weights']}" + (f" ({_quant_how(q)})" if q else ""))
    modes = "ar, dflash, retrace" if manifest["models"].get("conditioner") else (
        "ar, dflash" if manifest["models"].get("drafter") else "ar")
    console.print(f"run it: retrace generate --engine {out} --prompt ...  (modes: {modes})")


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print the manifest as JSON (still verifies)")
@click.option("--quick", is_flag=True, help="check file presence and sizes only (no hashing)")
@cli_errors
def inspect(bundle: Path, as_json: bool, quick: bool) -> None:
    """Print a bundle's manifest and verify it: every file's sha256, no file outside the manifest, and the
    manifest itself (paths inside the bundle, every graph/data file hashed). Exit 1 on anything unverified."""
    from rich.console import Console
    from rich.table import Table

    from retrace.engines.bundle import check_files, manifest_problems, read_manifest

    m = read_manifest(bundle)
    checks = check_files(bundle, m, full=not quick)
    problems = manifest_problems(bundle, m)
    bad = [c for c in checks if not c.ok and c.status != "unlisted"]
    unlisted = [c for c in checks if c.status == "unlisted"]
    if as_json:
        click.echo(json.dumps({**m, "verification": {c.path: c.status for c in checks},
                               "manifest_problems": problems}, indent=2))
    else:
        console = Console()
        console.print(f"[bold]{bundle}[/bold]: {m['format']} v{m['format_version']}, retrace "
                      f"{m.get('retrace_version')}, "
                      f"built {m.get('created_utc')}")
        console.print(f"backend {m.get('backend')}, dtype {m.get('dtype')}, weights {m.get('weights', 'fp32')}, "
                      f"limits {json.dumps(m.get('limits'))}")
        models = m.get("models") or {}
        for name in ("target", "drafter", "conditioner"):
            info = models.get(name)
            if info is None:
                console.print(f"{name}: none")
                continue
            summary = info.get("summary") or info.get("config")
            console.print(f"{name}: {json.dumps(summary)}")
        if models.get("target"):
            console.print(f"eos_token_ids: {models['target'].get('eos_token_ids')}")
        for name, g in (m.get("graphs") or {}).items():
            if not isinstance(g, dict):
                continue
            console.print(f"graph {name}: {g.get('path')} ({g.get('nodes')} nodes, {g.get('attention')} attention, "
                          f"opset {g.get('opset')}); inputs {', '.join(_short(g.get('inputs') or []))}; "
                          f"outputs {', '.join(_short(g.get('outputs') or []))}")
        par = m.get("parity") or {}
        for name in ("target", "drafter"):
            if name in par:
                cases = ", ".join(f"{k} {v['logits']:.1e}" for k, v in par[name]["cases"].items())
                console.print(f"parity {name} (max |Δlogits| ORT vs torch at build): {cases}")
        table = Table(title="files")
        for col in ("file", "size", "sha256", "status"):
            table.add_column(col)
        for c in checks:
            meta = m["files"].get(c.path, {})
            style = {"ok": "green", "unchecked": "yellow", "unlisted": "yellow"}.get(c.status, "red")
            table.add_row(c.path, _size(meta["size"]) if meta else "-", (meta.get("sha256") or "-")[:16],
                          f"[{style}]{c.status}[/{style}]")
        console.print(table)
    if "manifest_sha256" not in m:
        click.echo("warning: the manifest has no manifest_sha256 (built before retrace recorded it); its paths "
                   "and file entries were still checked", err=True)
    for p in problems:
        click.echo(f"error: manifest: {p}", err=True)
    if unlisted:
        click.echo(f"error: {len(unlisted)} file(s) not in the manifest: {', '.join(c.path for c in unlisted)}",
                   err=True)
    if bad:
        click.echo(f"error: {len(bad)} file(s) do not match the manifest: "
                   + ", ".join(f"{c.path} ({c.status})" for c in bad), err=True)
    if problems or unlisted or bad:
        click.echo("the bundle is not verified: loading it is refused; rebuild it with retrace-export build",
                   err=True)
        sys.exit(1)
    if not as_json:
        click.echo("all files match the manifest" + (" (sizes only: --quick)" if quick else " (sha256)"), err=True)


def _short(names: list[str]) -> list[str]:
    """past_key_0 .. past_value_{L-1} -> one entry."""
    kv = [n for n in names if n.startswith(("past_key_", "past_value_", "new_key_", "new_value_"))]
    rest = [n for n in names if n not in kv]
    if kv:
        prefix = kv[0].split("_")[0]
        rest.append(f"{prefix}_key/value_0..{len(kv) // 2 - 1}")
    return rest


if __name__ == "__main__":
    main()
