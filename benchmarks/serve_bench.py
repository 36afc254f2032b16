"""`make serve-bench`: `retrace serve` under load, OpenAI endpoints `chat` and `completions`, streaming, at
concurrency 1, 4, 16; writes a markdown table (and the numbers as JSON). A benchmark, not a test.

The load comes from AIPerf (``--aiperf PATH``: an ``aiperf`` executable, e.g. from its own venv) or, without
it, from the built-in generator below (``openai.AsyncOpenAI`` streaming clients, a fixed number of requests
per level, prompts from JSONL files). Both report time to first token, inter-token latency and output
tokens/s, and the server's committed tokens per round (tau, from its /metrics) at each level.

    python -m benchmarks.serve_bench --engine BUNDLE --prompts DIR_OR_JSONL --out bench-out/serve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

# a minimal ChatML template for bundles whose tokenizer carries none
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_chat_template(bundle: Path) -> bool:
    cfg = bundle / "tokenizer" / "tokenizer_config.json"
    return (bundle / "tokenizer" / "chat_template.jinja").is_file() or (
        cfg.is_file() and bool(json.loads(cfg.read_text()).get("chat_template")))


def start_server(args, port: int, workdir: Path) -> subprocess.Popen:
    exe = Path(sys.executable).parent / "retrace"
    cmd = [str(exe), "serve", "--engine", str(args.engine), "--port", str(port), "--max-batch", str(args.max_batch),
           "--log-level", "warning", "--served-model-name", "retrace", "--verify-policy", args.verify_policy]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if not has_chat_template(Path(args.engine)):
        tmpl = workdir / "chatml.jinja"
        tmpl.write_text(CHATML)
        cmd += ["--chat-template", str(tmpl)]
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
        if proc.poll() is not None:
            raise SystemExit(f"retrace serve exited with {proc.returncode}")
    proc.kill()
    raise SystemExit("retrace serve did not come up within 180 s")


def read_prompts(paths: list[str], limit: int) -> list[str]:
    files = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    rows = [json.loads(line)["prompt"] for f in files for line in f.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if isinstance(r, str)]
    # interleave the files' prompts (domains) rather than take the first file only
    per = [rows[i::len(files)] for i in range(len(files))] if files else [rows]
    mixed = [r for group in zip(*per, strict=False) for r in group]
    return (mixed or rows)[:limit]


# ------------------------------------------------------------------------------------- built-in load
async def _one(client, endpoint: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times, usage = [], None
    kw = dict(model="retrace", max_tokens=max_tokens, temperature=0, stream=True,
              stream_options={"include_usage": True})
    if endpoint == "chat":
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    else:
        stream = await client.completions.create(prompt=prompt, **kw)
    async for c in stream:
        if c.choices:
            ch = c.choices[0]
            text = ch.delta.content if endpoint == "chat" else ch.text
            if text:
                times.append(time.perf_counter())
        usage = c.usage or usage
    n = usage.completion_tokens if usage else 0
    ext = (usage.model_extra or {}).get("retrace", {}) if usage else {}
    return {"ttft": times[0] - t0 if times else None, "end": time.perf_counter() - t0, "tokens": n,
            "itl": (times[-1] - times[0]) / (n - 1) if times and n > 1 else None, "tau": ext.get("tau")}


async def builtin_level(port: int, endpoint: str, concurrency: int, prompts: list[str], requests: int,
                        max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    queue = list(range(requests))
    results = []

    async def worker():
        while queue:
            i = queue.pop()
            results.append(await _one(client, endpoint, prompts[i % len(prompts)], max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    itl = [r["itl"] for r in results if r["itl"] is not None]
    taus = [r["tau"] for r in results if r["tau"]]
    return {"requests": len(results), "ttft_ms_p50": 1e3 * statistics.median(ttft),
            "ttft_ms_mean": 1e3 * statistics.fmean(ttft), "itl_ms_mean": 1e3 * statistics.fmean(itl) if itl else None,
            "output_tok_s": sum(r["tokens"] for r in results) / wall, "req_s": len(results) / wall,
            "tau_mean": statistics.fmean(taus) if taus else None}


# ---------------------------------------------------------------------------------------------- aiperf
def aiperf_level(aiperf: str, port: int, endpoint: str, concurrency: int, requests: int, max_tokens: int,
                 tokenizer: Path, workdir: Path) -> dict:
    out = workdir / f"aiperf-{endpoint}-c{concurrency}"
    cmd = [aiperf, "profile", "--model", "retrace", "--url", f"http://127.0.0.1:{port}", "--endpoint-type", endpoint,
           "--streaming", "--concurrency", str(concurrency), "--request-count", str(requests),
           "--synthetic-input-tokens-mean", "64", "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(max_tokens), "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0", "--use-server-token-count",
           "--tokenizer", str(tokenizer),
           "--artifact-dir", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    metrics = json.loads((out / "profile_export_aiperf.json").read_text())

    def stat(name: str, key: str):
        m = metrics.get(name) or {}
        return m.get(key)

    return {"requests": requests, "ttft_ms_p50": stat("time_to_first_token", "p50"),
            "ttft_ms_mean": stat("time_to_first_token", "avg"), "itl_ms_mean": stat("inter_token_latency", "avg"),
            "output_tok_s": stat("output_token_throughput", "avg"), "req_s": stat("request_throughput", "avg"),
            "tau_mean": None}


def server_totals(port: int) -> tuple[float, float]:
    """(committed tokens, rounds) over every mode, from the server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as resp:
        text = resp.read().decode()
    tot = {"retrace_output_tokens_total": 0.0, "retrace_rounds_total": 0.0}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in tot:
            tot[name] += float(line.rsplit(" ", 1)[1])
    return tot["retrace_output_tokens_total"], tot["retrace_rounds_total"]


