"""`--fsdp`: the trainable weights sharded over the torchrun processes with FSDP2 (`fully_shard`).

The training forward (`blocks.BlockModel`) is one FSDP unit: its trainable parameters (the drafter's fc,
norms and layers; the conditioner) are split across the ranks at rest, and so are their gradients
(reduce-scattered) and the AdamW moments; each micro-batch all-gathers them for its forward and backward
(one unit: the full trainable weights exist on each rank while a micro-batch runs; per-layer units would
need `block_forward`'s per-layer context K/V to run inside the layers' forwards).
The frozen parameters (a frozen drafter under `train conditioner`) are ignored by FSDP and stay replicated;
the target, with the shared embedding and LM head, is not a submodule at all. Works with gloo on CPU and
nccl on CUDA. Gradient clipping sees DTensor gradients, so `clip_grad_norm_` takes the global norm.

Everything outside the training forward (evaluation, rollouts, runtime tau, writing the drafter) runs inside
:func:`full_params`, which all-gathers the weights into the modules on every rank. Training checkpoints are
gathered to full, unsharded tensors (`get_model_state_dict` / `get_optimizer_state_dict`, full_state_dict,
cpu_offload) and written by rank 0 in the format of a one-process or DDP run (`common.save_train_state`);
resuming reads that full state on every rank and shards it (`set_model_state_dict` /
`set_optimizer_state_dict`), so a checkpoint moves freely between world sizes and between --fsdp and DDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from retrace.errors import RetraceError
from retrace.train import common as cm


def shard(module: torch.nn.Module, world: int, device: torch.device) -> torch.nn.Module:
    """fully_shard `module` in place over a 1-D mesh of `world` ranks (its frozen parameters left alone)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    frozen = {p for p in module.parameters() if not p.requires_grad}
    if len(frozen) == len(list(module.parameters())):
        raise RetraceError("--fsdp: the model has no trainable parameters to shard")
    mesh = init_device_mesh(device.type, (world,))
    # kept gathered from the forward to the end of the backward (as FSDP does for a root anyway): the trainers'
    # no-grad diagnostics between the two use the modules directly
    fully_shard(module, mesh=mesh, reshard_after_forward=False, ignored_params=frozen or None)
    return module


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def full_params(model) -> Iterator[None]:
    """The full weights in the modules for uses outside the training forward (collective: every rank enters).
    A no-op without --fsdp."""
    if not is_sharded(model):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def _order(model, params: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer) -> tuple[list[str], dict]:
    """(the model FQNs of the optimizer's parameters in torch's index order, {FQN: trainer's name})."""
    fqn = {id(p): n for n, p in model.named_parameters()}
    name = {fqn[id(p)]: n for n, p in params.items()}
    return [fqn[id(p)] for g in opt.param_groups for p in g["params"]], name


def gather_train_state(model, params: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer):
    """(parameters, optimizer) for `common.save_train_state`: under --fsdp the full, unsharded tensors on CPU
    (collective; rank 0 gets them, the others empty dicts); otherwise `params` and `opt` themselves."""
    if not is_sharded(model):
        return params, opt
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    o = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=o)
    osd = get_optimizer_state_dict(model, opt, options=o)
    if not msd:  # not rank 0
        return {}, {}
    order, name = _order(model, params, opt)
    index = {f: i for i, f in enumerate(order)}
    return ({name[f]: msd[f] for f in order},
            {"state": {index[f]: st for f, st in osd["state"].items()},
             "param_groups": [{**g, "params": [index[f] for f in g["params"]]} for g in osd["param_groups"]]})


def load_train_state(out_dir: str | Path, params: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer,
                     model, state: str = cm.STATE_DIR) -> tuple[int, dict, dict[str, torch.Tensor]]:
    """`common.load_train_state`, also under --fsdp: every rank reads the full checkpoint and keeps its shards."""
    if not is_sharded(model):
        return cm.load_train_state(out_dir, params, opt, state)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    step, info, full, osd, rng = cm.read_train_state(out_dir, list(params), state)
    order, name = _order(model, params, opt)
    if len(osd["state"]) > len(order) or any(i >= len(order) for i in osd["state"]):
        raise RetraceError(f"{Path(out_dir) / state}: the optimizer state has other parameters than this model")
    o = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, {f: full[name[f]] for f in order}, options=StateDictOptions(full_state_dict=True,
                                                                                             strict=False))
    set_optimizer_state_dict(model, opt, {
        "state": {order[i]: st for i, st in osd["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in osd["param_groups"]]}, options=o)
    torch.set_rng_state(rng.pop("torch"))
    return step, info, rng


__all__ = ["shard", "is_sharded", "full_params", "gather_train_state", "load_train_state"]
