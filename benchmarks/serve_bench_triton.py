"""Load-test the Triton model with NVIDIA's genai-perf (a benchmark, not a test): `make serve-bench-triton`.

Writes the model repository for an engine bundle, starts a local tritonserver (loopback), and runs
``genai-perf profile --endpoint-type kserve --backend tensorrtllm|vllm --streaming`` (gRPC streaming through
perf_analyzer, fixed input and output lengths with --output-tokens-mean-deterministic) at each
concurrency; per level it reads genai-perf's own export and the acceptance counters on Triton's metrics
port (tokens per round = output tokens / rounds over that level), and writes one markdown table.

genai-perf lives in its own virtual environment (its pins clash with the project's); perf_analyzer from
tritonclient 2.51 needs libb64-0d and the CUDA runtime wheel (nvidia-cuda-runtime-cu12) on this CPU host:

    python3 -m venv /tmp/bench-venv
    /tmp/bench-venv/bin/pip install genai-perf==0.0.16 "tritonclient[all]==2.51.0" nvidia-cuda-runtime-cu12
    apt-get install libb64-0d
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def scrape(url: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) if fam.name.startswith("retrace_") for s in fam.samples}


def total(snap: dict[tuple, float], name: str) -> float:
    return sum(v for (n, _), v in snap.items() if n == name)


def client_env(genai_perf: str) -> dict[str, str]:
    """PATH with the venv's perf_analyzer, LD_LIBRARY_PATH with the CUDA runtime wheel's libcudart."""
    env = dict(os.environ)
    venv_bin = str(Path(genai_perf).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    libs = glob.glob(str(Path(venv_bin).parent / "lib" / "python3*" / "site-packages" / "nvidia" / "cuda_runtime"
                         / "lib"))
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([libs[0], env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    return env


def genai_perf_inputs(prompts: str, out: Path) -> Path:
    """retrace's prompts JSONL ({"prompt": ...} per line) as genai-perf's --input-file ({"text": ...})."""
    lines = [json.loads(x) for x in Path(prompts).read_text().splitlines() if x.strip()]
    out.write_text("".join(json.dumps({"text": x["prompt"]}) + "\n" for x in lines))
    return out


def genai_perf_command(args, url: str, concurrency: int, artifacts: Path) -> list[str]:
    requests = max(args.min_requests, args.requests_per_client * concurrency)
    inputs = (["--input-file", str(args.input_file)] if args.input_file else
              ["--synthetic-input-tokens-mean", str(args.isl), "--synthetic-input-tokens-stddev", "0"])
    return [args.genai_perf, "profile", "-m", "retrace", "--endpoint-type", "kserve", "--backend", args.convention,
            "--streaming", "-u", url, "--concurrency", str(concurrency), "--request-count", str(requests),
            "--warmup-request-count", str(concurrency), *inputs,
            "--output-tokens-mean", str(args.osl), "--output-tokens-stddev", "0", "--output-tokens-mean-deterministic",
            "--tokenizer", args.tokenizer, "--random-seed", "0", "--artifact-dir", str(artifacts)]


def read_export(artifacts: Path) -> dict:
    found = sorted(artifacts.rglob("profile_export_genai_perf.json"))
    if not found:
        raise SystemExit(f"genai-perf wrote no profile_export_genai_perf.json under {artifacts}")
    return json.loads(found[0].read_text())


def stat(export: dict, key: str, field: str = "avg") -> float:
    v = export.get(key) or {}
    return float(v.get(field) or 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True, help="engine bundle (retrace-export build)")
    ap.add_argument("--tokenizer", default=None, help="for genai-perf's token counts (default: the bundle's)")
    ap.add_argument("--genai-perf", default=os.environ.get("GENAI_PERF", "/tmp/bench-venv/bin/genai-perf"))
    ap.add_argument("--convention", choices=["tensorrtllm", "vllm"], default="tensorrtllm")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--isl", type=int, default=32, help="input tokens per request (synthetic prompts)")
    ap.add_argument("--prompts", default=None, help="prompts JSONL ({'prompt': ...} per line, e.g. a zoo's "
                    "prompts/code.jsonl) instead of genai-perf's synthetic text")
    ap.add_argument("--osl", type=int, default=32, help="output tokens per request (fixed: min = max)")
    ap.add_argument("--requests-per-client", type=int, default=8)
    ap.add_argument("--min-requests", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=16, help="requests the model batches (<= the bundle's)")
    ap.add_argument("--verify-policy", choices=["adaptive", "fixed"], default="adaptive")
    ap.add_argument("--work", default=None, help="directory for the repository, logs and artifacts")
    ap.add_argument("--out", default="bench-out/serve-triton.md")
    args = ap.parse_args(argv)
    tok_dir = Path(args.bundle) / "tokenizer"  # where retrace-export build puts the target's tokenizer
    args.tokenizer = args.tokenizer or str(tok_dir if tok_dir.is_dir() else args.bundle)
    if not Path(args.genai_perf).is_file():
        raise SystemExit(f"no genai-perf at {args.genai_perf}; see this script's docstring (or set GENAI_PERF)")

    from retrace.export.triton.env import ensure_triton_env
    from retrace.export.triton.repository import write_repository
    from retrace.export.triton_server import TritonServer

    work = Path(args.work or tempfile.mkdtemp(prefix="serve-bench-triton-"))
    work.mkdir(parents=True, exist_ok=True)
    args.input_file = genai_perf_inputs(args.prompts, work / "inputs.jsonl") if args.prompts else None
    env = ensure_triton_env()
    repo = write_repository(args.bundle, work / "repo", max_batch=args.max_batch, env_path=env.model_env, force=True,
                            verify_policy=args.verify_policy)
    rows = []
    with TritonServer(repo, env, log_path=work / "server.log", models=["retrace"]) as srv:
        for c in [int(x) for x in args.concurrency.split(",")]:
            before = scrape(srv.metrics_url)
            cmd = genai_perf_command(args, srv.grpc_url, c, work / f"c{c}")
            print("$", " ".join(cmd), flush=True)
            t0 = time.monotonic()
            proc = subprocess.run(cmd, env=client_env(args.genai_perf), capture_output=True, text=True)
            if proc.returncode:
                print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"genai-perf failed at concurrency {c} (server log: {srv.log_path})")
            after = scrape(srv.metrics_url)
            ex = read_export(work / f"c{c}")
            rounds = total(after, "retrace_rounds_total") - total(before, "retrace_rounds_total")
            tokens = total(after, "retrace_output_tokens_total") - total(before, "retrace_output_tokens_total")
            rows.append({"concurrency": c, "requests_per_s": stat(ex, "request_throughput"),
                         "output_tokens_per_s": stat(ex, "output_token_throughput"),
                         "ttft_ms": stat(ex, "time_to_first_token"),
                         "ttft_p99_ms": stat(ex, "time_to_first_token", "p99"),
                         "itl_ms": stat(ex, "inter_token_latency"), "latency_ms": stat(ex, "request_latency"),
                         "output_len": stat(ex, "output_sequence_length"),
                         "tokens_per_round": tokens / rounds if rounds else 0.0, "wall_s": time.monotonic() - t0})
    source = f"prompts `{args.prompts}`" if args.prompts else f"{args.isl} synthetic input tokens"
    lines = [f"genai-perf 0.0.16, `--endpoint-type kserve --backend {args.convention} --streaming`, {source}, "
             f"{args.osl} output tokens (deterministic), bundle `{args.bundle}`, model max_batch {args.max_batch}, "
             f"verify policy {args.verify_policy}", "",
             "| concurrency | requests/s | output tok/s | TTFT avg (p99) ms | ITL ms | request latency ms | "
             "output len | tokens/round (metrics) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.0f} | "
                     f"{r['ttft_ms']:.1f} ({r['ttft_p99_ms']:.1f}) | {r['itl_ms']:.2f} | {r['latency_ms']:.0f} | "
                     f"{r['output_len']:.0f} | {r['tokens_per_round']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))
    print(f"wrote {out} (work dir {work})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
