"""zsprob.zeroshot: prompt banks, uncertainty-based prompt selection, zero-shot classification.

Owns prompt banks, prompt-selection strategies and zero-shot classification. May import data,
models, prob, report (plots), ``zsprob.methods``, ``zsprob.errors``, ``zsprob.utils`` and the root
package; never train, retrieval or cli.

    from zsprob.zeroshot import compare_strategies
    res = compare_strategies(model, "synth_out", dataset="synthetic", out_dir="zs")   # every strategy
    print(res["table"])

Modules: ``prompts`` (template / class files, the cached prompt bank), ``pools`` (per-class prompt
pools from CuPL-style JSON files, as a padded bank), ``strategy_registry`` (every strategy's facts: data
read, evaluation labels, transductive, label split, sigma^2, K, ``--compare`` order), ``selection_base``
(the Selection container, weights -> class Gaussians), ``selection`` (the uncertainty strategies,
selection-split searches, oracles, the dispatcher), ``baselines`` (ProLIP BPRW in its NN and few-shot
modes, ZPE), ``carprt`` (CARPRT and its class-shared counterpart), ``features`` (image embeddings of a
split and their cache), ``metrics`` (scores, accuracy, label-free diagnostics), ``paired`` (paired
bootstrap, McNemar, minimum detectable effect), ``classify`` (``compare_strategies``, tables and plots,
the functions behind ``zsprob select-prompts`` / ``zsprob zeroshot``).
Imports are lazy so ``import zsprob.zeroshot`` does not import torch.
"""
from __future__ import annotations

_EXPORTS = {
    "PromptBank": "prompts", "build_prompt_bank": "prompts", "load_templates": "prompts",
    "load_classnames": "prompts", "model_fingerprint": "prompts",
    "Selection": "selection", "run_strategy": "selection", "STRATEGIES": "strategy_registry",
    "register_strategy": "strategy_registry", "get_strategy": "strategy_registry",
    "select_all": "selection", "select_topk": "selection", "select_auto": "selection",
    "select_fusion": "selection", "select_poe": "selection", "select_bprw": "selection",
    "select_zpe": "selection", "select_oracle": "selection", "NeedsSigma": "selection",
    "select_bprw_fewshot": "selection", "select_carprt": "selection", "select_carprt_shared": "selection",
    "build_pool_bank": "pools", "load_class_prompts": "pools", "paired_stats": "paired",
    "compare_strategies": "classify", "compare_on_features": "classify", "run_selection": "classify",
    "zeroshot_eval": "classify", "class_scores": "metrics", "evaluate_scores": "metrics",
    "load_selection": "classify", "save_selection": "classify", "ImageFeatures": "features",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        mod = importlib.import_module(f"zsprob.zeroshot.{_EXPORTS[name]}")
        return getattr(mod, name)
    raise AttributeError(name)
