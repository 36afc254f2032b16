"""The trained small zoo that ships with retrace: `retrace zoo tiny` installs it, hash-checked, in seconds.

The zoo is a fixed artefact of the code: under portable numerics a build from scratch gives the same bytes
(retrace.train.numerics), so the pair a newcomer would spend 25-50 CPU-minutes training is shipped once::

    retrace/train/shipped/<size>-seed<seed>/
      release.json   what built it and what it holds:
                       recipe          the zoo's key without library versions and paths (what the code decides)
                       recipe_sha256   its digest; tests/test_zoo_release.py fails when the code's recipe
                                       differs from it (retrain and re-release: `make zoo-release`)
                       built_with      command, seed, numerics, library versions, interpreter
                       files           {path: {sha256, size}} for every file under zoo/
                       reproducible    the files a retrain must reproduce byte for byte (weights, configs,
                                       tokenizer, prompts, data; not the logs and manifests with timings)
      zoo/           the zoo directory itself (layout: retrace.train.zoo)

`install(out)` copies zoo/ into a staged sibling of `out`, verifies every copied file against release.json
(a changed, missing or extra file is refused, naming it) and renames it into place (retrace.output_dir: the
rules and atomicity of every retrace output). The installed zoo carries release.json, so the next call is a
cache hit after re-hashing (about 0.1 s). `retrace zoo tiny --train` trains instead (retrace.train.zoo);
`benchmarks/zoo_release_check.py` retrains and compares the bytes with `reproducible`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from retrace.engines.bundle import check_files, describe_check, hash_files, manifest_digest
from retrace.errors import RetraceError
from retrace.output_dir import check_output, staged_output

SHIPPED = Path(__file__).with_name("shipped")
RELEASE = "release.json"
FORMAT = "retrace-zoo-release"
NOT_REPRODUCIBLE = {"manifest.json", "target/zoo_manifest.json", "drafter/dflash_train.json",
                    "drafter/conditioner_train.json"}  # logs and manifests: timings and dates


class ZooReleaseError(RetraceError):
    """A shipped zoo that does not match its release record, or a release that cannot be written."""


def release_dir(size: str, seed: int) -> Path:
    return SHIPPED / f"{size}-seed{int(seed)}"


def recipe(size: str, seed: int, name: str | None = None) -> dict:
    """What the code on this checkout decides about the zoo of (size, seed) (built by the recipe `name`, default
    the shipped one): its build key without library versions and machine paths (those are recorded in
    built_with, not compared)."""
    from retrace.train.zoo import DEFAULT_RECIPE, preset, zoo_key

    key = zoo_key(size, seed, preset(size, name or DEFAULT_RECIPE), "portable")
    key.pop("versions", None)
    train = {k: v for k, v in key["target_stage"]["train"].items() if k not in ("versions", "stdlib")}
    key["target_stage"] = dict(key["target_stage"], train=train)
    return key


def read_release(root: Path) -> dict:
    path = Path(root) / RELEASE
    try:
        rel = json.loads(path.read_text())
    except FileNotFoundError:
        raise ZooReleaseError(f"{path}: no release record") from None
    except (OSError, ValueError) as e:
        raise ZooReleaseError(f"{path}: unreadable release record ({e})") from None
    if not isinstance(rel, dict) or rel.get("format") != FORMAT or not isinstance(rel.get("files"), dict):
        raise ZooReleaseError(f"{path}: not a {FORMAT} record")
    if rel.get("release_sha256") != manifest_digest({k: v for k, v in rel.items() if k != "release_sha256"}):
        raise ZooReleaseError(f"{path}: the release record was edited after it was written (release_sha256 "
                              "does not match its content)")
    return rel


def shipped(size: str, seed: int) -> dict | None:
    """The release record shipped for (size, seed), or None when none ships (then the zoo is trained)."""
    root = release_dir(size, seed)
    return read_release(root) if (root / RELEASE).is_file() else None


def problems(zoo: Path, rel: dict, allow_extra: bool = False) -> list[str]:
    """Each way the files under `zoo` differ from the release record (empty: identical)."""
    checks = check_files(zoo, {"files": rel["files"]}, full=True)
    return [describe_check(c) for c in checks
            if not c.ok and not (allow_extra and c.status == "unlisted") and c.path != RELEASE]


def installed(out: Path, rel: dict) -> bool:
    """`out` holds exactly this release (extra entries such as draft-ar/ beside it are allowed)."""
    try:
        mine = json.loads((out / RELEASE).read_text())
    except (OSError, ValueError):
        return False
    return mine.get("release_sha256") == rel["release_sha256"] and not problems(out, rel, allow_extra=True)


def install(out: str | Path, size: str = "small", seed: int = 0, force: bool = False, root: Path | None = None,
            progress: bool = True) -> dict:
    """Install the shipped zoo (or the release at `root`) as `out`; returns the zoo manifest, with
    "cached" and "release" set. Refuses a release whose files or recipe do not match, naming them, and (without
    force) an `out` holding a zoo of another size or seed; force also reinstalls over an intact copy."""
    from retrace.train.zoo import KIND, is_legacy_zoo, refuse_other_zoo

    root = Path(root) if root is not None else release_dir(size, seed)
    rel = read_release(root)
    want = recipe(rel["size"], rel["seed"])
    if rel["recipe_sha256"] != manifest_digest(want):
        raise ZooReleaseError(f"{root}: this zoo was built by another recipe than the code's (release recipe "
                              f"{rel['recipe_sha256'][:12]}, code {manifest_digest(want)[:12]}); retrain it with "
                              "`retrace zoo tiny --train` (or `make zoo-release` to refresh what ships)")
    bad = problems(root / "zoo", rel)
    if bad:
        raise ZooReleaseError(f"{root / 'zoo'}: the shipped zoo does not match {RELEASE} ({'; '.join(bad[:6])}); "
                              "the checkout is damaged: restore it (git checkout) or retrain with --train")
    out = Path(out).absolute()
    if check_output(out, KIND, force=True, legacy=is_legacy_zoo, what="zoo") and not force:
        refuse_other_zoo(out, rel["size"], rel["seed"])
    if installed(out, rel) and not force:
        _log(progress, f"cache hit: {out} holds the shipped zoo {rel['name']}")
        return dict(json.loads((out / "manifest.json").read_text()), cached=True, release=rel["name"])
    with staged_output(out, KIND, force=True, legacy=is_legacy_zoo, what="zoo") as tmp:
        for name in rel["files"]:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / "zoo" / name, tmp / name)
        bad = problems(tmp, rel)
        if bad:  # the copy itself (a full disk, a concurrent edit): nothing is installed
            raise ZooReleaseError(f"copying the shipped zoo to {out} gave other bytes ({'; '.join(bad[:6])})")
        shutil.copyfile(root / RELEASE, tmp / RELEASE)
    _log(progress, f"installed the shipped zoo {rel['name']} (built by: {rel['built_with']['command']}) in {out}")
    return dict(json.loads((out / "manifest.json").read_text()), cached=False, release=rel["name"])


def baseline_record(man: dict, base: dict, name: str) -> dict:
    """The evaluation of the zoo `base` (its manifest, e.g. a `--recipe legacy` build) beside the zoo `man` on the
    same held-out prompts and settings: what the release's manifest records as `compared_with`."""
    same = ("size", "seed")
    if any(man.get(k) != base.get(k) for k in same) or man["key"]["preset"]["eval"] != base["key"]["preset"]["eval"] \
            or man.get("eval_prompts") != base.get("eval_prompts"):
        raise ZooReleaseError(f"the baseline zoo ({name}) was evaluated on other prompts or settings than the zoo "
                              "(size, seed, eval settings and prompts must be the same)")
    tau, btau = man["metrics"]["tau"], base["metrics"]["tau"]
    ratio = {T: {f"{m}_pooled": round(tau[T][f"{m}_pooled"] / btau[T][f"{m}_pooled"], 4)
                 for m in ("dflash", "retrace")} for T in tau if T in btau}
    return {"recipe": base.get("recipe", {}).get("name", name), "preset": base["key"]["preset"],
            "tau": btau, "eval": base["metrics"].get("eval"), "pooled_tau_ratio": ratio}


