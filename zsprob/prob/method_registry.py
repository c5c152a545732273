"""The training methods: one :func:`register_method` call per name, holding every fact about it.

A declaration names its loss as ``"module:Class"`` (imported when first built, so the command line reads names
and defaults without torch) or the class itself, whether it reads sigma, its default options (the config's
``loss.<name>``; a test holds them equal to the loss's own), its step (:data:`STEP_KINDS`), the model options it
implies and its aliases. Elsewhere: ``register_method("mine", "mypkg.losses:MyLoss", needs_sigma=True)``."""
from __future__ import annotations

import copy
import importlib
import inspect
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from zsprob.errors import UserError

#: the training steps a method can take: the shared contrastive step on image-text batches, or the
#: autoencoder / discriminator alternation of zsprob.train.jwae_step
STEP_KINDS = ("pairwise", "jwae")

#: PCME++'s distances the command line offers (``--distance``): CSD (the paper) and the 2-Wasserstein
#: ablation; PCMEPPLoss also takes "mu", the mean-only distance of MuOnlyLoss
PCMEPP_DISTANCES = ("csd", "wd")

#: the similarities zsprob.prob.score ranks by (``zsprob eval --score``), here so the CLI reads them without torch
SCORE_NAMES = ("csd", "mean", "cosine", "w2", "kl", "minkl", "js", "elk", "bhattacharyya", "mc")


@dataclass(frozen=True)
class Method:
    """One training method: ``loss_ref`` (``"module:attr"`` or the class / factory, ``loss(**options)``),
    ``needs_sigma``, ``loss_defaults`` (``loss.<name>`` of the default config), ``step_kind``,
    ``model_hook`` (``cfg -> {model option: value}``) and ``aliases``."""

    name: str
    loss_ref: Any
    needs_sigma: bool
    loss_defaults: Mapping[str, Any] = field(default_factory=dict)
    step_kind: str = "pairwise"
    model_hook: Callable[[Mapping], dict] | None = None
    aliases: tuple[str, ...] = ()
    needs_negatives: bool = False  # learns only from the other pairs of a batch (its loss is 0 at batch size 1)

    @property
    def loss(self) -> Callable:
        """The loss class or factory (a ``"module:attr"`` reference is imported here)."""
        if not isinstance(self.loss_ref, str):
            return self.loss_ref
        module, _, attr = self.loss_ref.partition(":")
        return getattr(importlib.import_module(module), attr)

    def model_defaults(self, cfg: Mapping) -> dict:
        """Model options this method implies for the training config ``cfg`` (the training loop applies
        them to options the config leaves unset, for a model not loaded from a zsprob checkpoint)."""
        return dict(self.model_hook(cfg)) if self.model_hook is not None else {}

    def default_options(self) -> dict:
        """A copy of :attr:`loss_defaults` (the config's ``loss.<name>`` section)."""
        return copy.deepcopy(dict(self.loss_defaults))


_REGISTRY: dict[str, Method] = {}
_ALIASES: dict[str, str] = {}
#: every entry by its registered name, read-only (a resolved training config's ``method`` is one of them)
METHOD_ENTRIES: Mapping[str, Method] = MappingProxyType(_REGISTRY)


def _key(name) -> str:
    return str(name).strip().lower().replace("_", "-")


def register_method(name: str, loss, *, needs_sigma: bool, loss_defaults=None, step_kind: str = "pairwise",
                    model_defaults: Callable[[Mapping], dict] | None = None, aliases=(),
                    needs_negatives: bool = False) -> Method:
    """Declare a training method (its name last in the ``--method`` choices); returns its entry. A name or
    alias already taken, or an unknown step kind, is a programming error (ValueError)."""
    taken = [n for n in (name, *aliases) if _key(n) in _REGISTRY or _key(n) in _ALIASES]
    if taken:
        raise ValueError(f"method name(s) {taken} already registered")
    if step_kind not in STEP_KINDS:
        raise ValueError(f"method {name!r}: step_kind must be one of {STEP_KINDS}, got {step_kind!r}")
    entry = Method(name, loss, bool(needs_sigma), dict(loss_defaults or {}), step_kind, model_defaults,
                   tuple(aliases), bool(needs_negatives))
    _REGISTRY[name] = entry
    _ALIASES.update({_key(alias): name for alias in aliases})
    return entry


