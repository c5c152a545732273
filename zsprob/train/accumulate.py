"""Large batches on few processes: exact gradient accumulation for pairwise losses, and activation
checkpointing of the towers.

Accumulation (``train.accum_steps K``) is open_clip's ``--accum-freq`` as a "gradient cache": embed the K
micro-batches without gradients, take the loss's gradient w.r.t. all embeddings once, then re-encode each chunk
from its saved RNG state and backpropagate ``<emb_c, dL/d emb_c>``. Exact except for BatchNorm (docs/training.md)."""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from zsprob.errors import UserError

SIDES = ("img_mu", "img_logvar", "txt_mu", "txt_logvar")


def at_least_fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    """float32 for half / bfloat16 / float32 tensors, float64 stays (the dtype losses are computed in)."""
    return None if t is None else t.to(torch.promote_types(t.dtype, torch.float32))


def check_accum_steps(k: int, local_batch_size: int) -> int:
    """``train.accum_steps`` if it divides the per-process batch, else a UserError."""
    k = int(k)
    if local_batch_size % k:
        raise UserError(f"train.accum_steps {k} does not divide the per-process batch {local_batch_size} "
                        "(data.batch_size / processes); pick a divisor")
    return k


def enable_grad_checkpointing(model: nn.Module) -> list[str]:
    """Turn on activation checkpointing; returns the towers it covers (UserError when none can)."""
    name = getattr(model, "name", type(model).__name__)
    if not callable(getattr(model, "set_grad_checkpointing", None)):
        raise UserError(f"model.grad_checkpointing: model {name} has no set_grad_checkpointing; set it to false")
    towers = [(what, getattr(model, attr, None)) for what, attr in (("image", "_vision"), ("text", "_text"))]
    covered = [what for what, tower in towers if int(getattr(tower, "num_blocks", 0) or 0) > 0]
    if not covered:
        raise UserError(f"model.grad_checkpointing: model {name} has no transformer blocks or CNN stages to "
                        "recompute (bag-of-words towers); set it to false")
    for what, _ in towers:
        if what not in covered:
            warnings.warn(f"model.grad_checkpointing: the {what} tower of {name} has no blocks; only the "
                          f"{', '.join(covered)} tower is checkpointed")
    model.set_grad_checkpointing(True)
    return covered


# ----------------------------------------------------------------------------- accumulation

def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def chunk_inputs(images: torch.Tensor, tokens: torch.Tensor, k: int, masked) -> list:
    """[(images, tokens)] of the K micro-batches, then of the masked copies in pieces of n / K rows."""
    micro = images.shape[0] // k
    chunks = list(zip(images.split(micro), tokens.split(micro)))
    if masked is not None:
        chunks += list(zip(masked[0].split(micro), masked[1].split(micro)))
    return chunks


def _leaves(outs: list[dict], side: str) -> torch.Tensor | None:
    if outs[0][side] is None:
        return None
    return torch.cat([o[side] for o in outs]).requires_grad_(True)


