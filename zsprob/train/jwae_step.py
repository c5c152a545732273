"""The jWAE training step (``--method jwae``): autoencoders and the prior discriminator in alternation.

Each step (WAE-GAN's game, as jWAE trains it) first updates the discriminator (N(0, I) samples, drawn from a
generator seeded by (seed, step, rank), against detached codes), then the autoencoders on reconstruction,
adversarial and alignment terms over paired and unpaired rows (:mod:`zsprob.train.jwae_data`). One optimiser,
two groups (``optim.lr``, ``optim.disc_lr``), each update with gradients on one group only. The discriminator
is the step module's ``loss``, so the loop's schedule, checkpoints, resume and hooks apply. Single process."""
from __future__ import annotations

import copy

import torch
from torch import nn

from zsprob.errors import UserError
from zsprob.train.data import mixed_seed
from zsprob.train.schedule import create_optimisation, resolve_schedule
from zsprob.train.step import apply_if_finite, clip_check, count_outcome, fetch, optimizer_step

__all__ = ["JWAEStep", "build", "one_step", "build_model", "build_source"]

PRIOR_SALT = 0x9A1E


class JWAEStep(nn.Module):
    """JWAEModel + JWAEObjective: codes of a batch, and the two halves of the game."""

    def __init__(self, model: nn.Module, loss: nn.Module, seed: int = 0):
        super().__init__()
        self.model, self.loss, self.seed = model, loss, int(seed)

    def codes(self, batch: dict) -> tuple:
        """``(x, x_rec, z)`` of paired images, paired captions, unpaired images, unpaired captions (or None)."""
        m = self.model
        feats = batch["features"]

        def side(x, featurise, autoencode):
            if x is None:
                return None
            return autoencode(x.float() if feats else featurise(x))
        return (side(batch["img"], m.image_features, m.autoencode_image),
                side(batch["txt"], m.text_features, m.autoencode_text),
                side(batch.get("u_img"), m.image_features, m.autoencode_image),
                side(batch.get("u_txt"), m.text_features, m.autoencode_text))

    def discriminator_loss(self, codes: tuple, step: int):
        img, txt, u_img, u_txt = codes
        z_v = torch.cat([img[2]] + ([u_img[2]] if u_img is not None else []))
        z_t = torch.cat([txt[2]] + ([u_txt[2]] if u_txt is not None else []))
        gen = torch.Generator(device=z_v.device).manual_seed(mixed_seed(self.seed, int(step), PRIOR_SALT))
        return self.loss.discriminator_terms(z_v, z_t, generator=gen)

    def generator_loss(self, codes: tuple):
        return self.loss.generator_terms(*codes)


# ----------------------------------------------------------------------------- building

def build_model(cfg):
    """The frozen tower of ``model.name`` / ``model.pretrained`` (deterministic) inside a JWAEModel."""
    from zsprob.models import create_model
    from zsprob.models.jwae import JWAEModel, resolve_jwae_config

    m = cfg.model
    jc = m.jwae
    if not isinstance(jc, dict) or not jc.get("decoder"):
        raise UserError(f"--method jwae needs a model with a decoder config, and model {m.name} has none: set "
                        "model.jwae (latent_dim, image_hidden, text_hidden, decoder), "
                        "e.g. --config jwae_synthetic.yaml")
    jc = resolve_jwae_config(dict(jc))
    kw = {k: m[k] for k in ("embed_dim", "pooling", "weights") if m[k] is not None}
    kw.update(m.overrides)
    kw["deterministic"] = True
    tower = create_model(m.name, pretrained=m.pretrained, seed=int(cfg.seed), **kw)
    torch.manual_seed(int(cfg.seed) + 1)
    return JWAEModel(tower, jc)


def _check_data(cfg) -> None:
    d = cfg.data
    if d.kind != "synthetic":
        raise UserError(f"--method jwae trains on SynthWorld shards (--data synthetic), not {d.kind!r}")
    if d.noise_ratio > 0 or cfg.msda.enabled or d.text_size_augment > 0:
        raise UserError("--method jwae has no caption noise, MSDA or text SizeAugment: turn them off")
    if not d.shards:
        raise UserError("--data synthetic needs --shards (the SynthWorld pretrain folder)")


