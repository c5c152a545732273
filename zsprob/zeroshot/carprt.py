"""CARPRT (ICLR 2026): class-aware prompt reweighting from unlabelled images, and its class-shared counterpart.

With ``l[n, c, t] = 100 cos(x_n, mu_ct)``, template t sends image n to ``argmax_c l`` with score ``max_c l``.
``carprt``: ``w[c, :] = softmax_t(score[c, :] / temperature)``, score = mean of those scores over the images t
sends to c (0 when none); ``carprt-shared``: one weight per template from its mean score over all images. Class
vector = ``sum_t w mu_ct / ||mu_ct||`` (not renormalised). Transductive. Reference, read and not copied: the
authors' ``test.py`` (github tmlr-group/CARPRT). Plain torch."""
from __future__ import annotations

import functools

import torch

from zsprob.errors import UserError
from zsprob.zeroshot.selection_base import Selection, as_feats, make_selection, slot_logits
from zsprob.zeroshot.strategy_registry import StrategyInputs

LOGIT_SCALE = 100.0


def carprt_scores(bank, feats, logit_scale: float = LOGIT_SCALE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(score [C, T], counts [C, T], shared [T])`` of the module docstring, in float64."""
    x, _ = as_feats(feats)
    C, T = bank.num_classes, bank.num_templates
    sums = torch.zeros(C, T, dtype=torch.float64)
    counts = torch.zeros(C, T, dtype=torch.float64)
    shared = torch.zeros(T, dtype=torch.float64)
    for t in range(T):
        best, pred = slot_logits(bank, x, t, logit_scale).max(1)   # first maximum on ties, as torch.max
        sums[:, t].index_add_(0, pred, best)
        counts[:, t].index_add_(0, pred, torch.ones_like(best))
        shared[t] = best.mean()
    score = torch.where(counts > 0, sums / counts.clamp_min(1), torch.zeros_like(sums))
    return score, counts, shared


def select_carprt(bank, pool_feats, *, shared: bool = False, temperature: float = 1.0,
                  logit_scale: float = LOGIT_SCALE, data: str = "unlabelled images") -> Selection:
    """CARPRT's class-specific template weights, or with ``shared`` one weight per template for every class
    (module docstring). Works without sigma^2."""
    if temperature <= 0:
        raise UserError(f"carprt temperature must be positive, got {temperature}")
    score, counts, template_scores = carprt_scores(bank, pool_feats, logit_scale)
    info = {"data_used": data, "n_pool_images": int(as_feats(pool_feats)[0].shape[0]), "logit_scale": logit_scale,
            "temperature": temperature}
    if shared:
        logits = template_scores[None].expand(bank.num_classes, bank.num_templates)
        strategy, label = "carprt-shared", "CARPRT class-shared"
        info.update(template_scores=template_scores.tolist(),
                    rule="w_t = softmax_t(mean_n max_c l[n, c, t] / temperature), shared by classes")
    else:
        logits, strategy, label = score, "carprt", "CARPRT (class-aware)"
        info.update(class_scores=score.tolist(), class_counts=counts.long().tolist(),
                    reference="CARPRT (ICLR 2026), github tmlr-group/CARPRT test.py")
    logits = logits / temperature
    mask = bank.mask
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    W = torch.softmax(logits, dim=-1)
    return make_selection(bank, strategy, label, W.float(), renormalize=False, var_rule="mean", info=info)


#: the class-shared weighting: one softmax weight per template from its mean max-logit
select_carprt_shared = functools.partial(select_carprt, shared=True)


# ----------------------------------------------------------------------------- the registry's runners

def run_carprt(bank, given: StrategyInputs) -> Selection:
    return select_carprt(bank, given.pool, data=given.pool_data)


def run_carprt_shared(bank, given: StrategyInputs) -> Selection:
    return select_carprt(bank, given.pool, shared=True, data=given.pool_data)
