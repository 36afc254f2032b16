"""`python -m retrace.gpucheck OUTDIR`: the one prepared GPU check (issue 17), run by scripts/gpu_check.sh.

Sections, each independent (an error is recorded with its traceback and the next section runs), the JSON
rewritten after every section so a timeout still leaves results:

- ``environment``: GPU, torch / CUDA / Triton / transformers / onnxruntime versions;
- ``parity``: ar / dflash / retrace greedy outputs of the carried zoo pair on the torch backend (device),
  fp32 and bf16, batch 1 and 8, against the CPU reference carried as JSON (`reference.py`);
- ``kernels``: the GatedSuffixFusion Triton kernels compiled for real against the torch reference;
- ``scale``: a zoo-style pair trained on the machine from its own site-packages sources, then tau of dflash
  vs retrace (paired per prompt, T=0 and T=1), a greedy losslessness check and the suffix-headroom oracles.

- ``ort_cuda``: the zoo pair's engine bundle (fp32 and fp16) on ONNX Runtime's CUDA provider against the
  torch backend on the device, token for token (skipped without onnxruntime-gpu);
- ``tensorrt``: the same bundle with TensorRT plans built and run by the TensorRT backend (skipped without
  tensorrt); both in `engines.py`.

``--dry-run`` runs the same steps on CPU at toy sizes (tests/test_gpu_check.py; `ort_cuda` on the CPU
provider, `tensorrt` skipped unless TensorRT is installed).
"""
