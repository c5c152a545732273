"""zsprob.zeroshot: prompt banks, uncertainty-based prompt selection, zero-shot classification.

May import data, models, prob, report (plots), ``zsprob.methods``, ``zsprob.errors``, ``zsprob.utils`` and
the root package; never train, retrieval or cli. Entry point: ``compare_strategies(model, root=...,
dataset="synthetic", out_dir=...)`` runs every strategy (its ``["table"]`` is the comparison). Imports are
lazy, so ``import zsprob.zeroshot`` does not import torch."""
from __future__ import annotations

_EXPORTS = {
    "ZeroShotRequest": "options", "PromptBank": "prompts", "build_prompt_bank": "prompts",
    "load_templates": "prompts", "load_classnames": "prompts", "Selection": "selection_base",
    "NeedsSigma": "selection_base", "run_strategy": "selection", "register_strategy": "strategy_registry",
    "get_strategy": "strategy_registry", "select_all": "selection", "select_topk": "selection",
    "select_auto": "selection", "select_fusion": "selection", "select_poe": "selection", "select_oracle": "selection",
    "select_bprw": "baselines", "select_bprw_fewshot": "baselines", "select_zpe": "baselines",
    "select_carprt": "carprt", "select_carprt_shared": "carprt", "build_pool_bank": "pools",
    "load_class_prompts": "pools", "paired_stats": "paired", "compare_strategies": "classify",
    "compare_on_features": "classify", "run_selection": "classify", "zeroshot_eval": "classify",
    "class_scores": "metrics", "evaluate_scores": "metrics", "load_selection": "classify",
    "save_selection": "classify", "ImageFeatures": "features",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"zsprob.zeroshot.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
