"""The head options of a :class:`~zsprob.models.ProbCLIP`: one record, each option declared once with its
default, its value in a checkpoint saved before it existed (``legacy``), whether fine-tuning keeps a
checkpoint's value (``inherit``) and its allowed values. Checks needing a built tower stay in ProbCLIP.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields

from zsprob.errors import UserError
from zsprob.models.sigma_heads import (DEFAULT_BIAS_INIT, SIGMA_HEADS, SIGMA_LAYOUTS, SIGMA_PARAMS, SIGMA_SHAPES,
                                       UNC_LAYOUTS)

MEAN_HEADS = ("proj", "fc")
_REQUIRED = object()  # a saved config without the key is refused (it predates no option)


def _option(default, *, choices=None, cast=None, legacy=MISSING, inherit=False):
    """A field of :class:`ModelOptions`; ``legacy`` defaults to ``default`` (MISSING) or is required."""
    meta = {"choices": choices, "cast": cast, "legacy": default if legacy is MISSING else legacy, "inherit": inherit}
    return field(default=default, metadata=meta)


def _list(value):
    return list(value) if value is not None else None


@dataclass
class ModelOptions:
    """What a ProbCLIP is beyond its towers: each head option with its default, its check and the value a
    checkpoint saved before the option existed gets; docs/models.md says what each option does. Values keep the
    caller's types but for the declared casts, as ``model.config`` (and so the fingerprint) holds them.
    """

    sigma_depth: int = _option(1, cast=int, legacy=_REQUIRED)
    sigma_init: str = _option("random", choices=("random", "copy"), legacy=_REQUIRED)
    pooling: str = _option("gpo", choices=("gpo", "native"), legacy=_REQUIRED)
    deterministic: bool = _option(False, cast=bool, legacy=_REQUIRED)
    var_bounds: list | None = _option(None, cast=_list, legacy=_REQUIRED)
    normalize_mu: bool = _option(True, cast=bool)
    gpo_dim: int = _option(32, cast=int)
    sigma_head: str = _option("block", choices=SIGMA_HEADS, inherit=True)
    sigma_layout: str = _option("official", choices=SIGMA_LAYOUTS, legacy="legacy", inherit=True)
    sigma_ln_init: float | None = _option(None, inherit=True)
    sigma_ln_init_bias: float = _option(0.0, inherit=True)
    sigma_param: str = _option("logvar", choices=SIGMA_PARAMS, inherit=True)
    sigma_shape: str = _option("diagonal", choices=SIGMA_SHAPES, inherit=True)
    unc_layout: str = _option("zsprob", choices=UNC_LAYOUTS, inherit=True)
    sigma_detach: bool = _option(False, cast=bool, inherit=True)
    mean_head: str = _option("proj", choices=MEAN_HEADS, inherit=True)
    sigma_bias_init: float | None = _option(None, legacy=0.0)  # None: the head kind's (DEFAULT_BIAS_INIT)
    truncate_text: bool = _option(True, cast=bool)
    size_augment: float = _option(0.0, cast=float)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata["choices"] is not None and value not in f.metadata["choices"]:
                raise UserError(f"{f.name} must be one of {', '.join(f.metadata['choices'])}, got {value!r}")
            if f.metadata["cast"] is not None:
                setattr(self, f.name, f.metadata["cast"](value))
        if self.sigma_bias_init is None:
            self.sigma_bias_init = DEFAULT_BIAS_INIT[self.sigma_head]
        self._check()

    def _check(self) -> None:
        head = self.sigma_head
        if head in ("unc", "pcme") and self.deterministic:
            raise UserError(f"sigma_head {head!r} needs a probabilistic model; a deterministic model (InfoNCE / "
                            "triplet methods) has no log-variance head")
        if head in ("unc", "pcme") and self.sigma_init == "copy":
            raise UserError(f"sigma_init 'copy' has nothing to copy with sigma_head {head!r} (no duplicated "
                            "blocks); use sigma_init 'random'")
        for key in ("sigma_ln_init", "sigma_ln_init_bias", "sigma_bias_init"):
            value = getattr(self, key)
            if value is None and key == "sigma_ln_init":
                continue
            try:
                finite = not isinstance(value, bool) and math.isfinite(float(value))
            except (TypeError, ValueError):
                finite = False
            if not finite:
                raise UserError(f"{key} must be a finite number{' or null' if key == 'sigma_ln_init' else ''}, "
                                f"got {value!r}")
        if self.mean_head == "fc" and head != "block":
            raise UserError(f"mean_head 'fc' (PCME++'s COCO layout) goes with sigma_head 'block', got {head!r}")
        if not 0.0 <= self.size_augment < 1.0:
            raise UserError(f"size_augment must be in [0, 1), got {self.size_augment}")
        if self.var_bounds is not None:
            bounds = (float(self.var_bounds[0]), float(self.var_bounds[1]))
            if not 0 < bounds[0] < bounds[1]:
                raise UserError(f"var_bounds must satisfy 0 < lo < hi, got {bounds}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def inherited(cls, checkpoint_config: dict) -> dict:
        """The options a fine-tuned zsprob checkpoint passes on (its head kind), legacy values where it lacks them."""
        return {f.name: checkpoint_config.get(f.name, f.metadata["legacy"]) for f in fields(cls)
                if f.metadata["inherit"]}

    @classmethod
    def from_config(cls, config: dict) -> ModelOptions:
        """The options of a ``model.config`` (a saved one may lack the newer keys: their legacy values)."""
        values = {}
        for f in fields(cls):
            if f.name in config:
                values[f.name] = config[f.name]
            elif f.metadata["legacy"] is _REQUIRED:
                raise UserError(f"model config lacks {f.name!r}")
            else:
                values[f.name] = f.metadata["legacy"]
        return cls(**values)

    def config(self) -> dict:
        """The options as ``model.config`` holds them."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def bounds(self) -> tuple[float, float] | None:
        """``var_bounds`` as floats, or None."""
        return None if self.var_bounds is None else (float(self.var_bounds[0]), float(self.var_bounds[1]))