def get_method(name: str, what: str = "method") -> Method:
    """The entry of ``name`` (case, ``_`` for ``-`` and the aliases forgiven); an unknown name is one
    :class:`UserError` line with the choices (``what`` names the thing asked for, e.g. "loss")."""
    key = _key(name)
    entry = _REGISTRY.get(_ALIASES.get(key, key))
    if entry is None:
        raise UserError(f"unknown {what} {name!r} (choose from {', '.join(_REGISTRY)})")
    return entry


def method_names() -> tuple[str, ...]:
    """Every training method, in registration order (the ``--method`` choices)."""
    return tuple(_REGISTRY)


def default_loss_options() -> dict:
    """``{method: its default loss options}``: the ``loss`` section of the training defaults."""
    return {name: entry.default_options() for name, entry in _REGISTRY.items()}


def create_loss(method: str, **kwargs):
    """Build a method's loss by name, ``kwargs`` going to its class (e.g. ``create_loss("pcmepp",
    distance="wd")``; "jwae" needs ``latent_dim``). An unknown name or option is one UserError line."""
    loss = get_method(method, "loss").loss
    try:
        return loss(**kwargs)
    except TypeError as e:
        accepted = [p for p in inspect.signature(loss).parameters if p != "self"]
        raise UserError(f"bad options for loss {method!r}: {e} (accepted: {', '.join(accepted)})") from None


def needs_sigma(method: str) -> bool:
    """Whether the method's loss uses sigma (the model must be probabilistic)."""
    return get_method(method, "loss").needs_sigma


# ----------------------------------------------------------------------------- the built-in methods

def _pcme_model_defaults(cfg: Mapping) -> dict:
    """PCME's official head predicts log sigma (the official loss form reads it so)."""
    form = ((cfg.get("loss") or {}).get("pcme") or {}).get("form", "official")
    return {"sigma_param": "logsigma" if form == "official" else "logvar"}


register_method("pcmepp", "zsprob.prob.losses:PCMEPPLoss", needs_sigma=True, aliases=("pcme++",), loss_defaults={
    "init_scale": 5.0, "init_shift": 5.0, "pp_alpha": 0.1, "vib_beta": 1e-4, "distance": "csd"})
# PCME's official code (naver-ai/pcme configs/coco): a = b = 15 (form defaults), J = 7, beta 1e-5
register_method("pcme", "zsprob.prob.losses:PCMELoss", needs_sigma=True, model_defaults=_pcme_model_defaults,
                loss_defaults={"n_samples": 7, "form": "official", "vib_beta": 1e-5, "uniform_weight": 0.0})
register_method("infonce", "zsprob.prob.losses:InfoNCELoss", needs_sigma=False, aliases=("clip",),
                loss_defaults={"init_temperature": 0.07}, needs_negatives=True)
register_method("triplet", "zsprob.prob.losses:TripletLoss", needs_sigma=False, aliases=("vse", "vsepp"),
                loss_defaults={"margin": 0.2}, needs_negatives=True)
register_method("prob-triplet", "zsprob.prob.losses:ProbTripletLoss", needs_sigma=True,
                aliases=("probtriplet", "pishdad"), loss_defaults={"similarity": "kl", "margin": 0.2})
register_method("mu-only", "zsprob.prob.losses:MuOnlyLoss", needs_sigma=False, aliases=("mu", "muonly"),
                loss_defaults={"init_scale": 5.0, "init_shift": 5.0})
# ProLIP's recipe (naver-ai/prolip scripts/prolip_datacomp_*.sh, params.py)
register_method("prolip", "zsprob.prob.prolip:ProLIPLoss", needs_sigma=True, loss_defaults={
    "ppcl_weight": 1.0, "inclusion_alpha": 1e-7, "inclusion_alpha_occ": 1e-3, "vib_beta": 1e-4,
    "inclusion_scale": 1000.0, "inclusion_eps": -20.0, "init_logit_bias": -10.0,
    "drop_ratio": 0.125, "drop_prob": 0.75, "image_drop_prob": 0.25, "mask_patch_size": 16})
# jWAE: the preset (jwae-mse | jwae-mh) sets lambda1..4 and the alignment; its own training step
register_method("jwae", "zsprob.prob.jwae:JWAEObjective", needs_sigma=False, step_kind="jwae", loss_defaults={
    "preset": "jwae-mh", "rec_kind_img": "l2", "rec_kind_txt": "mse", "margin": 0.2, "negatives": "all"})
