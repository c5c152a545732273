"""PCME++ (naver-ai/pcmepp) official state-dict names <-> zsprob names, for both official layouts.

``hf_models.HfPCMEPPModel`` (the ImageNet zero-shot ViT-B/16 on the Hugging Face hub): open_clip
CLIP names for the mean branch (``visual.*``, ``transformer.*``, ``token_embedding``, ...) plus
``visual.uncertainty_transformer`` / ``uncertainty_transformer`` (the last ``unc_layers`` blocks,
branched off the trunk) and ``visual.uncertainty_proj`` / ``uncertainty_text_projection``; the
loss's ``shift`` / ``negative_scale`` sit at the top level.

The official COCO trainer (``pcmepp.engine.PCMEPPModel``, a Lightning module; weights under the
checkpoint's ``state_dict``): ``img_enc.backbone`` (OpenAI CLIP visual trunk without ``ln_post`` /
``proj``, with ``uncertainty_transformer``), ``img_enc.image_encoder`` / ``image_std_encoder``
(a biased ``fc`` to the embedding size, then GPO ``gpool``), ``img_enc.image_std_ln`` (with
``sigma_ln_init``), ``txt_enc.backbone`` (the CLIP text trunk, ``transformer.prob_resblocks`` for
uncertainty), ``txt_enc.linear`` / ``std_linear``, ``gpool`` / ``std_gpool``, ``text_std_ln``, and
``criterion.shift`` / ``criterion.negative_scale``. Its non-probabilistic baselines
(``is_probabilistic_model: false``: ``configs/others/info_nce.yaml``, ``vse_infty.yaml``,
``pcmepp_mu_only.yaml``; ``EncoderClipImageFull`` / ``EncoderTextClip`` on OpenAI's plain ``CLIP``) hold
the same mean keys and no uncertainty module: layout ``pcmepp-coco-mu`` (:data:`COCO_MU_RULES`), with
the criterion's ``tau`` (InfoNCE), ``shift`` / ``negative_scale`` (PCME) or nothing (triplet). A file
of an SWA run also holds ``swa_*`` copies (:data:`SWA_COPIES`); :mod:`zsprob.models.convert.swa` picks one
copy and hands on the plain layout, which these rules rename.

The mean-branch rules of the HF layout name today's ``ProbCLIP`` parameters; the sigma rules name
the official-layout block heads of ``zsprob.models.prob_clip`` (``SigmaHead``: ``blocks``, ``proj``,
``gpo``, ``sigma_ln``). The COCO trainer's rules name a ``ProbCLIP`` built with ``mean_head="fc"``
(``image_head.fc`` / ``text_head.fc``: the biased Linear before GPO; the sigma head's ``proj`` is a
biased Linear there too, its ``sigma_ln`` the official ``image_std_ln`` / ``text_std_ln``).
"""
from zsprob.models.convert.mapping import Rule

FAMILY = "pcmepp"
MODELS = ("pcmepp-ViT-B-16", "pcmepp-coco-ViT-B-32", "pcmepp-coco-ViT-B-16", "pcmepp-coco-ViT-L-14")

HF_RULES = [
    Rule("visual.uncertainty_transformer.resblocks.{i}.{rest}", "image_sigma.blocks.{i}.{rest}", "sigma"),
    Rule("visual.uncertainty_proj", "image_sigma.proj", "sigma"),
    Rule("uncertainty_transformer.resblocks.{i}.{rest}", "text_sigma.blocks.{i}.{rest}", "sigma"),
    Rule("uncertainty_text_projection", "text_sigma.proj", "sigma"),
    Rule("shift", "loss.shift", "loss"),
    Rule("negative_scale", "loss.negative_scale", "loss"),
    Rule("logit_scale", "clip.logit_scale"),
    Rule("visual.{rest}", "clip.visual.{rest}"),
    Rule("transformer.{rest}", "clip.transformer.{rest}"),
    Rule("token_embedding.{rest}", "clip.token_embedding.{rest}"),
    Rule("positional_embedding", "clip.positional_embedding"),
    Rule("ln_final.{rest}", "clip.ln_final.{rest}"),
    Rule("text_projection", "clip.text_projection"),
]

# the COCO trainer's head modules, per tower: the mean head's fc and GPO, the std branch's fc, GPO and LayerNorm
COCO_HEADS = {
    "image": dict(fc="img_enc.image_encoder.fc", gpo="img_enc.image_encoder.gpool",
                  std_fc="img_enc.image_std_encoder.fc", std_gpo="img_enc.image_std_encoder.gpool",
                  std_ln="img_enc.image_std_ln"),
    "text": dict(fc="txt_enc.linear", gpo="txt_enc.gpool", std_fc="txt_enc.std_linear", std_gpo="txt_enc.std_gpool",
                 std_ln="txt_enc.text_std_ln"),
}


