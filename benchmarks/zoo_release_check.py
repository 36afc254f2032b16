"""Does the recipe on this checkout still build the zoo that ships? Retrain it and compare the bytes.

    python benchmarks/zoo_release_check.py [--size small --seed 0] [--out zoo-release-check] [--json FILE]

Runs `retrace zoo tiny --train --numerics portable` (25-50 min for small on 2 cores) into OUT, then
compares every file the release record marks reproducible (weights, configs, tokenizer, prompts, data)
with the shipped bytes (retrace/train/shipped/SIZE-seedSEED/release.json). Exit status 1 when any differs.
Bit-identity holds under portable numerics on an AVX2 x86-64 CPU with the interpreter and library versions
the record names (built_with); other versions may change the last bits of the training and so every byte.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

from retrace.train import zoo_release


@click.command()
@click.option("--size", default="small", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default="zoo-release-check", show_default=True)
@click.option("--threads", type=int, default=1, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def main(size: str, seed: int, out: str, threads: int, json_path: str | None) -> None:
    rel = zoo_release.shipped(size, seed)
    if rel is None:
        raise click.ClickException(f"no zoo ships for size {size}, seed {seed}")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "retrace", "zoo", "tiny", "--train", "--out", out, "--size", size,
                    "--seed", str(seed), "--threads", str(threads), "--numerics", "portable"], check=True)
    res = zoo_release.compare(Path(out), rel)
    report = {"release": rel["name"], "recipe_sha256": rel["recipe_sha256"],
              "recipe_matches_code": (rel["recipe_sha256"]
                                      == zoo_release.manifest_digest(zoo_release.recipe(size, seed))),
              "built_with": rel["built_with"], "retrain_minutes": round((time.perf_counter() - t0) / 60, 1),
              "versions_here": json.loads((Path(out) / "manifest.json").read_text()).get("versions"), **res}
    text = json.dumps(report, indent=2)
    click.echo(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
    if res["differ"] or res["missing"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