def write(zoo: str | Path, command: str, dest: Path | None = None, baseline: str | Path | None = None) -> dict:
    """Make `zoo` (a finished `retrace zoo tiny --train` build) the shipped release of its size and seed;
    `baseline`: a zoo of another recipe evaluated the same way, recorded in the shipped manifest (compared_with)."""
    from retrace.train.zoo import REQUIRED, read_manifest

    zoo = Path(zoo)
    man = read_manifest(zoo)
    missing = [f for f in REQUIRED if not (zoo / f).is_file()]
    if man is None or missing:
        raise ZooReleaseError(f"{zoo}: not a finished zoo (missing {missing or ['manifest.json']})")
    size, seed = man["size"], int(man["seed"])
    if man.get("key", {}).get("numerics") != "portable":
        raise ZooReleaseError(f"{zoo}: only a portable-numerics build can ship (it is the one a retrain reproduces)")
    key = recipe(size, seed)
    if {k: v for k, v in man["key"].items() if k not in ("versions", "target_stage")} != {
            k: v for k, v in key.items() if k != "target_stage"}:
        raise ZooReleaseError(f"{zoo}: built by other settings than the code's shipped recipe (PRESETS)")
    compared = None
    if baseline is not None:
        bman = read_manifest(baseline)
        if bman is None:
            raise ZooReleaseError(f"{baseline}: not a finished zoo (no manifest.json)")
        compared = baseline_record(man, bman, str(baseline))
    names = sorted(str(p.relative_to(zoo).as_posix()) for p in zoo.rglob("*")
                   if p.is_file() and p.name not in (".retrace-output.json", RELEASE) and "draft-ar" not in p.parts)
    dest = Path(dest) if dest is not None else release_dir(size, seed)
    staging = dest.with_name(f".{dest.name}.writing")
    shutil.rmtree(staging, ignore_errors=True)
    for name in names:
        (staging / "zoo" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(zoo / name, staging / "zoo" / name)
    if compared is not None:
        (staging / "zoo" / "manifest.json").write_text(
            json.dumps(dict(man, compared_with=compared), indent=2, ensure_ascii=False) + "\n")
    rel = {"format": FORMAT, "name": f"{size}-seed{seed}", "size": size, "seed": seed,
           "recipe": key, "recipe_sha256": manifest_digest(key),
           "built_with": {"command": command, "versions": man.get("versions"), "numerics": man.get("numerics"),
                          "stdlib": man["key"]["target_stage"]["train"].get("stdlib"),
                          "timings_s": {k: man.get("timings", {}).get(k) for k in ("total_s", "cpu_s")}},
           "files": hash_files(staging / "zoo", names),
           "reproducible": [n for n in names if n not in NOT_REPRODUCIBLE]}
    rel["release_sha256"] = manifest_digest(rel)
    (staging / RELEASE).write_text(json.dumps(rel, indent=1) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return rel


def compare(zoo: str | Path, rel: dict) -> dict:
    """A retrained zoo against the release: {"equal": [...], "differ": [...], "missing": [...]} over the
    release's reproducible files."""
    zoo = Path(zoo)
    present = [n for n in rel["reproducible"] if (zoo / n).is_file()]
    got = hash_files(zoo, present)
    return {"equal": [n for n in present if got[n]["sha256"] == rel["files"][n]["sha256"]],
            "differ": [n for n in present if got[n]["sha256"] != rel["files"][n]["sha256"]],
            "missing": [n for n in rel["reproducible"] if n not in got]}


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[zoo] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":  # python -m retrace.train.zoo_release ZOO "COMMAND" [BASELINE_ZOO]: ZOO ships
    r = write(sys.argv[1], sys.argv[2], baseline=sys.argv[3] if len(sys.argv) > 3 else None)
    print(f"wrote {release_dir(r['size'], r['seed'])}: {len(r['files'])} files, recipe {r['recipe_sha256'][:12]}")