def fmt(v, digits=1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, help="engine bundle")
    ap.add_argument("--prompts", nargs="*", default=[], help="JSONL prompt files or directories (built-in load)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--endpoints", default="chat,completions")
    ap.add_argument("--requests", type=int, default=0, help="requests per level [default: max(16, 4 x concurrency)]")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--verify-policy", default="adaptive", choices=["adaptive", "fixed"])
    ap.add_argument("--aiperf", default=None, help="aiperf executable (default: the built-in load generator)")
    ap.add_argument("--out", default="bench-out/serve", help="writes OUT.md and OUT.json")
    args = ap.parse_args()

    levels = [int(c) for c in args.concurrency.split(",")]
    endpoints = args.endpoints.split(",")
    prompts = read_prompts(args.prompts, 256) if args.prompts else [f"def f{i}(x):\n    return" for i in range(64)]
    port = free_port()
    tool = f"AIPerf ({args.aiperf})" if args.aiperf else "built-in asyncio load generator (openai.AsyncOpenAI)"
    rows = []
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        proc = start_server(args, port, Path(tmp))
        try:
            for endpoint in endpoints:
                for c in levels:
                    n = args.requests or max(16, 4 * c)
                    tokens0, rounds0 = server_totals(port)
                    if args.aiperf:
                        r = aiperf_level(args.aiperf, port, endpoint, c, n, args.max_tokens,
                                         Path(args.engine) / "tokenizer", Path(tmp))
                    else:
                        r = asyncio.run(builtin_level(port, endpoint, c, prompts, n, args.max_tokens))
                    tokens1, rounds1 = server_totals(port)
                    r["tokens_per_round"] = (tokens1 - tokens0) / max(rounds1 - rounds0, 1)  # server side
                    rows.append({"endpoint": endpoint, "concurrency": c, **r})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as resp:
                health = json.loads(resp.read())
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(120)
    lines = [f"`retrace serve --engine {args.engine} --max-batch {args.max_batch} --verify-policy {args.verify_policy}`"
             f", load: {tool}; streaming, max_tokens {args.max_tokens}, greedy; server max batch seen "
             f"{health['max_batch_seen']}; server exit code after SIGTERM: {rc}.", "",
             "| endpoint | concurrency | requests | TTFT p50 (ms) | TTFT mean (ms) | inter-token (ms) | output tok/s "
             "| req/s | tokens/round (server) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['endpoint']} | {r['concurrency']} | {r['requests']} | {fmt(r['ttft_ms_p50'])} | "
                     f"{fmt(r['ttft_ms_mean'])} | {fmt(r['itl_ms_mean'], 2)} | {fmt(r['output_tok_s'])} | "
                     f"{fmt(r['req_s'], 2)} | {fmt(r['tokens_per_round'], 2)} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"tool": tool, "rows": rows, "health": health}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
