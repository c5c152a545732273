"""The training methods: one registry entry per name, carrying every fact a caller reads.

An entry (:class:`Method`) holds the method's loss (a class or factory, built by
:func:`zsprob.prob.create_loss`), whether the loss reads sigma (the model must be probabilistic),
its default loss options (``DEFAULTS["loss"][name]`` in :mod:`zsprob.train.defaults` is read from
here), the kind of training step it takes (``"pairwise"``: the shared contrastive step on image-text
batches; ``"jwae"``: the autoencoder / discriminator alternation of :mod:`zsprob.train.jwae_step`),
the model options it implies (:meth:`Method.model_defaults`, e.g. PCME's ``sigma_param``) and the
aliases ``create_loss`` accepts. Everyone reads the entries instead of keeping a list:
``create_loss`` / ``needs_sigma``, the training defaults, ``zsprob.train.METHODS`` and the command
line's ``--method`` choices (:func:`method_names`, through ``zsprob.methods.METHODS``).

A method defined anywhere registers its loss and its facts in one call, timm-style::

    register_method("mine", loss=MyLoss, needs_sigma=True, loss_defaults={"margin": 0.2})

The built-in methods are declared below without torch, so the configuration defaults and the command
line need no torch import; their loss classes attach themselves by name where they are defined
(:func:`method_loss` in :mod:`zsprob.prob.losses`). Plain Python; imports only zsprob.errors.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from zsprob.errors import UserError

#: the training steps a method can take (zsprob.train.loop picks its step by this)
STEP_KINDS = ("pairwise", "jwae")


@dataclass
class Method:
    """One training method's facts and loss.

    ``loss``: class or factory, ``loss(**options) -> nn.Module``; ``needs_sigma``: the loss reads
    log-variances; ``loss_defaults``: its options in the default config (``loss.<name>``);
    ``step_kind``: one of :data:`STEP_KINDS`; ``model_hook``: ``cfg -> {model option: value}``,
    defaults for model options the config leaves unset (see :meth:`model_defaults`);
    ``aliases``: other spellings ``create_loss`` accepts.
    """

    name: str
    needs_sigma: bool
    loss_defaults: Mapping[str, Any] = field(default_factory=dict)
    step_kind: str = "pairwise"
    model_hook: Callable[[Mapping], dict] | None = None
    aliases: tuple[str, ...] = ()
    loss: Callable | None = None

    def model_defaults(self, cfg: Mapping) -> dict:
        """Model options this method implies for the training config ``cfg`` (applied by the training
        loop to options the config leaves unset, for a model not loaded from a zsprob checkpoint)."""
        return dict(self.model_hook(cfg)) if self.model_hook is not None else {}

    def default_options(self) -> dict:
        """A copy of :attr:`loss_defaults` (the config's ``loss.<name>`` section)."""
        return copy.deepcopy(dict(self.loss_defaults))


_REGISTRY: dict[str, Method] = {}
_ALIASES: dict[str, str] = {}
#: every entry by its registered name, read-only (a resolved training config's ``method`` is one of
#: these names; :func:`get_method` also forgives case, ``_`` and the aliases, with a one-line error)
METHOD_ENTRIES: Mapping[str, Method] = MappingProxyType(_REGISTRY)


def _key(name) -> str:
    return str(name).strip().lower().replace("_", "-")


def register_method(name: str, *, needs_sigma: bool, loss: Callable | None = None, loss_defaults=None,
                    step_kind: str = "pairwise", model_defaults: Callable[[Mapping], dict] | None = None,
                    aliases=()) -> Method:
    """Add a training method (its name last in the ``--method`` choices); returns its entry.

    ``loss`` may be attached later with :func:`method_loss` (the built-ins' classes do so). A name or
    alias already taken, or an unknown step kind, is a programming error (ValueError).
    """
    taken = [n for n in (name, *aliases) if _key(n) in _REGISTRY or _key(n) in _ALIASES]
    if taken:
        raise ValueError(f"method name(s) {taken} already registered")
    if step_kind not in STEP_KINDS:
        raise ValueError(f"method {name!r}: step_kind must be one of {STEP_KINDS}, got {step_kind!r}")
    entry = Method(name, bool(needs_sigma), dict(loss_defaults or {}), step_kind, model_defaults,
                   tuple(aliases), loss)
    _REGISTRY[name] = entry
    _ALIASES.update({_key(alias): name for alias in aliases})
    return entry


def method_loss(name: str):
    """Decorator: the class (or factory) it decorates is the loss of the registered method ``name``."""
    def attach(loss):
        if name not in _REGISTRY:
            raise ValueError(f"method {name!r} is not registered")
        _REGISTRY[name].loss = loss
        return loss
    return attach


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


def methods_without_loss() -> list[str]:
    return [name for name, entry in _REGISTRY.items() if entry.loss is None]


# ----------------------------------------------------------------------------- the built-in methods
# (the losses are described in zsprob.prob.losses; each class there attaches itself with @method_loss)

def _pcme_model_defaults(cfg: Mapping) -> dict:
    """PCME's official head predicts log sigma (the official loss form reads it so)."""
    form = ((cfg.get("loss") or {}).get("pcme") or {}).get("form", "official")
    return {"sigma_param": "logsigma" if form == "official" else "logvar"}


register_method("pcmepp", needs_sigma=True, aliases=("pcme++",), loss_defaults={
    "init_scale": 5.0, "init_shift": 5.0, "pp_alpha": 0.1, "vib_beta": 1e-4, "distance": "csd"})
# PCME's official code (naver-ai/pcme configs/coco): a = b = 15 (form defaults), J = 7, beta 1e-5
register_method("pcme", needs_sigma=True, model_defaults=_pcme_model_defaults, loss_defaults={
    "n_samples": 7, "form": "official", "vib_beta": 1e-5, "uniform_weight": 0.0})
register_method("infonce", needs_sigma=False, aliases=("clip",), loss_defaults={"init_temperature": 0.07})
register_method("triplet", needs_sigma=False, aliases=("vse", "vsepp"), loss_defaults={"margin": 0.2})
register_method("prob-triplet", needs_sigma=True, aliases=("probtriplet", "pishdad"),
                loss_defaults={"similarity": "kl", "margin": 0.2})
register_method("mu-only", needs_sigma=False, aliases=("mu", "muonly"),
                loss_defaults={"init_scale": 5.0, "init_shift": 5.0})
# ProLIP's recipe (naver-ai/prolip scripts/prolip_datacomp_*.sh, params.py); zsprob.prob.prolip
register_method("prolip", needs_sigma=True, loss_defaults={
    "ppcl_weight": 1.0, "inclusion_alpha": 1e-7, "inclusion_alpha_occ": 1e-3, "vib_beta": 1e-4,
    "inclusion_scale": 1000.0, "inclusion_eps": -20.0, "init_logit_bias": -10.0,
    "drop_ratio": 0.125, "drop_prob": 0.75, "image_drop_prob": 0.25, "mask_patch_size": 16})
# jWAE (zsprob.prob.jwae): preset jwae-mse | jwae-mh sets lambda1..4 and the alignment; its own step
register_method("jwae", needs_sigma=False, step_kind="jwae", loss_defaults={
    "preset": "jwae-mh", "rec_kind_img": "l2", "rec_kind_txt": "mse", "margin": 0.2, "negatives": "all"})