def build_source(cfg, model):
    """The semi-supervised source over SynthWorld's pretraining split (features cached unless told not to)."""
    from zsprob.data.synthetic import paired_split, read_pretrain_items
    from zsprob.train.jwae_data import FeatureStore, RawStore, SemiSupervisedSource

    d = cfg.data
    items = read_pretrain_items(d.shards)
    paired, unpaired = paired_split(len(items), float(d.paired_fraction), int(cfg.seed))
    # the frozen-feature setting: the evaluation transform, as the features are fixed
    store = RawStore(items, model.preprocess_val, model.tokenizer)
    if d.cache_features and d.feature_cache:
        store = FeatureStore.cached(d.feature_cache, _fingerprint(cfg, model, items), model, store)
    elif d.cache_features:
        store = FeatureStore.build(model, store)
    B = int(d.batch_size)
    return SemiSupervisedSource(store, paired, unpaired, batch_size=B,
                                unpaired_batch_size=int(d.unpaired_batch_size or B),
                                use_unpaired=bool(d.unpaired), seed=int(cfg.seed))


def _fingerprint(cfg, model, items) -> dict:
    """What the cached features depend on: the tower (config and weights) and the samples."""
    import hashlib
    h = hashlib.sha256()
    for k, v in sorted(model.tower.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    d = hashlib.sha256()
    for key, jpeg, caps in zip(items.keys, items.jpegs, items.captions):
        d.update(key.encode() + jpeg + "\n".join(caps).encode())
    return {"tower_config": model.config["tower"], "tower_weights": h.hexdigest(), "n": len(items),
            "samples": d.hexdigest()}


def build_optimisation(cfg, step_module: JWAEStep, plan):
    """One optimiser, two groups (autoencoders, discriminator) and the loop's lr schedule over both."""
    lr = float(cfg.optim.lr)
    groups = [{"params": step_module.model.trainable_parameters(), "lr": lr, "group_name": "autoencoders"},
              {"params": list(step_module.loss.parameters()), "lr": float(cfg.optim.disc_lr or lr / 2),
               "group_name": "discriminator"}]
    return create_optimisation(cfg, groups, plan, lr)


def build(cfg, acc, source):
    """(model, loss, source, plan, step module, optimiser, schedule) of a jWAE run."""
    from zsprob.prob import create_loss

    if acc.num_processes > 1:
        raise UserError("--method jwae runs in a single process (its two-phase step does not go through DDP)")
    if source is None:
        _check_data(cfg)  # bad data options fail before the tower is built
    model = build_model(cfg)
    loss_fn = create_loss("jwae", latent_dim=model.embed_dim, **cfg.loss.jwae)
    model, loss_fn = model.to(acc.device), loss_fn.to(acc.device)
    if source is None:
        source = build_source(cfg, model)
    plan = resolve_schedule(cfg, source.steps_per_epoch)
    step_module = JWAEStep(model, loss_fn, seed=int(cfg.seed))
    optimizer, schedule = build_optimisation(cfg, step_module, plan)
    return model, loss_fn, source, plan, step_module, optimizer, schedule


# ----------------------------------------------------------------------------- one step

def _to(batch: dict, device) -> dict:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _backward_check(run, loss: torch.Tensor, params: list, drop: list) -> torch.Tensor:
    """Backward ``loss``, drop the gradients of ``drop``, clip ``params``; the update's finiteness check."""
    run.acc.backward(loss)
    for p in drop:
        p.grad = None
    return clip_check(run, loss, [params])[0]


def one_step(run, step: int) -> dict:
    """Discriminator update, then autoencoder update, on one semi-supervised batch; returns the stats. One
    verdict for both (the step's one host read): a non-finite term skips the whole step, the discriminator's
    update, made before it so that the autoencoders play against it, undone."""
    batch = _to(fetch(run), run.acc.device)
    raw: JWAEStep = run.raw
    ae_params = raw.model.trainable_parameters()
    disc_params = list(raw.loss.parameters())
    codes = raw.codes(batch)
    d_loss, d_stats = raw.discriminator_loss(codes, step)
    d_check = _backward_check(run, d_loss, disc_params, ae_params)
    kept = {p: (p.detach().clone(), copy.deepcopy(run.optimizer.state[p])) for p in disc_params}
    optimizer_step(run)
    run.optimizer.zero_grad(set_to_none=True)
    g_loss, g_stats = raw.generator_loss(codes)
    ok = apply_if_finite(run, _backward_check(run, g_loss, ae_params, disc_params) + 0.0 * d_check)
    if not ok:  # the discriminator's update undone
        with torch.no_grad():
            for p, (value, state) in kept.items():
                p.copy_(value)
                run.optimizer.state[p] = state
    count_outcome(run, ok, g_loss, step, "jWAE loss")
    return {**g_stats, **d_stats, "n_unpaired_img": 0 if codes[2] is None else codes[2][2].shape[0],
            "n_unpaired_txt": 0 if codes[3] is None else codes[3][2].shape[0]}