@dataclass
class Surrogate:
    """The scalar a re-encoding pass backpropagates: sum of <embedding, its cached gradient> (+ <loss
    parameter, its gradient> on the last chunk)."""

    grads: dict  # side -> gradient of the loss w.r.t. this chunk's embeddings (or None)
    loss_params: tuple = ()  # ((parameter, gradient), ...)

    def __call__(self, model: nn.Module, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        out = model(images, tokens)
        with torch.autocast(device_type=images.device.type, enabled=False):
            total = torch.zeros((), device=images.device)
            for side in SIDES:
                if out[side] is not None and self.grads[side] is not None:
                    total = total + (at_least_fp32(out[side]) * self.grads[side]).sum()
            for p, g in self.loss_params:
                total = total + (p * g.to(p.dtype)).sum()
        return total


@contextlib.contextmanager
def frozen_norm_statistics(model: nn.Module):
    """Inside, training-mode BatchNorm normalises with the batch's statistics but leaves its running ones (and
    counter) alone: for passes that must not count (the no-gradient pass, the occlusion term's masked copies).
    Done with momentum 0, not by restoring the buffers, which backward may still need."""
    norms = [m for m in model.modules()
             if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats]
    saved = [(m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        with torch.no_grad():
            for m, (momentum, count) in zip(norms, saved):
                m.momentum = momentum
                if count is not None:
                    m.num_batches_tracked.copy_(count)


def _encode_chunks(raw, chunks: list, autocast) -> tuple[list[dict], list]:
    """The no-gradient pass: every chunk's embeddings and the torch RNG state before it."""
    outs, states = [], []
    device = chunks[0][0].device
    with torch.no_grad(), frozen_norm_statistics(raw.model):
        for images, tokens in chunks:
            states.append(_rng_state(device))
            with autocast():
                out = raw.model(images, tokens)
            outs.append({s: at_least_fp32(out[s].detach()) if out[s] is not None else None for s in SIDES})
    return outs, states


def _cached_loss(raw, outs: list[dict], n_data: int, matched, step: int):
    """Loss and stats on the cached embeddings; the gradients of every chunk's embeddings and the loss's parameters."""
    data = {s: _leaves(outs[:n_data], s) for s in SIDES}
    masked = {}
    if len(outs) > n_data:
        m = {s: _leaves(outs[n_data:], s) for s in SIDES}
        masked = {"masked_img": (m["img_mu"], m["img_logvar"]), "masked_txt": (m["txt_mu"], m["txt_logvar"])}
    loss, stats = raw.pairwise_loss(data["img_mu"], data["img_logvar"], data["txt_mu"], data["txt_logvar"],
                                    matched, step, masked)
    params = [p for p in raw.loss.parameters() if p.requires_grad]
    groups = [data] + ([m] if masked else [])
    leaves = [g[s] for g in groups for s in SIDES if g[s] is not None]
    grads = torch.autograd.grad(loss, leaves + params, allow_unused=True)
    it = iter(grads[:len(leaves)])
    per_side = [{s: (next(it) if g[s] is not None else None) for s in SIDES} for g in groups]
    param_grads = tuple((p, g if g is not None else torch.zeros_like(p)) for p, g in zip(params, grads[len(leaves):]))
    return loss.detach(), stats, per_side, param_grads


def _chunk_grads(per_side: list[dict], outs: list[dict], n_data: int) -> list[dict]:
    """Split the gradients of the concatenated data / masked embeddings back into chunks."""
    result = []
    for group, chunk_outs in ((per_side[0], outs[:n_data]), (per_side[1] if len(per_side) > 1 else None,
                                                              outs[n_data:])):
        if group is None:
            continue
        sizes = [o["img_mu"].shape[0] for o in chunk_outs]
        parts = {s: (group[s].split(sizes) if group[s] is not None else [None] * len(sizes)) for s in SIDES}
        result += [{s: parts[s][i] for s in SIDES} for i in range(len(sizes))]
    return result


def accumulated_step(step_module: nn.Module, raw, images: torch.Tensor, tokens: torch.Tensor, matched,
                     step: int, k: int, acc=None):
    """Forward and backward of one step in ``k`` micro-batches, the gradients those of the whole-batch loss;
    (loss, stats). ``step_module``: the (DDP-wrapped) ContrastiveStep, ``raw`` the unwrapped one; ``acc``: the
    Accelerator (autocast, backward, no_sync) or None."""
    autocast = acc.autocast if acc is not None else contextlib.nullcontext
    chunks = chunk_inputs(images, tokens, k, raw.masked_inputs(images, tokens, step))
    outs, states = _encode_chunks(raw, chunks, autocast)
    loss, stats, per_side, param_grads = _cached_loss(raw, outs, k, matched, step)
    grads = _chunk_grads(per_side, outs, k)
    device = images.device
    after = _rng_state(device)  # past every draw of the step (the loss may draw too: PCME's samples)
    for i, ((c_images, c_tokens), state, g) in enumerate(zip(chunks, states, grads)):
        last = i == len(chunks) - 1
        _set_rng_state(state, device)
        surrogate = Surrogate(g, param_grads if last else ())
        sync = contextlib.nullcontext() if last or acc is None else acc.no_sync(step_module)
        frozen = frozen_norm_statistics(raw.model) if i >= k else contextlib.nullcontext()  # masked copies
        with sync, frozen:
            with autocast():
                s, _ = step_module(c_images, c_tokens, surrogate=surrogate)
            acc.backward(s) if acc is not None else s.backward()
    _set_rng_state(after, device)
    return loss, stats