def _coco_head_rules(side: str) -> list[Rule]:
    """The rules of one tower's heads (``side``: image | text), from its official names in :data:`COCO_HEADS`."""
    n = COCO_HEADS[side]
    return [
        Rule(n["fc"] + ".{rest}", f"{side}_head.fc.{{rest}}"),
        Rule(n["gpo"] + ".gru.{rest}", f"{side}_gpo.gru.{{rest}}"),
        Rule(n["gpo"] + ".linear.weight", f"{side}_gpo.score.weight"),
        Rule(n["std_fc"] + ".{rest}", f"{side}_sigma.proj.{{rest}}", "sigma"),
        Rule(n["std_gpo"] + ".gru.{rest}", f"{side}_sigma.gpo.gru.{{rest}}", "sigma"),
        Rule(n["std_gpo"] + ".linear.weight", f"{side}_sigma.gpo.score.weight", "sigma"),
        Rule(n["std_ln"] + ".{rest}", f"{side}_sigma.sigma_ln.{{rest}}", "sigma"),
    ]


COCO_RULES = [
    # image tower
    Rule("img_enc.backbone.uncertainty_transformer.resblocks.{i}.{rest}", "image_sigma.blocks.{i}.{rest}", "sigma"),
    Rule("img_enc.backbone.{rest}", "clip.visual.{rest}"),
    *_coco_head_rules("image"),
    # text tower
    Rule("txt_enc.backbone.transformer.prob_resblocks.{i}.{rest}", "text_sigma.blocks.{i}.{rest}", "sigma"),
    Rule("txt_enc.backbone.transformer.resblocks.{i}.{rest}", "clip.transformer.resblocks.{i}.{rest}"),
    Rule("txt_enc.backbone.token_embedding.{rest}", "clip.token_embedding.{rest}"),
    Rule("txt_enc.backbone.positional_embedding", "clip.positional_embedding"),
    Rule("txt_enc.backbone.ln_final.{rest}", "clip.ln_final.{rest}"),
    *_coco_head_rules("text"),
    # loss (pcmepp / pcme criteria; InfoNCE's temperature)
    Rule("criterion.shift", "loss.shift", "loss"),
    Rule("criterion.negative_scale", "loss.negative_scale", "loss"),
    Rule("criterion.tau", "loss.tau", "loss"),
]

# the mu-only COCO trainer (is_probabilistic_model: false): the same rules without the uncertainty modules
COCO_MU_RULES = [rule for rule in COCO_RULES if rule.branch != "sigma"]

# the COCO trainer's SWA copies (train.swa_start_epoch set, as configs/pcmepp.yaml does): pcmepp/engine.py wraps
# img_enc, txt_enc and, for a probabilistic model only, criterion in torch.optim.swa_utils.AveragedModel, whose
# state is the update count n_averaged and the averaged module under ``module.`` (zsprob.models.convert.swa)
SWA_COPIES = {"pcmepp-coco": {"img_enc": "swa_img_enc", "txt_enc": "swa_txt_enc", "criterion": "swa_criterion"},
              "pcmepp-coco-mu": {"img_enc": "swa_img_enc", "txt_enc": "swa_txt_enc"}}
SWA_MODULE, SWA_COUNT = "module.", "n_averaged"


def raw_name(key: str) -> str:
    """The raw module's key of an SWA copy's key (``swa_img_enc.module.fc.weight`` -> ``img_enc.fc.weight``)."""
    copy, _, rest = key.partition(".")
    if copy.startswith("swa_") and rest.startswith(SWA_MODULE):
        return f"{copy[len('swa_'):]}.{rest[len(SWA_MODULE):]}"
    return key


# the uncertainty modules of a probabilistic COCO trainer file, each in every such file (key prefixes)
COCO_SIGMA_PARTS = {"image uncertainty blocks": "img_enc.backbone.uncertainty_transformer.",
                    "image std encoder": "img_enc.image_std_encoder.",
                    "text uncertainty blocks": "txt_enc.backbone.transformer.prob_resblocks.",
                    "text std head": "txt_enc.std_linear."}


def coco_layout(state) -> str:
    """``pcmepp-coco`` when a COCO trainer file holds any uncertainty module (raw or SWA copy), else
    ``pcmepp-coco-mu``."""
    has = any(raw_name(k).startswith(tuple(COCO_SIGMA_PARTS.values())) for k in state)
    return "pcmepp-coco" if has else "pcmepp-coco-mu"


def coco_sigma_parts(state) -> tuple[list[str], list[str]]:
    """(uncertainty modules present, absent) in a COCO trainer state dict."""
    present = [part for part, prefix in COCO_SIGMA_PARTS.items() if any(k.startswith(prefix) for k in state)]
    return present, [part for part in COCO_SIGMA_PARTS if part not in present]
