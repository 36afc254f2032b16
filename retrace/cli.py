"""`retrace` command line: generate, init-conditioner, zoo, train, eval, bench."""

from __future__ import annotations

import functools
import sys

import click

from retrace.errors import RetraceError


def user_errors(fn):
    """Turn RetraceError (bad input, bad files) into a one-line message and exit code 2, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RetraceError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)

    return wrapper


@click.group()
@click.version_option(package_name="retrace")
def main() -> None:
    """ReTrace speculative decoding for Qwen3: generate, train, evaluate, benchmark."""


@main.command("init-conditioner")
@click.option("--drafter", "drafter_dir", required=True, type=click.Path(file_okay=False), help="DFlash drafter directory")
@click.option("--init", "init", type=click.Choice(["zero", "random"]), default="zero", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="overwrite an existing conditioner")
@user_errors
def init_conditioner(drafter_dir: str, init: str, seed: int, force: bool) -> None:
    """Write a ReTrace conditioner (retrace_config.json + retrace.safetensors) beside a DFlash drafter."""
    from retrace.models.conditioner import ReTraceConditioner
    from retrace.models.config import DrafterConfig

    cfg = DrafterConfig.from_dir(drafter_dir)
    if ReTraceConditioner.exists(drafter_dir) and not force:
        raise RetraceError(f"{drafter_dir}: already has a conditioner (use --force to replace it)")
    cond = ReTraceConditioner(cfg.hidden_size, rms_norm_eps=cfg.layers.rms_norm_eps)
    cond.reset(init=init, seed=seed)
    cond.save(drafter_dir)
    click.echo(f"wrote {init} conditioner (hidden {cfg.hidden_size}) to {drafter_dir}")


if __name__ == "__main__":
    main()
