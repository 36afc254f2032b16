"""Triton python-backend model serving a ReTrace engine bundle (copied as ``<model>/1/model.py``).

Decoupled: ``execute`` validates each request and either answers it at once with an error (FINAL flag) or
queues it; a background thread (:class:`retrace.export.triton.serving.ServingLoop`) runs the runtime's
scheduler so concurrent requests share rounds, and sends one response per commit (``stream`` true) or
one final response. Requests follow this model's own inputs or the TensorRT-LLM or vLLM backend's
conventions (validation.py, conventions.py); finished requests update Triton custom metrics
(triton_metrics.py, on the server's metrics port). Parameters (config.pbtxt) that drive it:

``RETRACE_BUNDLE``            engine bundle directory (relative paths are relative to the model directory)
``RETRACE_BACKEND``           runtime backend (default ``onnxruntime``)
``RETRACE_MAX_BATCH``         requests decoded together (scheduler slots)
``RETRACE_MAX_TOKENS``        cap on ``max_tokens`` (0: from the bundle / runtime)
``RETRACE_MODES``             comma-separated modes clients may ask for; the first is the default
``RETRACE_PYTHONPATH``        extra import directories (``:``-separated, relative to the model directory)
``RETRACE_RUNTIME_FACTORY``   "module:callable" replacing the real runtime (tests: the stand-in)
``RETRACE_RUNTIME_OPTIONS``   JSON keyword arguments for the runtime factory
``RETRACE_DEVICE``            ``cpu`` or ``cuda`` (a KIND_GPU instance runs on the GPU Triton gives it)
"""

import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# The repository carries its own copy of the retrace package beside this file: put it first so the
# model runs the code it was generated with, whatever else the execution environment holds.
if os.path.isdir(os.path.join(_HERE, "retrace")) and _HERE not in sys.path[:1]:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _log(msg):
    logger = getattr(pb_utils, "Logger", None)
    if logger is not None:
        logger.log_info(f"[retrace] {msg}")
    else:
        print(f"[retrace] {msg}", file=sys.stderr, flush=True)


def _error(message, kind="invalid"):
    code_name = {"invalid": "INVALID_ARG", "unavailable": "UNAVAILABLE", "cancelled": "CANCELLED"}.get(kind, "INTERNAL")
    code = getattr(pb_utils.TritonError, code_name, None)
    err = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=err)


def _bytes_tensor(name, text):
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))


