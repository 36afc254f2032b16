"""`retrace serve`: the OpenAI-compatible server (app.py) on uvicorn, for an engine bundle or model dirs."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

import click

from retrace.cli_checks import check_finite
from retrace.cli_errors import cli_errors
from retrace.cli_options import build_runtime, runtime_options
from retrace.errors import MissingDependencyError, RetraceError
from retrace.request_validation import MAX_PROMPT_CHARS
from retrace.serve.limits import MAX_BODY_BYTES, ServeLimits

GRACE_S = 5.0  # beyond --drain-timeout: time to answer what the drain failed


@click.command("serve")
@runtime_options
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--max-queue", type=click.IntRange(0), default=256, show_default=True,
              help="requests that may wait beyond the batch slots; more get HTTP 503")
@click.option("--chat-template", type=click.Path(dir_okay=False), default=None,
              help="Jinja chat template file (default: the tokenizer's own)")
@click.option("--served-model-name", default=None, help="model id clients send [default: the bundle's name]")
@click.option("--drain-timeout", type=float, default=60.0, show_default=True,
              help="seconds to finish in-flight requests on SIGTERM / Ctrl-C; then the rest get 503")
@click.option("--max-body-bytes", type=click.IntRange(1024), default=MAX_BODY_BYTES, show_default=True,
              help="larger request bodies get 413")
@click.option("--max-prompt-chars", type=click.IntRange(1), default=MAX_PROMPT_CHARS, show_default=True,
              help="longer text prompts (chat: all messages) get 400 before they are tokenized")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)
@cli_errors
def serve(target, drafter, engine, backend, options, host, port, max_queue, chat_template, served_model_name,
          drain_timeout, max_body_bytes, max_prompt_chars, log_level) -> None:
    """OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)."""
    try:
        import uvicorn

        from retrace.serve.app import Service, create_app
    except ImportError as e:
        raise MissingDependencyError("retrace serve needs the 'serve' extra (pip install 'retrace[serve]'): "
                                     f"{e}") from None
    from retrace.runtime.serving_engine import ServingEngine
    from retrace.serve.chat import ChatTemplate

    check_finite(drain_timeout, "--drain-timeout", low=0.0)
    _Server = _server_class()

    rt = build_runtime(target, drafter, engine, backend, options.serving())
    codec_path = getattr(rt.codec, "path", None)
    chat = ChatTemplate.load(codec_path.parent if codec_path else None, chat_template)
    name = served_model_name or Path(engine or target).resolve().name
    if not name:
        raise RetraceError("give --served-model-name")
    svc = Service(ServingEngine(rt, max_queue=max_queue, log=lambda m: click.echo(f"[retrace] {m}", err=True)), name,
                  chat, drain_s=drain_timeout,
                  limits=ServeLimits(max_body_bytes=max_body_bytes, max_prompt_chars=max_prompt_chars))
    chunk = rt.scheduler().prefill_chunk  # what "auto" came to on this device
    click.echo(f"retrace serve: model `{name}` ({rt.backend.name}, max_batch {rt.backend.max_batch}, modes "
               f"{', '.join(svc.modes)}, chat template {'yes' if chat else 'no'}, prefill "
               f"{f'{chunk} tokens a step' if chunk else 'whole prompts'}) on http://{host}:{port}", err=True)
    # the engine drains from the signal on (Service.begin_drain); uvicorn waits a little longer, so the
    # requests the drain fails still get their 503 / error event
    config = uvicorn.Config(create_app(svc), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout + GRACE_S)
    server = _Server(config)
    server.on_exit = svc.begin_drain
    server.run()


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        on_exit = None  # called at the first SIGTERM / Ctrl-C

        def handle_exit(self, sig, frame) -> None:
            if self.on_exit is not None and not self.should_exit:
                self.on_exit()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """Like uvicorn's, but SIGTERM / Ctrl-C end in a graceful shutdown and exit 0 (uvicorn re-raises
            the signal after it, which kills the process with that signal)."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server
