"""PCME++ (naver-ai/pcmepp) official state-dict names <-> zsprob names, as data: ``HF_RULES`` for the hub's
``HfPCMEPPModel``, ``COCO_RULES`` / ``COCO_MU_RULES`` for the COCO trainer's files (``mean_head="fc"``)."""
from zsprob.errors import UserError
from zsprob.models.convert.mapping import Rule

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

SWA_MODULE, SWA_COUNT = "module.", "n_averaged"  # torch.optim.swa_utils.AveragedModel's state (.swa)


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


def is_coco(keys) -> bool:
    """Whether a file's keys are the COCO trainer's (raw modules or SWA copies)."""
    return any(k.startswith(("img_enc.", "txt_enc.", "swa_img_enc.", "swa_txt_enc.")) for k in keys)


def has_sigma(keys) -> bool:
    """Whether a COCO trainer file holds any uncertainty module (raw or SWA copy)."""
    return any(raw_name(k).startswith(tuple(COCO_SIGMA_PARTS.values())) for k in keys)


def check_sigma_parts(state, source) -> None:
    """A probabilistic COCO trainer file holds every uncertainty module (one line naming what it lacks)."""
    present = [part for part, prefix in COCO_SIGMA_PARTS.items() if any(k.startswith(prefix) for k in state)]
    absent = [part for part in COCO_SIGMA_PARTS if part not in present]
    if absent:
        raise UserError(f"{source}: neither PCME++ COCO layout: it has {', '.join(present)} but no "
                        f"{', '.join(absent)} (a probabilistic trainer file has all four, a mu-only one none)")
