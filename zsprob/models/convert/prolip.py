"""ProLIP (naver-ai/prolip, ``prolip.model.ProLIP``) official state-dict names <-> zsprob names.

ProLIP's towers are open_clip's ViT and TextTransformer with one extra learned [UNC] token each
(``visual.unc_embedding``, ``text.unc_emb``; the positional embeddings are one row longer for it)
whose output goes through its own projection (``visual.uncertainty_proj``,
``text.text_uncertainty_projection``) to log sigma^2. The mean branch keeps open_clip's names
under ``clip.``; the [UNC] rows map onto the ``image_sigma`` / ``text_sigma`` head that
``model.sigma_head: "unc"`` builds (names below are that head's; the head itself lands in
``zsprob.models.prob_clip``).
"""
from zsprob.models.convert.mapping import Rule

FAMILY = "prolip"
MODELS = ("prolip-ViT-B-16", "prolip-ViT-B-16-long", "prolip-ViT-L-16", "prolip-ViT-H-14", "prolip-ViT-SO400M-14")

RULES = [
    # uncertainty: the [UNC] tokens and their projections
    Rule("visual.unc_embedding", "image_sigma.unc_embedding", "sigma"),
    Rule("visual.uncertainty_proj.{rest}", "image_sigma.proj.{rest}", "sigma"),
    Rule("text.unc_emb", "text_sigma.unc_embedding", "sigma"),
    Rule("text.text_uncertainty_projection.{rest}", "text_sigma.proj.{rest}", "sigma"),
    # mean: open_clip CustomTextCLIP names (visual.*, text.*, logit scale and SigLIP bias)
    Rule("logit_scale", "clip.logit_scale"),
    Rule("logit_bias", "clip.logit_bias"),
    Rule("visual.{rest}", "clip.visual.{rest}"),
    Rule("text.{rest}", "clip.text.{rest}"),
]