class _TritonSink:
    """Adapts a decoupled response sender to :class:`retrace.export.triton.serving.Sink`. With
    exclude_input_in_output false the first response starts with the prompt (its text, or its ids when the
    prompt was given as ids), as TensorRT-LLM and vLLM do; a finished request updates the metrics."""

    def __init__(self, sender, spec, metrics=None):
        self.sender, self.mode, self.metrics = sender, spec.mode, metrics
        self.prefix_text = "" if spec.exclude_input or spec.prompt_text is None else spec.prompt_text
        self.prefix_ids = [] if spec.exclude_input or spec.prompt_ids is None else list(spec.prompt_ids)

    def send(self, token_ids, text, stats, final):
        if self.prefix_text or self.prefix_ids:
            text, token_ids = self.prefix_text + text, self.prefix_ids + list(token_ids)
            self.prefix_text, self.prefix_ids = "", []
        outputs = [_bytes_tensor("text_output", text),
                   pb_utils.Tensor("output_ids", np.asarray(token_ids, dtype=np.int64).reshape(-1))]
        if stats is not None:
            outputs.append(_bytes_tensor("stats", json.dumps(stats)))
        if final and stats is not None:  # counted before the client can see the end (a scrape then agrees)
            self._observe(stats, stats.get("finish_reason"))
        self.sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=_FINAL if final else 0)

    def error(self, message, kind="internal"):
        # cancelled and failed requests are counted too (no acceptance stats), before the client sees the error
        self._observe({}, "cancelled" if kind == "cancelled" else "error")
        self.sender.send(_error(message, kind), flags=_FINAL)

    def _observe(self, stats, finish_reason):
        if self.metrics is None:
            return
        try:
            self.metrics.observe(self.mode, stats, finish_reason)
        except Exception as e:  # metrics must never fail a request
            _log(f"metrics update failed: {type(e).__name__}: {e}")

    def is_cancelled(self):
        return self.sender.is_cancelled()


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the ReTrace model must be decoupled (model_transaction_policy)")
        if int(np.__version__.split(".")[0]) >= 2:
            # Seen with tritonserver 2.51: the stub then garbles output tensors and dies on the first BYTES
            # input, and the server cannot shut down cleanly. Refuse to load instead.
            raise pb_utils.TritonModelException(
                f"numpy {np.__version__} in the model's Python environment ({sys.prefix}); the python backend "
                "needs numpy<2: set EXECUTION_ENV_PATH to an environment made by "
                "`python -m retrace.export.triton.env` (or install numpy<2 there)"
            )
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        model_dir = args["model_repository"]

        def resolve(p):
            return p if os.path.isabs(p) else os.path.normpath(os.path.join(model_dir, p))

        for p in filter(None, params.get("RETRACE_PYTHONPATH", "").split(os.pathsep)):
            if resolve(p) not in sys.path:
                sys.path.insert(0, resolve(p))

        from retrace.export.triton import serving
        from retrace.export.triton.validation import INPUTS, Limits, RequestError, parse_request

        self._parse, self._RequestError, self._input_names = parse_request, RequestError, tuple(INPUTS)
        self._Job = serving.Job
        bundle = resolve(params.get("RETRACE_BUNDLE", "bundle"))
        manifest = serving.read_manifest(bundle)
        max_batch = int(params.get("RETRACE_MAX_BATCH", "8"))
        options = json.loads(params.get("RETRACE_RUNTIME_OPTIONS") or "{}")
        if params.get("RETRACE_DEVICE") == "cuda":
            options.setdefault("device", f"cuda:{int(args.get('model_instance_device_id') or 0)}")
        runtime = serving.create_runtime(
            bundle,
            backend=params.get("RETRACE_BACKEND") or serving.DEFAULT_BACKEND,
            max_batch=max_batch,
            factory=params.get("RETRACE_RUNTIME_FACTORY") or None,
            options=options,
            verify_policy=params.get("RETRACE_VERIFY_POLICY") or "adaptive",
        )
        adapter = serving.RuntimeAdapter(runtime)
        max_batch = min(max_batch, adapter.max_batch or max_batch)
        blim = serving.bundle_limits(manifest)
        # Token budget per request: prompt + max_tokens must fit the caches with room for a last draft block.
        max_seq_len = adapter.max_seq_len or blim["max_seq_len"]
        budget = max_seq_len - adapter.reserve if max_seq_len else None
        max_tokens = int(params.get("RETRACE_MAX_TOKENS") or 0) or blim["max_new_tokens"]
        if not max_tokens:
            max_tokens = budget - 1 if budget else 4096
        modes = [m.strip() for m in (params.get("RETRACE_MODES") or "retrace,dflash,ar").split(",") if m.strip()]
        self.limits = Limits(max_tokens=max_tokens, max_seq_len=budget,
                             vocab_size=adapter.vocab_size or blim["vocab_size"], modes=tuple(modes),
                             default_mode=modes[0], eos_ids=adapter.eos_ids)
        block = adapter.drafter_block_size or 16
        self.metrics = None
        if hasattr(pb_utils, "MetricFamily"):
            from retrace.export.triton.triton_metrics import TritonMetrics

            self.metrics = TritonMetrics(pb_utils, max_length=int(block))
        self.loop = serving.ServingLoop(adapter, self.limits, max_batch=max_batch, log=_log)
        self.loop.start()
        _log(f"{args['model_name']} ({args['model_instance_name']}) serving {bundle} with "
             f"{type(runtime).__name__}, max_batch={max_batch}, limits={self.limits}")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = {}
                for name in self._input_names:
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    inputs[name] = None if t is None else t.as_numpy()
                spec = self._parse(inputs, request.parameters(), self.limits)
            except self._RequestError as e:
                sender.send(_error(str(e), "invalid"), flags=_FINAL)
                continue
            except Exception as e:  # a bug must still answer the client
                sender.send(_error(f"could not read the request: {type(e).__name__}: {e}", "internal"), flags=_FINAL)
                continue
            self.loop.submit(self._Job(spec=spec, sink=_TritonSink(sender, spec, self.metrics)))
        return None

    def finalize(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
            _log(f"stopped: {loop.snapshot()}")
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
