"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the student, the teacher, the fake score and the EMA under
``torchrun`` (``fsdp: true`` / ``--fsdp``).

Each DiT is one FSDP unit: its parameters, gradients and AdamW state are sharded over the processes, and the whole
model is gathered for each of its forwards (``reshard_after_forward``), then freed. The DiT's layer loop reads each
block's parameters directly instead of calling the block as a module, so per-block units would never be gathered;
instead the model's entry points are registered as FSDP forward methods (:data:`FORWARD_METHODS`): the training
forward, the rollout's cached block forward and the cross-attention preparation all gather and free the model.
The motion head (used outside any forward, a few thousand parameters) is not sharded: its gradients are averaged by
hand. Checkpoints hold full (unsharded) state dicts, gathered to rank 0, so ``state.pt`` and ``student.pt`` are the
same files as without FSDP.
"""

from __future__ import annotations

import torch

#: the DiT methods that read its parameters (each gathers and frees the unit like ``forward``)
FORWARD_METHODS = ("forward_train", "forward_with_context", "forward_block", "prepare_cross_attention",
                   "cross_attention")


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def shard(model: torch.nn.Module, *, methods: bool = True) -> torch.nn.Module:
    """``fully_shard`` the model in place (one unit) and register its entry points as forward methods."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    fully_shard(model, reshard_after_forward=True)  # explicit: else the root (our only unit) stays gathered
    if methods:
        for name in FORWARD_METHODS:
            register_fsdp_forward_method(model, name)
    return model


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict on rank 0's CPU (a collective: every rank calls it; the others get ``{}``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def full_optim_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=_options(cpu_offload=True))


def load_state(model: torch.nn.Module, state: dict) -> None:
    """Load a full state dict (every rank read the same file) into the sharded model."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options())


def load_optim_state(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, opt, state, options=_options())


def average_grads(module: torch.nn.Module, world: int) -> None:
    """The unsharded motion head's gradients averaged over the processes (what DDP would do)."""
    for p in module.parameters():
        if p.grad is not None:
            torch.distributed.all_reduce(p.grad)
            p.grad.div_(world)


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` over sharded (DTensor) and plain gradients together: the total norm is the
    norm of the full gradients, the same on every rank."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norms = []
    for group in ([g for g in grads if isinstance(g, DTensor)], [g for g in grads if not isinstance(g, DTensor)]):
        if group:
            n = torch.nn.utils.get_total_norm(group)
            norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
    coef = min(1.0, max_norm / (total + 1e-6))
    for g in grads:
        g.mul_(coef)
    return total


def _local_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> int:
    """Bytes this rank holds of the model's parameters, their gradients and the optimiser's moments (its shards)."""
    from torch.distributed.tensor import DTensor

    def size(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    n = sum(size(p) + (size(p.grad) if p.grad is not None else 0) for p in model.parameters())
    if opt is not None:
        n += sum(size(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return n


def shard_bytes(models, world: int) -> dict[str, list[int]]:
    """What FSDP2 holds on each rank, by the memory plan's items (``plan.py``: teacher, student, student_ema,
    fake_score), measured from the local shards; a collective. Compare with ``memory_plan(gpus=world)``."""
    mine = torch.tensor([_local_bytes(models.teacher), _local_bytes(models.student, models.opt_gen),
                         _local_bytes(models.ema), _local_bytes(models.fake, models.opt_fake)], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    torch.distributed.all_gather(every, mine)
    keys = ("teacher", "student", "student_ema", "fake_score")
    return {k: [int(r[i]) for r in every] for i, k in enumerate(keys)}
