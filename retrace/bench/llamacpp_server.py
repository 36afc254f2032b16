"""llama.cpp's own speculative decoding as benchmark peers: `llama-server`, built from llama.cpp's source.

llama-cpp-python (retrace.bench.llamacpp_peers) exposes plain decoding and a prompt-lookup draft callable
only; llama.cpp's draft-model and DFlash modes run in its C++ tools. Here they run in `llama-server`, the
tool users deploy them with, built from the same vendored source (`make llama-tools`):
- `llamacpp-server-ar-<type>`: plain decoding in the server (the baseline of its speculative modes);
- `llamacpp-server-ngram-<type>`: its n-gram speculation (`--spec-type ngram-simple|ngram-map-k|ngram-mod`);
- `llamacpp-dflash-<type>`: its DFlash drafter type (`--spec-type draft-dflash`) with *our* drafter,
  converted by llama.cpp's own `convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET` (the drafter's
  config says `DFlashDraftModel`; llama.cpp takes the embedding and the head from the target, and drafts
  over the whole vocabulary: our draft-vocabulary map is not part of its format);
- `llamacpp-dflash-ngram-<type>`: DFlash and `ngram-mod` together (llama.cpp mixes a draft model with an
  n-gram type: its counterpart of our ReTrace with prompt lookup);
- `llamacpp-draft-<type>`: a draft model (`--spec-type draft-simple`): the bench's AR draft model, the one
  `ortgenai-draft` runs (padded to the target's vocabulary where smaller: `vocab_matched`).
<type> is the GGUF type CPU users pick at the bench's precision (q4_k_m for --weights int4, q8_0 for int8;
retrace.bench.precision); drafters are converted to q8_0 (llama.cpp's usual draft precision). Each
speculative mode runs at its best setting of SERVER_MODES (the n-gram type, `--spec-draft-n-max`), chosen by
a short timed run like onnxruntime-genai's n-gram width; llama.cpp's other settings stay at its defaults. A batch of B
prompts is B requests in flight at once on a server started with `--parallel B` (continuous batching, the
server's own). Greedy (temperature 0) or the run's sampling (retrace.bench.decoding), `ignore_eos`, exactly n
tokens, no prompt cache between requests.
Statistics from each response's `timings` (draft tokens, accepted): every round emits its accepted drafts
plus one token, so rounds = tokens - accepted.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from retrace.bench.decoding import GREEDY, Decoding
from retrace.bench.llamacpp_build import build_gguf, tool
from retrace.bench.systems import RunOut, System
from retrace.errors import RetraceError

# mode -> (its draft model: our DFlash drafter, the bench's AR draft or none; the settings tried: --spec-type and
# --spec-draft-n-max, llama.cpp's defaults for the rest)
SERVER_MODES = {
    "server-ar": (None, ({},)),
    "server-ngram": (None, tuple({"spec_type": t} for t in ("ngram-simple", "ngram-map-k", "ngram-mod"))),
    "dflash": ("drafter", tuple({"spec_type": "draft-dflash", "draft_max": n} for n in (3, 7, 15))),
    "dflash-ngram": ("drafter", tuple({"spec_type": "draft-dflash,ngram-mod", "draft_max": n} for n in (7, 15))),
    "draft": ("draft-ar", tuple({"spec_type": "draft-simple", "draft_max": n} for n in (4, 8, 16))),
}
DRAFT_TYPE = "Q8_0"
START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One `llama-server` process on a loopback port; closed with close() (or when the bench ends)."""

    def __init__(self, model: Path, threads: int, n_ctx: int, parallel: int, log_path: Path,
                 draft: Path | None = None, spec: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(tool("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx * parallel), "--parallel", str(parallel),
               "--no-webui", "-ngl", "0"]
        spec = spec or {}
        if draft is not None:
            cmd += ["-md", str(draft), "--spec-draft-threads", str(threads), "--spec-draft-threads-batch", str(threads)]
        if "spec_type" in spec:
            cmd += ["--spec-type", spec["spec_type"]]
        if "draft_max" in spec:
            cmd += ["--spec-draft-n-max", str(spec["draft_max"])]
        self.command = cmd
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready()
            if spec:  # the server goes on without speculation where it cannot set it up: that is no such peer
                failed = [ln for ln in log_path.read_text(errors="replace").splitlines()
                          if "failed to initialize speculative decoding" in ln]
                if failed:
                    raise RetraceError(f"llama-server runs without speculation ({failed[0].split('load_model: ')[-1]}) "
                                       f"(log: {log_path})")
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RetraceError(f"llama-server exited ({self.proc.returncode}) at start: {self._last_log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RetraceError(f"llama-server did not answer /health within {START_TIMEOUT_S:.0f} s: {self._last_log()}")

    def _last_log(self) -> str:
        lines = self.log_path.read_text(errors="replace").strip().splitlines() if self.log_path.is_file() else []
        return f"{lines[-1] if lines else 'no output'} (log: {self.log_path})"

    def complete(self, prompt: list[int], n: int, sampling: dict | None = None) -> dict:
        """Exactly n new tokens, greedy or at `sampling` (Decoding.llama_server_body) -> the server's response
        (`tokens`, `timings`)."""
        body = {"prompt": prompt, "n_predict": n, **(sampling or GREEDY.llama_server_body(0)), "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RetraceError(f"llama-server /completion: HTTP {e.code} {e.read()[:200]!r}") from None
        if len(out.get("tokens", [])) != n:
            raise RetraceError(f"llama-server returned {len(out.get('tokens', []))} tokens, not {n}")
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def speculative_stats(responses: list[dict]) -> dict | None:
    """The responses' draft counters summed, in the bench's speculative-statistics keys (None: no drafts)."""
    timings = [r.get("timings", {}) for r in responses]
    if not any("draft_n" in t for t in timings):
        return None
    drafted = sum(int(t.get("draft_n", 0)) for t in timings)
    accepted = sum(int(t.get("draft_n_accepted", 0)) for t in timings)
    tokens = sum(len(r["tokens"]) for r in responses)
    rounds = tokens - accepted
    return {"rounds": rounds, "draft_tokens_evaluated": drafted, "draft_tokens_accepted": accepted,
            "tokens_emitted": tokens, "standard_fallback_steps": None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "tokens_per_round": tokens / rounds if rounds else None}


class LlamaServerSystem(System):
    """A llama-server mode; its server is started at the first run of each batch size (`--parallel B`)."""

    def __init__(self, name: str, model: Path, threads: int, n_ctx: int, logs: Path, draft: Path | None = None,
                 spec: dict | None = None, decoding: Decoding = GREEDY):
        self.name, self.model, self.threads, self.n_ctx, self.logs = name, model, threads, n_ctx, logs
        self.decoding = decoding
        self.draft, self.spec = draft, spec or {}
        self.server: LlamaServer | None = None
        self.parallel = 0

    def _server(self, parallel: int) -> LlamaServer:
        if self.server is None or self.parallel != parallel:
            self.close()
            self.server = LlamaServer(self.model, self.threads, self.n_ctx, parallel,
                                      self.logs / f"{self.name}-np{parallel}.log", self.draft, self.spec)
            self.parallel = parallel
        return self.server

    def run(self, prompts, n, batch_size, progress=None) -> RunOut:
        server = self._server(batch_size)

        def one(i, p):
            out = server.complete(list(p), n, self.decoding.llama_server_body(i))
            if progress is not None:
                progress(n)
            return out

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=batch_size) as pool:
            responses = list(pool.map(one, range(len(prompts)), prompts))
        wall = time.perf_counter() - t0
        return RunOut([[int(t) for t in r["tokens"]] for r in responses], wall, stats=speculative_stats(responses))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def vocab_matched(draft_dir: Path, target_dir: str | Path, cache: Path) -> Path:
    """The AR draft at the target's vocabulary size: llama.cpp refuses a draft model whose vocabulary differs from
    the target's. A smaller one (the small zoo's draft beside its inflated target) is padded with zero rows
    (retrace.train.draft_ar.pad_vocab, the same as onnxruntime-genai's draft gets) into the cache, once."""
    from retrace.digest import dir_digest
    from retrace.train.draft_ar import pad_vocab

    tv = json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"]
    dv = json.loads((Path(draft_dir) / "config.json").read_text())["vocab_size"]
    if dv == tv:
        return Path(draft_dir)
    if dv > tv:
        raise RetraceError(f"the draft model {draft_dir} has a larger vocabulary ({dv}) than the target ({tv})")
    out = cache / f"draft-padded-{dir_digest(draft_dir, extra=str(tv))}"
    return out if (out / "config.json").is_file() else pad_vocab(draft_dir, out, tv)


def add_llama_server_systems(built, cfg, cache: Path, threads: int, tune_prompts, log, n_ctx: int) -> None:
    """The llama-server systems at each quantized precision of cfg.weights (see the module docstring)."""
    from retrace.bench.config import wanted
    from retrace.bench.ortgenai_peers import TUNE_TOKENS, find_draft_ar, measure_best
    from retrace.bench.precision import llamacpp_type

    seen = set()
    for weights in cfg.weights:
        gtype = llamacpp_type(weights)
        if gtype is None or gtype in seen:
            continue
        seen.add(gtype)
        names = {m: f"llamacpp-{m}-{gtype.lower()}" for m in SERVER_MODES}
        names = {m: nm for m, nm in names.items() if wanted(nm, cfg.systems)}
        if not names:
            continue
        try:
            server = tool("llama-server")
            gguf = build_gguf(cfg.target, cache, gtype, log)
        except (RetraceError, OSError) as e:
            built.skip(list(names.values()), str(e).splitlines()[0])
            continue
        built.builds[f"llamacpp_server_{gtype.lower()}"] = {"gguf": str(gguf), "server": str(server)}
        for mode, name in names.items():
            draft_kind, options = SERVER_MODES[mode]
            try:
                draft = None
                if draft_kind == "drafter":
                    draft = build_gguf(cfg.drafter, cache, DRAFT_TYPE, log, target_dir=cfg.target)
                elif draft_kind == "draft-ar":
                    draft = build_gguf(vocab_matched(find_draft_ar(cfg, cache, log), cfg.target, cache), cache,
                                       DRAFT_TYPE, log)

                def make(spec, name=name, draft=draft, gguf=gguf):
                    return LlamaServerSystem(name, gguf, threads, n_ctx, cache / "llama-server-logs", draft, spec,
                                             Decoding.of(cfg))

                extra = {"draft_gguf": str(draft)} if draft is not None else {}
                if len(options) == 1 or not tune_prompts:
                    system = make(options[-1])
                    system.settings = {"speculative": options[-1], **extra,
                                       "chosen_by": "the only setting" if len(options) == 1 else "no tuning prompts"}
                else:
                    system, spec, table = measure_best(make, options, list(tune_prompts)[:2],
                                                       min(TUNE_TOKENS, cfg.max_new_tokens))
                    system.settings = {"speculative": spec, **extra, "candidates": table,
                                       "chosen_by": f"fastest of {len(options)} settings"}
                built.systems.append(system)
            except (RetraceError, OSError, ValueError) as e:
                built.skip([name], str(e).splitlines()[0])
