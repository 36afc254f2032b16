"""safetensors I/O with validation: every missing, extra or mis-shaped tensor is named in one message.

Only safetensors and JSON are ever read from user files (no pickles).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from retrace.errors import CheckpointError


def weight_files(directory: Path, exclude: tuple[str, ...] = (), what: str = "") -> list[Path]:
    """The directory's *.safetensors files (minus `exclude` names); an error naming any pickles found."""
    files = [p for p in sorted(directory.glob("*.safetensors")) if p.name not in exclude]
    if not files:
        bins = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
        hint = f" (found {bins}: pickle checkpoints are not loaded; convert them to safetensors)" if bins else ""
        raise CheckpointError(f"{directory}: no {what}.safetensors weight files{hint}")
    return files


def weights_location(directory: Path, files: list[Path]) -> Path:
    """What to name in a message about these weights: the file itself, or the directory if sharded."""
    return files[0] if len(files) == 1 else directory


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    return dict(CheckpointTensors([path]))


def read_dir_tensors(directory: Path, files: list[Path] | None = None) -> dict[str, torch.Tensor]:
    return dict(CheckpointTensors(files if files is not None else weight_files(directory)))


# safetensors' dtype names (a file header's "dtype")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """The tensors of safetensors files as one mapping that reads a tensor only when it is indexed (the files
    memory-mapped by safetensors' `safe_open`). `load_into` checks names, shapes and dtypes from the files'
    headers (`meta`), then copies one tensor at a time into its parameter: a checkpoint is never in memory
    whole, nor in a dtype other than the parameter's (a bf16 Qwen3-8B loads as 16 GB of bf16 parameters, not
    beside a 33 GB fp32 copy). A name in several files: the last file's, as `read_dir_tensors`."""

    def __init__(self, files: list[Path]):
        self._files: dict[str, tuple[Path, object]] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{f}: cannot read safetensors file ({e}); is it truncated or corrupt?") from None
            for name in handle.keys():
                self._files[name] = (f, handle)

    def __getitem__(self, name: str) -> torch.Tensor:
        f, handle = self._files[name]
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: cannot read tensor {name!r} ({e}): truncated or corrupt?") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def meta(self, name: str) -> torch.Tensor:
        """The tensor's shape and dtype from its file's header (no data read), as a meta tensor."""
        f, handle = self._files[name]
        piece = handle.get_slice(name)
        dtype = _DTYPES.get(piece.get_dtype())
        if dtype is None:
            raise CheckpointError(f"{f}: tensor {name!r} has dtype {piece.get_dtype()}, which retrace cannot load")
        return torch.empty(piece.get_shape(), dtype=dtype, device="meta")


def load_into(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor], where: Path,
              optional: tuple[str, ...] = (), ignore_prefixes: tuple[str, ...] = (),
              config_path: Path | None = None) -> None:
    """Copy tensors into module parameters by name (each converted to the parameter's dtype and device),
    checking names and shapes first.

    `where` (the weight file) and `config_path` (the config the expected shapes come from) are named in the
    one error message that lists every missing, unexpected and mis-shaped tensor. `tensors` may be a
    `CheckpointTensors`: the checks then read the files' headers only, and the copies read one tensor each.
    """
    expected = dict(module.state_dict())
    headers = tensors.meta if isinstance(tensors, CheckpointTensors) else tensors.__getitem__
    source, tensors = tensors, {k: headers(k) for k in tensors if not k.startswith(ignore_prefixes)}
    missing = [k for k in expected if k not in tensors and k not in optional]
    unexpected = [k for k in tensors if k not in expected]
    shapes = [
        f"{k}: file {tuple(tensors[k].shape)} vs expected {tuple(expected[k].shape)}"
        for k in expected
        if k in tensors and tensors[k].shape != expected[k].shape
    ]
    kinds = [f"{k}: {tensors[k].dtype}" for k in expected
             if k in tensors and expected[k].is_floating_point() and not tensors[k].is_floating_point()]
    problems = []
    if kinds:  # integer weights would be copied in silently as numbers, not as the floats they stand for
        problems.append("non-floating-point weights " + "; ".join(kinds[:8]))
    if missing:
        problems.append(f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    if shapes:
        problems.append("shape mismatch " + "; ".join(shapes[:8]))
    if problems:
        against = f"the config ({config_path})" if config_path is not None else "the config"
        raise CheckpointError(f"{where}: weights do not match {against}: " + "; ".join(problems))
    with torch.no_grad():
        for k, t in expected.items():
            if k in tensors:
                t.copy_(source[k])


def file_mode() -> int:
    """The mode a plain open() gives a new file (0644 under the usual umask 022); mkstemp gives 0600."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def plain_modes(directory: Path) -> None:
    """Give the files directly in `directory` the plain mode: writers that go through a temp file
    (transformers' save_pretrained among them) leave model.safetensors 0600 beside 0644 files."""
    mode = file_mode()
    for p in Path(directory).iterdir():
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)


def atomic_save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    """Write a safetensors file via a temp file in the same directory and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
